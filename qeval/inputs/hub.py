"""`hf:USER/REPO[:QUANT]` model specs: a GGUF on the Hugging Face Hub, picked as llama.cpp's `-hf USER/REPO[:QUANT]`
picks it and downloaded into huggingface_hub's own cache, so its settings are huggingface_hub's: HF_HOME or
HF_HUB_CACHE (where), HF_ENDPOINT (which server), HF_TOKEN (gated and private repos), HF_HUB_OFFLINE (the cache
only), HF_HUB_DISABLE_PROGRESS_BARS. qeval sets none of them.

Which file: llama.cpp's rule, from common/download.cpp (ggml-org/llama.cpp at commit 0216dab; find_best_model,
gguf_filename_is_model, get_gguf_split_info, get_split_files):
  - a model file is a `.gguf` whose base name holds none of _NOT_MODEL_MARKERS (vision projectors,
    importance matrices, speculative-decoding drafts);
  - QUANT matches a file whose path holds it followed by '.' or '-', case-insensitively (so `Q4_K` never
    matches `Q4_K_M`); of a split set only the -00001-of-N shard is considered, and every shard is fetched;
  - QUANT omitted: Q4_K_M, else Q8_0, else the first model file.
qeval differs where a silent choice would make a measurement of an unknown file:
  - QUANT must also start a word (the path's start or after '/', '-', '.'), so `Q6_K` never picks `IQ6_K`;
  - several model files matching is an error that lists them (llama.cpp takes the first listed);
  - a QUANT that is a model file's whole path in the repo picks that file (what llama.cpp's --hf-file does),
    the way out of such an ambiguity.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from qeval.errors import QevalError
from qeval.storage.hub_files import PREFIX, download, is_hub_spec, repo_files, split_spec

_NOT_MODEL_MARKERS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# a file's own quant tag, as llama.cpp reads it: the last '-' or '.' separated word of its name
_FILE_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)


@dataclass(frozen=True)
class HubSpec:
    repo: str
    tag: str  # "" when omitted: llama.cpp's default choice

    def __str__(self) -> str:
        return f"{PREFIX}{self.repo}" + (f":{self.tag}" if self.tag else "")


def resolve_model(spec: str) -> str:
    """The local path of an `hf:` spec's model (its first shard if split), downloading what the cache lacks;
    any other spec unchanged. Says on stderr which file the spec picked."""
    if not is_hub_spec(spec):
        return spec
    hub = parse_hub_spec(spec)
    files, where = repo_files(hub.repo)
    shards = pick_model_files(files, hub, where)
    split = f", {len(shards)} shards" if len(shards) > 1 else ""
    default = "" if hub.tag else f" (no QUANT: {', else '.join(DEFAULT_TAGS)}, else the first model file, as llama.cpp)"
    print(f"qeval: {hub} is {hub.repo}/{shards[0]}{split}{default}", file=sys.stderr)
    paths = [download(hub.repo, name) for name in shards]
    return paths[0]  # llama.cpp loads a split model from its first shard


def repo_models(spec: str, include: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> list[str]:
    """Every model of a repo (`hf:USER/REPO`, or `hf:USER/REPO:*`) as an hf: spec naming exactly it (its file's
    path, a split set's first shard), optionally only paths matching an `include` glob and none of `exclude`;
    nothing downloaded yet. A repo with no model left is an error that says what the patterns kept."""
    hub = parse_hub_spec(spec.removesuffix(":*"))
    if hub.tag:
        raise QevalError(f"{spec}: a whole repository is hf:USER/REPO (or hf:USER/REPO:*), without a QUANT")
    files, where = repo_files(hub.repo)
    models = _first_shards(sorted(f for f in files if _is_model_file(f)))
    kept = [m for m in models if (not include or any(fnmatch.fnmatch(m, p) for p in include))
            and not any(fnmatch.fnmatch(m, p) for p in exclude)]
    if not kept:
        raise QevalError(f"no model file of {where} is left by --include {list(include)} --exclude "
                         f"{list(exclude)}; its models: {', '.join(models) or 'none'}")
    return [f"{PREFIX}{hub.repo}:{m}" for m in kept]


def is_whole_repo(spec: str) -> bool:
    """`hf:USER/REPO` or `hf:USER/REPO:*` where a model list is taken: every model of the repo."""
    return is_hub_spec(spec) and (spec.endswith(":*") or ":" not in spec.removeprefix(PREFIX))


def uploader_labels(specs: list[str]) -> list[str]:
    """Labels of models from whole repositories (repo_models): uploader and quant tag, USER.TAG, so the same quant
    of two uploaders stays apart on one board; where two files of one uploader share a tag (Q4_K_XL and
    UD-Q4_K_XL), their whole file names instead."""
    hubs = [parse_hub_spec(s) for s in specs]
    labels = [f"{h.repo.partition('/')[0]}.{_file_tag(h.tag)}" for h in hubs]
    return [label if labels.count(label) == 1 else
            re.sub(r"[^A-Za-z0-9._+-]", "-", f"{h.repo.partition('/')[0]}.{PurePosixPath(_set_name(h.tag)).name}")
            for label, h in zip(labels, hubs)]


def hub_label(spec: str, path: str) -> str:
    """The default label of an `hf:` spec's model: its QUANT, or (QUANT omitted, or a file's path) the file's
    name without .gguf and a split suffix."""
    named = parse_hub_spec(spec).tag or Path(path).name
    return _set_name(PurePosixPath(named).name)


def parse_hub_spec(spec: str) -> HubSpec:
    return HubSpec(*split_spec(spec, "model", "QUANT", "hf:ggml-org/gemma-3-1b-it-GGUF:Q4_K_M"))


def pick_model_files(files: list[str], hub: HubSpec, where: str) -> list[str]:
    """The repo paths of the model `hub` names among `files` (listed in `where`): one file, or every shard
    of its split set, the first first."""
    models = sorted(f for f in files if _is_model_file(f))
    if not models:
        raise QevalError(f"{where} holds no GGUF model file ({len(files)} files)")
    if hub.tag:
        return _split_set(_only_match(models, hub.tag, where), models, where)
    for tag in DEFAULT_TAGS:
        if _matches(models, tag):
            return _split_set(_only_match(models, tag, where), models, where)
    return _split_set(_first_shards(models)[0], models, where)


def _is_model_file(path: str) -> bool:
    name = PurePosixPath(path).name.lower()
    return name.endswith(".gguf") and not any(marker in name for marker in _NOT_MODEL_MARKERS)


def _first_shards(models: list[str]) -> list[str]:
    """Whole files and the first shard of each split set: what a tag may pick."""
    return [m for m in models if (split := _SPLIT.match(m)) is None or int(split["index"]) == 1]


def _matches(models: list[str], tag: str) -> list[str]:
    word = re.compile(rf"(?:^|[/.-]){re.escape(tag)}[.-]", re.IGNORECASE)
    return [m for m in _first_shards(models) if m.lower() == tag.lower() or word.search(m)]


def _only_match(models: list[str], tag: str, where: str) -> str:
    found = _matches(models, tag)
    if len(found) > 1:
        raise QevalError(f"{tag} matches {len(found)} model files in {where}: {', '.join(found)}; "
                         "give more of the name, or a file's path, as QUANT")
    if not found:
        tags = sorted({_file_tag(m) for m in _first_shards(models)})
        raise QevalError(f"no model file in {where} matches {tag!r}; its quant tags: {', '.join(tags)}")
    return found[0]


def _set_name(path: str) -> str:
    """A file's path without .gguf and, for a split shard, without -0000i-of-0000N."""
    split = _SPLIT.match(path)
    return split["prefix"] if split else re.sub(r"\.gguf$", "", path, flags=re.IGNORECASE)


def _file_tag(path: str) -> str:
    name = PurePosixPath(_set_name(path)).name
    tag = _FILE_TAG.search(name)
    return tag[1].upper() if tag else name


def _split_set(first: str, models: list[str], where: str) -> list[str]:
    """`first` alone, or every shard of the split set it opens, in order (llama.cpp loads a split model from
    its first shard and finds the others beside it)."""
    split = _SPLIT.match(first)
    if split is None:
        return [first]
    shards = sorted(m for m in models if (s := _SPLIT.match(m)) and s["prefix"] == split["prefix"]
                    and s["count"] == split["count"])
    if len(shards) != int(split["count"]):
        raise QevalError(f"{where} holds {len(shards)} of the {int(split['count'])} shards of {split['prefix']}")
    return shards
