"""A quantization recipe, and the variant llama.cpp's own quantizer builds from it.

A recipe is what an uploader decides: a base type (a llama.cpp ftype: Q4_K_M, Q3_K_M, ...), per-tensor
overrides (`ffn_down=q6_K`, `attn_.*=q8_0`: a regex searched in each tensor's name, the first that matches wins,
as llama-quantize's --tensor-type; they apply to the tensors the base type quantizes), and an importance matrix
(llama-imatrix's file, GGUF or the legacy .dat). Its text form is `BASE [PATTERN=TYPE ...] [imatrix=FILE]`,
e.g. `Q3_K_M token_embd=q5_0 ffn_.*=q5_0`.

The variant is built by `llama_model_quantize` (llama-cpp-python's ctypes binding of the vendored llama.cpp), with
`llama_model_quantize_params.tt_overrides` a NULL-terminated array of {pattern, ggml_type} and `imatrix` one of
{name, data, size}, in a guarded child (qeval.engine.probe: a build that crashes becomes a message). With
`dry_run` llama.cpp writes nothing and logs each tensor's planned type: `plan()` reads that log, so a recipe's
per-tensor types and its size are known in a second, before anything is built.

`variant_identity()` is what makes two variants the same: the source's content fingerprint, the type the dry run
plans for each tensor, the imatrix by its content (not its path) and the quantizer's build. Two spellings of one
recipe (`Q4_K_M token_embd=q5_1` and `Q4_K_M ^token_embd=q5_1`, or an override that restates a base type's
choice) plan the same types and so are one variant. The quantizer is deterministic, so a variant rebuilt under the
same identity holds the same tensors.
"""

from __future__ import annotations

import ctypes
import json
import re
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from qeval.errors import QevalError
from qeval.identity import digest
from qeval.storage import ggml_types
from qeval.storage.imatrix import read_imatrix

IMATRIX_KEY = "imatrix"
# llama.cpp ftypes a recipe can start from (gguf.LlamaFileType's MOSTLY_* names); the rest are obsolete or guesses
_NOT_BASES = {"GUESSED", "MOSTLY_Q4_1_SOME_F16", "MOSTLY_Q4_2", "MOSTLY_Q4_3", "ALL_F32"}


def base_types() -> dict[str, int]:
    """Base type name -> llama.cpp ftype, as llama-quantize names them (Q4_K_M, F16, ...)."""
    import gguf  # noqa: PLC0415

    return {t.name.removeprefix("MOSTLY_"): int(t.value) for t in gguf.LlamaFileType if t.name not in _NOT_BASES}


def tensor_types() -> dict[str, int]:
    """ggml type name (lower case: q4_k, q8_0, f16) -> its ggml_type value, for the types a tensor can be given."""
    return {name: ggml_types.type_id(name) for name in ggml_types.type_names()
            if name not in ("i8", "i16", "i32", "i64", "f64")}


def type_name(text: str, what: str) -> str:
    name = text.strip().lower()
    if name not in tensor_types():
        raise QevalError(f"{what}: unknown tensor type {text!r} (one of {', '.join(sorted(tensor_types()))})")
    return name


