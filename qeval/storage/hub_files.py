"""Files of a Hugging Face Hub repository, through huggingface_hub and into its own cache (its settings are
huggingface_hub's: HF_HOME or HF_HUB_CACHE, HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE, HF_HUB_DISABLE_PROGRESS_BARS; qeval
sets none): a repo's listing (or, offline, what of it is cached), a file downloaded, files uploaded in one commit,
and huggingface_hub's exceptions as one-line QevalErrors. Shared by `hf:` models (qeval.inputs.hub), published
references (qeval.storage.reference_pack) and results datasets (qeval.storage.results_dataset); a repository is a
model repository unless `repo_type` says "dataset". huggingface_hub is imported only when a Hub spec is used (a slow
import)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from qeval.errors import QevalError

PREFIX = "hf:"


def is_hub_spec(spec: str | Path) -> bool:
    return str(spec).startswith(PREFIX)


def split_spec(spec: str, kind: str, tag: str, example: str) -> tuple[str, str]:
    """(USER/REPO, TAG or "") of `hf:USER/REPO[:TAG]`; a malformed one refused with what a `kind` spec looks like."""
    repo, _, found = spec.removeprefix(PREFIX).partition(":")
    owner, slash, name = repo.partition("/")
    if not (owner and slash and name) or "/" in name:
        raise QevalError(f"bad {kind} {spec!r}: expected hf:USER/REPO or hf:USER/REPO:{tag}, e.g. {example}")
    return repo, found


def repo_files(repo: str, repo_type: str = "model") -> tuple[list[str], str]:
    """The repo's file paths, and where they were listed: the Hub, or with HF_HUB_OFFLINE set the files
    of it already in the cache (as llama.cpp lists its cache offline)."""
    from huggingface_hub import HfApi, is_offline_mode  # noqa: PLC0415 - slow import, only for hf: specs

    if is_offline_mode():
        return _cached_files(repo, repo_type), f"the cached files of {repo} (HF_HUB_OFFLINE is set)"
    with hub_errors(repo, repo_type=repo_type):
        return [sibling.rfilename for sibling in HfApi().repo_info(repo, repo_type=repo_type).siblings or []], repo


def _cached_files(repo: str, repo_type: str = "model") -> list[str]:
    """The files of `repo`'s main revision in the hub cache (huggingface_hub's layout: refs/main names the
    snapshot folder that holds them)."""
    from huggingface_hub import constants  # noqa: PLC0415
    from huggingface_hub.file_download import repo_folder_name  # noqa: PLC0415

    folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type=repo_type)
    try:
        snapshot = folder / "snapshots" / (folder / "refs" / "main").read_text().strip()
    except OSError:
        raise QevalError(f"HF_HUB_OFFLINE is set and nothing of {repo} is in the cache {constants.HF_HUB_CACHE}: "
                         "unset HF_HUB_OFFLINE to download it") from None
    return [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]


def download(repo: str, filename: str, repo_type: str = "model") -> str:
    """huggingface_hub's hf_hub_download: into its cache, resuming a cut connection, with its progress bar;
    a file already cached is not fetched again."""
    from huggingface_hub import hf_hub_download  # noqa: PLC0415

    with hub_errors(repo, filename, repo_type=repo_type):
        return hf_hub_download(repo, filename, repo_type=repo_type)


def upload(repo: str, files: list[tuple[str, Path]], message: str, private: bool = False,
           repo_type: str = "model"):
    """One commit of every file ((path in the repository, local path): created or replaced), the repository created
    first (`private`) if it is not there; huggingface_hub's CommitInfo."""
    from huggingface_hub import CommitOperationAdd, HfApi  # noqa: PLC0415 - slow import, only to publish

    api = HfApi()
    with hub_errors(repo, access="write", repo_type=repo_type):
        api.create_repo(repo, exist_ok=True, private=private, repo_type=repo_type)
        # paths, never bytes: huggingface_hub uploads a file object over plain HTTP instead of Xet
        operations = [CommitOperationAdd(path, str(local)) for path, local in files]
        try:
            return api.create_commit(repo, operations, commit_message=message, repo_type=repo_type)
        except ValueError as exc:  # what huggingface_hub refuses before the commit: a card's metadata, say
            raise QevalError(f"hf:{repo}: the upload was refused: {' '.join(str(exc).split())}") from None


@contextlib.contextmanager
def hub_errors(repo: str, filename: str | None = None, access: str = "read", repo_type: str = "model"):
    """huggingface_hub's exceptions as one-line QevalErrors that say what to do; `access`: what the token must be
    allowed to do ("read", or "write" for an upload)."""
    try:
        yield
    except Exception as exc:
        message = _hub_error_message(exc, repo, filename, access, repo_type)
        if message is None:
            raise
        raise QevalError(message) from None


def _hub_error_message(exc: Exception, repo: str, filename: str | None, access: str = "read",
                       repo_type: str = "model") -> str | None:
    from httpx2 import TransportError  # noqa: PLC0415 - huggingface_hub's HTTP client
    from huggingface_hub import constants, errors  # noqa: PLC0415

    page = f"{constants.ENDPOINT}/{'datasets/' if repo_type == 'dataset' else ''}{repo}"
    if isinstance(exc, errors.GatedRepoError):
        return f"{page} is gated: accept its terms there, and set HF_TOKEN to a token of that account"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return f"no {repo_type} repository {page} (a private one needs HF_TOKEN set to a token that can {access} it)"
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        return f"{page} has no file {filename}"
    if isinstance(exc, errors.HfHubHTTPError) and exc.response is not None:
        status = exc.response.status_code
        if status in (401, 403):
            return f"{page} refused access (HTTP {status}): set HF_TOKEN to a token that can {access} it"
        return f"the Hub answered HTTP {status} for {page}"
    if isinstance(exc, errors.HFValidationError):
        return f"bad repository name {repo!r}: {str(exc).splitlines()[0]}"
    if isinstance(exc, errors.LocalEntryNotFoundError) and constants.is_offline_mode():
        return (f"HF_HUB_OFFLINE is set and {filename} of {repo} is not in the cache {constants.HF_HUB_CACHE}: "
                "unset HF_HUB_OFFLINE to download it")
    if isinstance(exc, errors.LocalEntryNotFoundError) and isinstance(exc.__cause__, Exception):
        # hf_hub_download wraps what stopped it (an HTTP error, a lost connection) when the cache lacks the file
        return _hub_error_message(exc.__cause__, repo, filename, access, repo_type) or _unreachable(exc.__cause__)
    if isinstance(exc, TransportError):
        return _unreachable(exc)
    return None


def _unreachable(exc: Exception) -> str:
    from huggingface_hub import constants  # noqa: PLC0415

    return (f"cannot reach the Hub at {constants.ENDPOINT} ({type(exc).__name__}): check the network, "
            "or set HF_HUB_OFFLINE=1 to use only models already in the cache")
