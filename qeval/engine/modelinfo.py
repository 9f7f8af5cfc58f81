"""Model facts for stores and reports, read from GGUF metadata with the `gguf` package.

Parsing a 262K-token vocabulary takes the gguf reader several seconds, so facts are cached per
(path, size, mtime) under ~/.cache/qeval (or $QEVAL_CACHE_DIR).

A GGUF that is no language model qeval can run (a vision projector, an adapter, an encoder, an
architecture llama.cpp does not know) is refused here with one clear message, before llama.cpp
is asked to decode it: an encoder would decode without complaint and return meaningless logits.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from collections import Counter
from pathlib import Path

from qeval.errors import QevalError
from qeval.storage import ggml_types
from qeval.storage.gguf_file import read_gguf
from qeval.storage.runs import is_gguf

FINGERPRINT_BLOCKS = 64
FINGERPRINT_BLOCK_BYTES = 1 << 20
FACTS_VERSION = 4  # part of the cache key: bump it when _read_facts changes what it returns

# Why a GGUF cannot be evaluated, one sentence each ({name}: the file, {arch}: its architecture).
REFUSALS = {
    "projector": "{name} is a multimodal projector (mmproj: a vision or audio encoder), not a language "
                 "model: pass the text model's GGUF instead",
    "adapter": "{name} is a LoRA adapter, not a model: pass a whole GGUF model",
    "unknown": "{name} has architecture {arch!r}, which the llama.cpp of llama-cpp-python {llama_cpp} "
               "does not know (a newer llama-cpp-python may support it)",
    "encoder-decoder": "{name} is an encoder-decoder model ({arch}): qeval measures decoder-only language "
                       "models, whose logits predict the next token",
    "encoder": "{name} is an encoder-only model ({arch}, e.g. an embedding model): it predicts no next "
               "token, so it has no logits to compare",
}
NOT_MODEL_TYPES = {"mmproj": "projector", "adapter": "adapter"}  # general.type
PROJECTOR_ARCH = "clip"  # what mmproj files declare as their architecture
# Architectures llama.cpp runs only after llama_encode (llama_model_has_encoder / _has_decoder); other
# encoders (BERT and kin, diffusion models) declare {arch}.attention.causal = false.
ENCODER_DECODER_ARCHS = ("t5",)
ENCODER_ONLY_ARCHS = ("t5encoder",)


def cache_dir() -> Path:
    return Path(os.environ.get("QEVAL_CACHE_DIR") or Path.home() / ".cache" / "qeval")


def content_fingerprint(path: Path) -> str:
    """sha256 of the size and 64 evenly spaced 1 MiB blocks: cheap on a 40 GB file, yet any
    requantization changes it (tensor data fills nearly the whole file)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        step = max(size // FINGERPRINT_BLOCKS, 1)
        for i in range(FINGERPRINT_BLOCKS):
            fh.seek(min(i * step, max(size - FINGERPRINT_BLOCK_BYTES, 0)))
            h.update(fh.read(FINGERPRINT_BLOCK_BYTES))
    return h.hexdigest()


def is_model_file(spec: str | os.PathLike) -> bool:
    """Whether `spec` names a GGUF model (its suffix, or its magic bytes) rather than a store or a text file."""
    path = Path(spec)
    return path.suffix.lower() == ".gguf" or is_gguf(path)


def model_facts(path: str | os.PathLike) -> dict:
    """Facts about GGUF model `path`; QevalError if it is no language model qeval can run."""
    facts = _cached_facts(Path(path))
    require_language_model(facts)
    return facts


def _cached_facts(path: Path) -> dict:
    return cached_gguf_read(path, "model-facts", FACTS_VERSION, _read_facts)


def cached_gguf_read(path: Path, kind: str, version: int, read) -> dict:
    """read(path), a dict of what a GGUF says, cached under cache_dir()/kind per (version, path, size, mtime)."""
    st = path.stat()
    key = hashlib.sha256(f"{version}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:32]
    cached = cache_dir() / kind / f"{key}.json"
    try:
        return json.loads(cached.read_text())
    except (OSError, ValueError):
        pass
    facts = read(path)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(facts))
    except OSError:
        pass  # a read-only home only costs the parse next time
    return facts


def refusal_from_metadata(facts: dict) -> str | None:
    """Why qeval cannot evaluate the GGUF with these facts (None: it can, as far as its metadata says)."""
    import gguf  # noqa: PLC0415

    arch = facts["architecture"]
    if facts["gguf_type"] in NOT_MODEL_TYPES:
        return NOT_MODEL_TYPES[facts["gguf_type"]]
    if arch == PROJECTOR_ARCH:
        return "projector"
    if arch not in gguf.MODEL_ARCH_NAMES.values():
        return "unknown"
    if arch in ENCODER_DECODER_ARCHS:
        return "encoder-decoder"
    if arch in ENCODER_ONLY_ARCHS or not facts["causal_attention"]:
        return "encoder"
    return None


def _refuse(reason: str, name: str, arch: str) -> None:
    from importlib.metadata import version  # noqa: PLC0415

    raise QevalError(REFUSALS[reason].format(name=name, arch=arch, llama_cpp=version("llama-cpp-python")))


def require_language_model(facts: dict) -> None:
    reason = refusal_from_metadata(facts)
    if reason is not None:
        _refuse(reason, facts["file_name"], facts["architecture"])


def require_decoder_context(lc, model, ctx, path: Path) -> None:
    """For Engine, right after llama_init_from_model: QevalError unless llama.cpp can decode this model
    causally. The last word for an architecture the metadata rules do not name: a context without
    memory (no KV cache, no recurrent state) belongs to a model that attends both ways, which llama.cpp
    "decodes" without complaint, returning meaningless logits."""
    if lc.llama_model_has_encoder(model):
        reason = "encoder-decoder"
    elif not lc.llama_model_has_decoder(model) or not lc.llama_get_memory(ctx):
        reason = "encoder"
    else:
        return
    arch = ctypes.create_string_buffer(128)
    lc.llama_model_meta_val_str(model, b"general.architecture", arch, len(arch))
    _refuse(reason, Path(path).name, arch.value.decode(errors="replace"))


def _read_facts(path: Path) -> dict:
    import gguf  # noqa: PLC0415 - slow import, only when a model is used

    gguf_file = read_gguf(path)
    field, tensors = gguf_file.field, gguf_file.tensors
    arch = field("general.architecture") or "unknown"
    file_type = field("general.file_type")
    try:
        quant = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else "unknown"
    except ValueError:
        quant = f"file_type {file_type}"
    n_elements = sum(t.n_elements for t in tensors)
    n_bytes = sum(t.n_bytes for t in tensors)
    tokens = field("tokenizer.ggml.tokens")
    size = path.stat().st_size
    return {
        "file_name": path.name,
        "file_size": size,
        "size_gib": round(size / 2**30, 4),
        "fingerprint": content_fingerprint(path),
        "architecture": arch,
        "name": field("general.name") or "",
        "quant": quant,
        "n_params": n_elements,
        "bits_per_weight": round(8.0 * n_bytes / n_elements, 4) if n_elements else None,
        "tensor_types": dict(sorted(Counter(t.type_name for t in tensors).items())),
        "vocab_size": len(tokens) if tokens is not None else None,
        "context_length": field(f"{arch}.context_length"),
        "block_count": field(f"{arch}.block_count"),
        "gguf_type": field("general.type") or "model",
        "causal_attention": field(f"{arch}.attention.causal") is not False,
        "kv_cache": kv_geometry(field, arch),
    }


def kv_geometry(field, arch: str) -> dict | None:
    """Values the KV cache holds per token of context, K and V apart (their cache types may differ), over the
    layers that have one: a per-layer head_count_kv of 0, or a recurrent layer of a hybrid (llama.cpp's
    full_attention_interval: every Nth layer attends), holds none. None for a model without attention layers.
    Sliding-window layers count as full: beyond their window this is an upper bound."""
    n_layer, heads_kv = field(f"{arch}.block_count"), field(f"{arch}.attention.head_count_kv")
    heads, n_embd = field(f"{arch}.attention.head_count"), field(f"{arch}.embedding_length")
    if not n_layer or not heads_kv or not heads:
        return None
    per_layer = list(heads_kv) if isinstance(heads_kv, list) else [heads_kv] * n_layer
    interval = field(f"{arch}.full_attention_interval")
    if interval:
        per_layer = [h if (i + 1) % interval == 0 else 0 for i, h in enumerate(per_layer)]
    n_head = max(heads) if isinstance(heads, list) else heads
    k_len = field(f"{arch}.attention.key_length") or n_embd // n_head
    v_len = field(f"{arch}.attention.value_length") or n_embd // n_head
    if not sum(per_layer):
        return None
    return {"attention_layers": sum(1 for h in per_layer if h), "k_values_per_token": int(sum(per_layer) * k_len),
            "v_values_per_token": int(sum(per_layer) * v_len),
            "k_head": int(k_len), "v_head": int(v_len)}  # head sizes: llama.cpp's KV rotation rule reads them


def kv_cache_gib(facts: dict, type_k: str | None, type_v: str | None, n_ctx: int) -> float | None:
    """An estimate of the KV cache's size at n_ctx tokens of context for these cache types (kv_geometry: sliding-
    window layers counted in full), None when the facts or types do not tell. What llama.cpp allocates at a
    deployment context, compute buffers included, is measured by qeval.engine.deploy (`qeval deploy`, `--deploy`);
    its KV bytes are computed exactly by qeval.engine.memory.formula_bytes."""
    geometry = facts.get("kv_cache") if facts else None
    if geometry is None or not ggml_types.is_type(type_k) or not ggml_types.is_type(type_v):
        return None
    per_token = (geometry["k_values_per_token"] * ggml_types.bytes_per_value(type_k)
                 + geometry["v_values_per_token"] * ggml_types.bytes_per_value(type_v))
    return per_token * n_ctx / 2**30