@dataclass(frozen=True)
class Recipe:
    """A base type, per-tensor overrides (regex, ggml type name) in the order llama.cpp tries them, an imatrix."""

    base: str
    overrides: tuple[tuple[str, str], ...] = ()
    imatrix: str | None = None  # llama-imatrix's file
    _imatrix_sha: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        bases = base_types()
        base = self.base.strip().upper()
        if base not in bases:
            raise QevalError(f"recipe: unknown base type {self.base!r} (one of {', '.join(sorted(bases))})")
        object.__setattr__(self, "base", base)
        overrides = []
        for pattern, wanted in self.overrides:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise QevalError(f"recipe: tensor pattern {pattern!r} is no valid regex ({exc})") from None
            if not pattern:
                raise QevalError("recipe: an override needs a tensor pattern before '='")
            overrides.append((pattern, type_name(wanted, f"recipe: override {pattern}")))
        object.__setattr__(self, "overrides", tuple(overrides))
        if self.imatrix is not None:
            path = Path(self.imatrix)
            if not path.is_file():
                raise QevalError(f"recipe: imatrix file {self.imatrix} does not exist")
            object.__setattr__(self, "_imatrix_sha", _file_sha256(path))

    @property
    def ftype(self) -> int:
        return base_types()[self.base]

    def canonical(self) -> dict:
        """What the recipe is: part of a variant's identity (the imatrix by its content)."""
        return {"base": self.base, "overrides": [list(o) for o in self.overrides], "imatrix": self._imatrix_sha}

    def text(self) -> str:
        """The text form parse() reads back."""
        parts = [self.base, *(f"{p}={t}" for p, t in self.overrides)]
        if self.imatrix:
            parts.append(f"{IMATRIX_KEY}={self.imatrix}")
        return " ".join(shlex.quote(p) for p in parts)

    def with_overrides(self, *overrides: tuple[str, str]) -> "Recipe":
        """This recipe with `overrides` tried before its own (they win where both match)."""
        return Recipe(self.base, (*overrides, *self.overrides), self.imatrix)

    def label(self) -> str:
        """A run label (qeval.storage.runs): the base type alone for a stock recipe, else the base, the overrides'
        types and a short digest of the whole recipe (patterns hold characters a label cannot)."""
        if not self.overrides and self.imatrix is None:
            return self.base
        types = "+".join(sorted({t for _, t in self.overrides}))
        return f"{self.base}+{types or 'imatrix'}.{digest(self.canonical())[:8]}"


def parse(text: str) -> Recipe:
    """`BASE [PATTERN=TYPE ...] [imatrix=FILE]` -> Recipe (shell-style quoting for patterns with spaces)."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise QevalError(f"recipe {text!r}: {exc}") from None
    if not words:
        raise QevalError("recipe: empty (give a base type such as Q4_K_M, then PATTERN=TYPE overrides)")
    base, *rest = words
    if "=" in base:
        raise QevalError(f"recipe {text!r}: it must start with a base type (Q4_K_M, ...), not an override")
    overrides, imatrix = [], None
    for word in rest:
        pattern, sep, type_name = word.rpartition("=")
        if not sep:
            raise QevalError(f"recipe {text!r}: {word!r} is no PATTERN=TYPE override")
        if pattern == IMATRIX_KEY:
            imatrix = type_name
        else:
            overrides.append((pattern, type_name))
    return Recipe(base, tuple(overrides), imatrix)


def _file_sha256(path: Path) -> str:
    import hashlib  # noqa: PLC0415

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def variant_identity(source_facts: dict, recipe: Recipe, planned: dict[str, "TensorPlan"], quantizer: str) -> dict:
    """What a variant is (the module's docstring): its source (content fingerprint), the type `planned` (plan() of
    the recipe) gives each tensor, the recipe's imatrix by its content, and the quantizer's build (probe.build_id)."""
    return {"source": source_facts["fingerprint"], "tensors": {name: planned[name].type for name in sorted(planned)},
            "imatrix": recipe.canonical()["imatrix"], "quantizer": quantizer}


# --------------------------------------------------------------------------------------------------
# the quantizer (run in the guarded child: qeval.engine.probe_child's "recipe" job)
# --------------------------------------------------------------------------------------------------
# llama.cpp's dry-run log line of one tensor: "[  12/ 236] blk.1.attn_q.weight - [   640,   1024,      1,      1],
# type =   q4_K, size =     0.34 MiB ->     0.25 MiB (q3_K)" (the new type is printed only when it changes)
_PLAN_LINE = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[([^\]]*)\], type =\s*(\S+),\s*size =.*?(?:\((\S+)\))?\s*$")
GGUF_ALIGNMENT = 32  # general.alignment's default: every tensor's data starts at a multiple of it


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of a variant: its shape (ggml's ne), its type in the source and in the variant."""

    shape: tuple[int, ...]
    source_type: str
    type: str


def tensor_bytes(type_name: str, shape) -> int:
    """Bytes of a tensor of this ggml type and shape (ggml_row_size per row)."""
    rows = 1
    for n in shape[1:]:
        rows *= n
    return rows * ggml_types.row_bytes(type_name, shape[0])


