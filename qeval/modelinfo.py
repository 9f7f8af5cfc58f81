"""Model facts for stores and reports, read from GGUF metadata with the `gguf` package.

Parsing a 262K-token vocabulary takes the gguf reader several seconds, so facts are cached per
(path, size, mtime) under ~/.cache/qeval (or $QEVAL_CACHE_DIR).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path

from .errors import QevalError

FINGERPRINT_BLOCKS = 64
FINGERPRINT_BLOCK_BYTES = 1 << 20


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


def model_facts(path: str | os.PathLike) -> dict:
    path = Path(path)
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:32]
    cached = cache_dir() / "model-facts" / f"{key}.json"
    try:
        return json.loads(cached.read_text())
    except (OSError, ValueError):
        pass
    facts = _read_facts(path)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(facts))
    except OSError:
        pass  # a read-only home only costs the parse next time
    return facts


def _read_facts(path: Path) -> dict:
    import gguf  # noqa: PLC0415 - slow import, only when a model is used

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError/struct errors on bad files
        raise QevalError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None

    def field(name: str):
        f = reader.get_field(name)
        return f.contents() if f is not None else None

    arch = field("general.architecture") or "unknown"
    file_type = field("general.file_type")
    try:
        quant = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else "unknown"
    except ValueError:
        quant = f"file_type {file_type}"
    n_elements = sum(int(t.n_elements) for t in reader.tensors)
    n_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    tokens = reader.get_field("tokenizer.ggml.tokens")
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
        "tensor_types": dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items())),
        "vocab_size": len(tokens.data) if tokens is not None else None,
        "context_length": field(f"{arch}.context_length"),
    }
