"""A published reference (spec: docs/reference-pack.md): a complete store in a Hugging Face Hub repository, beside a
manifest `<LABEL>.reference.json` that says what it is (the store's identity, where its logits were computed, the
error its form records, its sizes) and the sha256 of every file published with it (the store, results measured
against it, a card).

`hf:USER/REPO[:LABEL]` names one wherever a reference store is taken (qeval.storage.runs.resolve_path): the manifest
and the store are downloaded into huggingface_hub's cache (qeval.storage.hub_files), and the store is used only once
its bytes hash to the manifest's sha256, it reads back whole with its own checksums, and its header is the capture
the manifest names. The manifest is read trusting nothing: an unknown format or version, a missing or mistyped
field, a path that leaves the repository, a malformed sha256: each is one QevalError.

A manifest holds nothing private: no local path (a path-like value is cut to its file name) and not the user's
name or home (public()); the store's own header is published as it is.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from qeval.errors import QevalError
from qeval.identity import NOT_RECORDED, capture_identity, form
from qeval.storage import error_record, hub_files
from qeval.storage.store import StoreReader

FORMAT = "qeval-reference"
VERSION = 1
READABLE_VERSIONS = (1,)
MANIFEST_SUFFIX = ".reference.json"
ROLES = ("store", "result", "card")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# every field of a manifest and its JSON type; `files` entries are checked one by one (PackFile)
_FIELDS = {"format": str, "version": int, "label": str, "qeval_version": str, "identity": dict, "model": dict,
           "corpus": dict, "build": dict, "backend": str, "form": dict, "bounds": dict, "sizes": dict, "files": list}
_HASH_BLOCK = 16 << 20
# a numerics-floor row of `floors` (optional: manifests published before it have none): the reference model again
# on another of llama.cpp's kernel paths (`kind`: qeval.orchestrate.matrix.FLOORS), where it ran, its figures and
# the result file (a path of role "result") they are read from. A figure not held is null.
FLOOR_FIELDS = {"kind": str, "backend": str, "build": dict, "path": str, "chunks": int, "scored_tokens": int,
                "kld_mean": float, "kld_se": float, "same_top1": float, "same_top1_se": float}


@dataclass(frozen=True)
class PackFile:
    path: str  # in the repository, '/'-separated
    sha256: str
    bytes: int
    role: str  # one of ROLES

    def to_json(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "bytes": self.bytes, "role": self.role}


@dataclass(frozen=True)
class Manifest:
    label: str
    identity: dict  # qeval.identity.capture_identity of the store, made public()
    files: tuple[PackFile, ...]
    fields: dict  # the whole manifest as read

    @property
    def store(self) -> PackFile:
        return next(f for f in self.files if f.role == "store")

    @property
    def floors(self) -> list[dict]:
        """Its numerics-floor rows (FLOOR_FIELDS); none for a manifest published before they were."""
        return self.fields.get("floors", [])


def manifest_name(label: str) -> str:
    return f"{label}{MANIFEST_SUFFIX}"


# --- writing -------------------------------------------------------------------------------------------------------
def require_complete(source: StoreReader, store: Path) -> None:
    if not source.complete:
        raise QevalError(f"{store} is an incomplete capture: only a complete store can be published")


def build_manifest(store: Path, backend: str, files: list[tuple[str, Path, str]], floors: list[dict] = ()) -> dict:
    """The manifest of the complete store at `store` published with `files` ((path in the repository, local path,
    role); the store itself among them, role "store"). `backend`: what the store's llama.cpp build computed on beyond
    the CPU (qeval.engine.machine.build_backend of its system info); `floors`: the numerics-floor rows among the
    results (FLOOR_FIELDS, each naming its result file's path)."""
    with StoreReader(store, verify_chunks=True) as source:
        require_complete(source, store)
        h = source.header
        capture = h.capture
        numerics = capture.get("numerics")
        scored = sum(h.n_scored_of(c) for c in source.chunk_indices)
        manifest = {
            "format": FORMAT, "version": VERSION, "label": h.label, "qeval_version": h.qeval_version,
            "identity": capture_identity(h), "model": h.model, "corpus": h.corpus,
            "build": build_block(numerics, capture.get("cpu")),
            "backend": backend, "form": form(h),
            "bounds": {"error": error_record.recorded(source), **({"replay": error_record.replayed(source)}
                                                                 if h.replay_record else {})},
            "sizes": {"store_bytes": source.size_bytes, "chunks": len(source.chunk_indices), "scored_tokens": scored,
                      "bytes_per_scored_token": round(source.size_bytes / scored, 1) if scored else None,
                      **({"head_bytes": h.head["bytes"]} if h.head else {})},
            "files": [PackFile(path, file_sha256(local), local.stat().st_size, role).to_json()
                      for path, local, role in files],
            "floors": list(floors),
        }
    return public(manifest)


def build_block(numerics: dict | str | None, cpu: str | None) -> dict:
    """A manifest's `build` of logits computed with these numerics (qeval.identity.producer's): llama.cpp's build,
    the CPU, layers offloaded and the environment; "not recorded" for a store made before qeval recorded them."""
    if not isinstance(numerics, dict):
        return {"recorded": NOT_RECORDED}
    return {**numerics.get("build", {}), "cpu": cpu, "gpu_layers": numerics.get("gpu_layers"),
            "env": numerics.get("env")}


def manifest_bytes(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def public(value, private: tuple[str, ...] | None = None):
    """`value` (JSON) with nothing that names this machine's user: a local path (absolute, or under ~) cut to its
    file name, and the home folder or the user's name anywhere else replaced."""
    private = _private_words() if private is None else private
    if isinstance(value, dict):
        return {key: public(item, private) for key, item in value.items()}
    if isinstance(value, list):
        return [public(item, private) for item in value]
    if not isinstance(value, str):
        return value
    if value.startswith(("/", "~")) or PureWindowsPath(value).drive:
        value = PurePosixPath(value.replace("\\", "/")).name
    for word in private:
        value = re.sub(rf"(?<![A-Za-z0-9]){re.escape(word)}(?![A-Za-z0-9])", "<user>", value)
    return value


def refuse_private(value, name: str, where: str, remedy: str) -> None:
    """Refuse `value` (JSON, called `name` in the message; `where`: whose it is) when a string in it is one public()
    would change: what cannot be made public by changing it (a store published byte for byte, an identity that is
    hashed) and would make a local path or this user's name public."""
    exposed = _private_fields(value, name)
    if exposed:
        field, text = exposed[0]
        raise QevalError(f"{where}: its {field} = {text!r} is a local path or this user's name, which publishing would "
                         f"make public; {remedy}")


def _private_fields(value, where: str) -> list[tuple[str, str]]:
    """(field, value) of every string in `value` that public() would change."""
    if isinstance(value, dict):
        return [f for key, item in value.items() for f in _private_fields(item, f"{where}.{key}")]
    if isinstance(value, list):
        return [f for i, item in enumerate(value) for f in _private_fields(item, f"{where}[{i}]")]
    return [(where, value)] if isinstance(value, str) and public(value) != value else []


def _private_words() -> tuple[str, ...]:
    """The home folder and the user's name (a name under 3 characters would hide ordinary words: left out)."""
    words = [str(Path.home())]
    try:
        words.append(getpass.getuser())
    except (KeyError, OSError):
        pass
    words += [os.environ.get(name, "") for name in ("USER", "USERNAME", "LOGNAME")]
    return tuple(sorted({w for w in words if len(w) >= 3 and w != "/"}, key=len, reverse=True))


# --- reading -------------------------------------------------------------------------------------------------------
def manifest_json(data: bytes, where: str, kind: str, fmt: str, versions: tuple[int, ...], fields: dict) -> dict:
    """The JSON object of a manifest's bytes (a `kind` manifest: "reference", "results"), its format `fmt`, its
    version (one of `versions`) and every field of `fields` (name -> JSON type) checked."""
    try:
        d = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise QevalError(f"{where} is not a JSON manifest ({exc}): a partial or damaged file") from None
    if not isinstance(d, dict) or d.get("format") != fmt:
        raise QevalError(f"{where} is not a qeval {kind} manifest (no \"format\": \"{fmt}\")")
    version = d.get("version")
    if type(version) is not int or version not in versions:
        raise QevalError(f"{where}: manifest version {version!r} is not one this qeval reads "
                         f"({', '.join(map(str, versions))}): a newer qeval published it, upgrade qeval")
    check_fields(d, fields, where)
    return d


def check_fields(d: object, fields: dict, where: str, what: str = "the manifest") -> None:
    """Refuse `d` unless it is a JSON object holding every field of `fields` (name -> JSON type)."""
    if not isinstance(d, dict):
        raise QevalError(f"{where}: {what} is not a JSON object")
    for name, kind in fields.items():
        if name not in d:
            raise QevalError(f"{where}: {what} lacks its field {name!r}")
        if type(d[name]) is not kind:
            raise QevalError(f"{where}: {what}'s field {name!r} is not a JSON {kind.__name__}")


def read_manifest(data: bytes, where: str) -> Manifest:
    """A manifest from its bytes, every field checked (`where` names it in messages)."""
    d = manifest_json(data, where, "reference", FORMAT, READABLE_VERSIONS, _FIELDS)
    label = d["label"]
    if not label or PurePosixPath(label).name != label or label in (".", ".."):
        raise QevalError(f"{where}: bad label {label!r}")
    files = tuple(pack_file(entry, where) for entry in d["files"])
    paths = [f.path for f in files]
    if len(set(paths)) != len(paths):
        raise QevalError(f"{where}: a file is listed twice")
    if [f.role for f in files].count("store") != 1:
        raise QevalError(f"{where}: the manifest must list exactly one file of role \"store\"")
    floors = d.get("floors", [])
    if not isinstance(floors, list):
        raise QevalError(f"{where}: the manifest's field 'floors' is not a JSON list")
    results = {f.path for f in files if f.role == "result"}
    for floor in floors:
        _check_floor(floor, where, results)
    return Manifest(label, d["identity"], files, d)


def _check_floor(floor: object, where: str, results: set[str]) -> None:
    """A manifest's entry of `floors`, every field checked: of its type (a figure may be null), its path a result
    file the manifest lists."""
    if not isinstance(floor, dict):
        raise QevalError(f"{where}: an entry of 'floors' is not a JSON object")
    for name, kind in FLOOR_FIELDS.items():
        value = floor.get(name)
        number = kind is float and (value is None or type(value) in (int, float))
        if not number and type(value) is not kind:
            raise QevalError(f"{where}: a numerics-floor row's field {name!r} is missing or not a JSON {kind.__name__}")
    if floor["path"] not in results:
        raise QevalError(f"{where}: numerics-floor row {floor['path']!r} is no result file the manifest lists")


def pack_file(entry: object, where: str, roles: tuple[str, ...] = ROLES) -> PackFile:
    """A manifest's entry of `files`, every field checked; its role one of `roles`."""
    if not isinstance(entry, dict):
        raise QevalError(f"{where}: an entry of 'files' is not a JSON object")
    path, sha, size, role = (entry.get(k) for k in ("path", "sha256", "bytes", "role"))
    if not isinstance(path, str) or not _inside_repo(path):
        raise QevalError(f"{where}: file path {path!r} is not a relative path inside the repository")
    if not isinstance(sha, str) or not _SHA256.match(sha):
        raise QevalError(f"{where}: {path}: sha256 {sha!r} is not 64 lowercase hex digits")
    if type(size) is not int or size < 0:
        raise QevalError(f"{where}: {path}: bytes {size!r} is not a size")
    if role not in roles:
        raise QevalError(f"{where}: {path}: role {role!r} is none of {', '.join(roles)}")
    return PackFile(path, sha, size, role)


def _inside_repo(path: str) -> bool:
    parts = PurePosixPath(path).parts
    return bool(parts) and "\\" not in path and not path.startswith("/") and not any(p in ("..", ".") for p in parts) \
        and ":" not in path


# --- pulling -------------------------------------------------------------------------------------------------------
def parse_spec(spec: str) -> tuple[str, str]:
    """(USER/REPO, LABEL or "") of a published reference's `hf:USER/REPO[:LABEL]`."""
    return hub_files.split_spec(spec, "reference", "LABEL", "hf:USER/gemma-3-270m-qeval:Q8_0")


def is_published(spec: str) -> bool:
    """Whether `hf:USER/REPO[:LABEL]` names a published reference: its repository lists a manifest (LABEL's, when
    given). Listed only, nothing downloaded; with HF_HUB_OFFLINE, a repository nothing of which is cached is not."""
    from huggingface_hub import is_offline_mode  # noqa: PLC0415 - slow import, only for hf: specs

    repo, label = parse_spec(spec)
    try:
        files, _ = hub_files.repo_files(repo)
    except QevalError:
        if is_offline_mode():
            return False
        raise
    manifests = _manifests(files)
    return label in manifests if label else bool(manifests)


def pull(spec: str) -> Path:
    """The local store of the published reference `hf:USER/REPO[:LABEL]` (LABEL omitted: the repository's only one),
    downloaded into huggingface_hub's cache (a cached file is not fetched again) and verified (verify())."""
    manifest = published_manifest(spec)
    store = Path(hub_files.download(parse_spec(spec)[0], manifest.store.path))
    verify(store, manifest, f"{spec} ({manifest.store.path})")
    return store


def published_manifest(spec: str) -> Manifest:
    """The manifest of the published reference `hf:USER/REPO[:LABEL]`, downloaded (cached as pull()'s) and read."""
    repo, label = parse_spec(spec)
    files, where = hub_files.repo_files(repo)
    manifests = _manifests(files)
    if not manifests:
        raise QevalError(f"{where} holds no published qeval reference (no LABEL{MANIFEST_SUFFIX}): `qeval publish "
                         f"STORE hf:{repo}` publishes one")
    if not label and len(manifests) > 1:
        raise QevalError(f"{where} holds {len(manifests)} references ({', '.join(manifests)}): name one, "
                         f"hf:{repo}:LABEL")
    if label and label not in manifests:
        raise QevalError(f"{where} holds no reference {label!r}; its references: {', '.join(manifests)}")
    name = manifest_name(label or manifests[0])
    manifest = read_manifest(Path(hub_files.download(repo, name)).read_bytes(), f"{spec} ({name})")
    if manifest_name(manifest.label) != name:
        raise QevalError(f"{spec}: {name} is the manifest of reference {manifest.label!r}")
    return manifest


def _manifests(files: list[str]) -> list[str]:
    """The labels of the manifests at the top of a repository's listing."""
    return sorted(f[:-len(MANIFEST_SUFFIX)] for f in files if f.endswith(MANIFEST_SUFFIX) and "/" not in f)


def mismatch(local: Path, listed: PackFile) -> str:
    """"" when the downloaded file `local` has the size and sha256 its manifest lists, else what it has instead."""
    size = local.stat().st_size
    if size != listed.bytes:
        return f"{size:,} bytes"
    sha = file_sha256(local)
    return "" if sha == listed.sha256 else f"sha256 {sha}"


_verified: dict[tuple[str, int, int], Manifest] = {}  # (path, size, mtime) of a store verified in this process


def verify(store: Path, manifest: Manifest, where: str) -> None:
    """Refuse the downloaded `store` unless its size and sha256 are the manifest's, it reads back whole with its own
    checksums (header, tokens, every chunk, index), and it is the capture the manifest names (its identity and label).
    Done once per process for an unchanged file."""
    st = store.stat()
    key = (str(store), st.st_size, st.st_mtime_ns)
    if _verified.get(key) == manifest:
        return
    listed = manifest.store
    got = mismatch(store, listed)
    if got:
        raise QevalError(f"{where}: the downloaded file has {got}, its manifest says {listed.bytes:,} bytes, sha256 "
                         f"{listed.sha256}: it is damaged or not the file published with the manifest; remove "
                         f"{store.resolve()} from huggingface_hub's cache to download it again")
    try:
        with StoreReader(store, verify_chunks=True) as source:
            complete, header = source.complete, source.header
    except QevalError as exc:
        raise QevalError(f"{where}: the store does not read back: {exc}") from None
    if not complete:
        raise QevalError(f"{where}: the store is an incomplete capture")
    if header.label != manifest.label or public(capture_identity(header)) != manifest.identity:
        raise QevalError(f"{where}: the store is not the capture its manifest names (label {header.label!r}, "
                         f"manifest {manifest.label!r}; identities differ)")
    _verified[key] = manifest