def _padded(n: int) -> int:
    return -(-n // GGUF_ALIGNMENT) * GGUF_ALIGNMENT


def planned_data_bytes(plan: dict[str, TensorPlan]) -> int:
    """The bytes of the variant's tensor data, each tensor padded to the alignment, as the file holds them."""
    return sum(_padded(tensor_bytes(t.type, t.shape)) for t in plan.values())


def planned_bytes(plan: dict[str, TensorPlan], source_size: int) -> int:
    """The variant's file size: the source's, its tensor data swapped for the variant's. The metadata is taken to be
    the source's: exact for a source llama.cpp's quantizer wrote, a few bytes short for one written elsewhere (llama.cpp
    adds general.quantization_version)."""
    source_data = sum(_padded(tensor_bytes(t.source_type, t.shape)) for t in plan.values())
    return source_size - source_data + planned_data_bytes(plan)


def quantize_in_child(job: dict) -> None:
    """Run llama_model_quantize for `job` (source, dest, recipe canonical parts, imatrix path, dry_run, nthread):
    the child side. A dry run prints the planned type of every tensor as JSON on stdout."""
    import llama_cpp  # noqa: PLC0415

    from qeval.engine.engine import quiet_llama, recorded_log  # noqa: PLC0415

    quiet_llama()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = base_types()[job["base"]]
    params.allow_requantize = True
    params.nthread = job["nthread"]
    params.dry_run = job["dry_run"]
    keep = []  # everything a pointer in params points into must outlive the call
    types = tensor_types()
    if job["overrides"]:
        overrides = (llama_cpp.llama_model_tensor_override * (len(job["overrides"]) + 1))()
        for slot, (pattern, type_name) in zip(overrides, job["overrides"]):
            slot.pattern, slot.type = pattern.encode(), types[type_name]
        overrides[-1].pattern = None
        params.tt_overrides, keep = overrides, [overrides]
    if job.get("imatrix"):
        entries = read_imatrix(job["imatrix"])
        data = (llama_cpp.llama_model_imatrix_data * (len(entries) + 1))()
        for slot, (name, values) in zip(data, entries.items()):
            slot.name, slot.size = name.encode(), len(values)
            slot.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        data[-1].name = None
        params.imatrix = data
        keep += [data, entries]
    with recorded_log() as log:
        rc = llama_cpp.llama_model_quantize(job["source"].encode(), job["dest"].encode(), ctypes.byref(params))
    if rc != 0:
        errors = [line.strip() for line in "".join(log).splitlines() if "error" in line.lower() or "failed" in line]
        raise SystemExit(f"llama_model_quantize returned {rc}: {errors[-1] if errors else 'no message'}")
    if job["dry_run"]:
        print(json.dumps(planned_types("".join(log))))


def planned_types(log: str) -> dict[str, list]:
    """Tensor name -> [shape, source type, variant type], from a dry run's log."""
    out = {}
    for line in log.splitlines():
        m = _PLAN_LINE.match(line.strip())
        if m:
            shape = [int(n) for n in m.group(2).split(",")]
            out[m.group(1)] = [shape, m.group(3).lower(), (m.group(4) or m.group(3)).lower()]
    return out


def _job(source: Path, dest: Path, recipe: Recipe, dry_run: bool, nthread: int) -> list[str]:
    job = {"source": str(source), "dest": str(dest), "base": recipe.base, "overrides": [list(o) for o in recipe.overrides],
           "imatrix": recipe.imatrix, "dry_run": dry_run, "nthread": nthread}
    return ["recipe", json.dumps(job)]


def build(source: str | Path, recipe: Recipe, dest: str | Path, nthread: int) -> Path:
    """The variant of `source` under `recipe` written to `dest` (atomically: a failed build leaves nothing)."""
    from qeval.engine.probe import run_guarded  # noqa: PLC0415

    dest = Path(dest)
    tmp = dest.with_suffix(".gguf.part")
    try:
        proc = run_guarded(_job(Path(source), tmp, recipe, False, nthread), f"quantization of {Path(source).name}")
        if proc.returncode != 0:
            raise QevalError(f"llama.cpp could not build {recipe.text()} from {Path(source).name}: "
                             f"{_last_line(proc.stderr)}")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(dest)
    return dest


def plan(source: str | Path, recipe: Recipe, nthread: int = 1) -> dict[str, TensorPlan]:
    """Tensor name -> its TensorPlan in the variant `recipe` would build (llama.cpp's dry run: nothing written)."""
    from qeval.engine.probe import run_guarded  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        proc = run_guarded(_job(Path(source), Path(tmp) / "dry.gguf", recipe, True, nthread),
                           f"dry run of {Path(source).name}")
    if proc.returncode != 0:
        raise QevalError(f"llama.cpp cannot quantize {Path(source).name} as {recipe.text()}: {_last_line(proc.stderr)}")
    planned = json.loads(proc.stdout.strip().splitlines()[-1])
    return {name: TensorPlan(tuple(shape), old, new) for name, (shape, old, new) in planned.items()}


def _last_line(stderr: str) -> str:
    return (stderr.strip().splitlines() or ["no output"])[-1].removeprefix("llama_model_quantize returned ")


# --------------------------------------------------------------------------------------------------
# tensor groups: what a sensitivity sweep moves, found from the GGUF's own tensor names
# --------------------------------------------------------------------------------------------------
_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class TensorGroup:
    """Tensors of one role (token_embd, attn_q, ffn_down_exps, ssm_out, ...) across layers, or across one range of
    blocks (`blocks`: tensor_groups' split_edges), and the override pattern that names exactly them."""

    role: str
    tensors: tuple[str, ...]
    blocks: tuple[int, ...] | None = None  # the block ids of its layer range; None: every layer of the role

    @property
    def name(self) -> str:
        """The role, with its layer range where it has one: `attn_q`, `attn_q@0-1`, `attn_q@17`."""
        if self.blocks is None:
            return self.role
        first, last = self.blocks[0], self.blocks[-1]
        return f"{self.role}@{first}" if first == last else f"{self.role}@{first}-{last}"

    @property
    def pattern(self) -> str:
        """A regex llama.cpp searches in tensor names (std::regex, ECMAScript) matching this group's tensors only."""
        if self.blocks is not None:
            layers = "^blk\\.(?:" + "|".join(str(b) for b in self.blocks) + ")\\."
        else:
            layers = "^blk\\.[0-9]+\\." if all(_LAYER.match(t) for t in self.tensors) else "^"
        return layers + re.escape(self.role) + "\\.weight$"


def group_name(tensor: str) -> str | None:
    """The role of a weight tensor (`blk.3.ffn_down_exps.weight` -> ffn_down_exps), None for anything else."""
    if not tensor.endswith(".weight"):
        return None
    return _LAYER.sub("", tensor).removesuffix(".weight")


def tensor_groups(planned: dict[str, TensorPlan], split_edges: int = 0) -> list[TensorGroup]:
    """The groups of the tensors a recipe's dry run (plan()) quantizes: weight matrices (two or more dimensions
    above 1) that it does not keep in float, grouped by role, in the order of the file. With split_edges K, a
    role's per-layer tensors are three groups instead: its first K blocks, the middle ones and its last K, the
    blocks counted from the model's own (1 + the highest block id in its tensor names); a range the role has no
    tensor in is no group."""
    members: dict[str, list[str]] = {}
    for name, t in planned.items():
        role = group_name(name)
        if role is None or sum(n > 1 for n in t.shape) < 2 or t.type in ("f32", "f16", "bf16"):
            continue
        members.setdefault(role, []).append(name)
    if not split_edges:
        return [TensorGroup(role, tuple(names)) for role, names in members.items()]
    ranges = layer_ranges(block_count(planned), split_edges)
    out = []
    for role, names in members.items():
        if not all(_LAYER.match(n) for n in names):
            out.append(TensorGroup(role, tuple(names)))
            continue
        for blocks in ranges:
            inside = tuple(n for n in names if int(_LAYER.match(n).group(1)) in blocks)
            if inside:
                out.append(TensorGroup(role, inside, blocks))
    return out


def block_count(planned: dict[str, TensorPlan]) -> int:
    """The model's blocks: 1 + the highest block id of its tensor names (`blk.N.`), 0 without any."""
    ids = [int(m.group(1)) for m in map(_LAYER.match, planned) if m]
    return max(ids) + 1 if ids else 0


def layer_ranges(n_blocks: int, edges: int) -> list[tuple[int, ...]]:
    """The first `edges` blocks, the middle ones and the last `edges`: refused unless a middle is left."""
    if edges < 1 or n_blocks - 2 * edges < 1:
        raise QevalError(f"--split-edges {edges}: it must be at least 1 and leave middle blocks, so below "
                         f"{max(n_blocks, 1) / 2:g} for a model of {n_blocks} blocks")
    return [tuple(range(edges)), tuple(range(edges, n_blocks - edges)), tuple(range(n_blocks - edges, n_blocks))]
