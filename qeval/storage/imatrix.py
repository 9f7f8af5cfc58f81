"""Importance matrices: llama-imatrix's files, read as llama-quantize reads them.

Two formats. GGUF (what llama-imatrix writes now): for each weight tensor NAME, a float32 tensor NAME.in_sum2
(experts x columns: the sums of squared activations) and NAME.counts (experts x 1: the tokens each expert saw).
The legacy `.dat`: i32 entry count, then per entry i32 name length, the name (UTF-8), i32 ncall, i32 nval and nval
float32 sums; what follows the entries (chunk count, dataset name) is not read. Little-endian.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from qeval.errors import QevalError
from qeval.storage.gguf_file import read_gguf


def read_imatrix(path: str | Path) -> dict[str, np.ndarray]:
    """Tensor name -> float32 importance per column (per expert, columns running fastest): the GGUF format's
    in_sum2 / counts per expert (a count of 0 gives ones), the legacy format's sums / ncall."""
    path = Path(path)
    with open(path, "rb") as fh:
        magic = fh.read(4)
    return _read_gguf_imatrix(path) if magic == b"GGUF" else _read_legacy_imatrix(path)


def _read_gguf_imatrix(path: Path) -> dict:
    imatrix = read_gguf(path)
    tensors = {t.name: imatrix.float_values(t) for t in imatrix.tensors}
    out = {}
    for name, sums in tensors.items():
        if not name.endswith(".in_sum2"):
            continue
        base = name.removesuffix(".in_sum2")
        counts = tensors.get(base + ".counts")
        if counts is None:
            raise QevalError(f"imatrix {path}: {base} has sums but no counts")
        per_expert = sums.reshape(len(counts), -1)
        scaled = np.where(counts[:, None] > 0, per_expert / np.where(counts > 0, counts, 1)[:, None], 1.0)
        out[base] = scaled.astype(np.float32).reshape(-1)
    if not out:
        raise QevalError(f"imatrix {path} holds no importance data (no *.in_sum2 tensors)")
    return out


def _read_legacy_imatrix(path: Path) -> dict:
    data = path.read_bytes()
    bad = QevalError(f"imatrix {path} is neither a GGUF imatrix nor llama-imatrix's legacy .dat format")
    try:
        (n_entries,), at = struct.unpack_from("<i", data), 4
        if n_entries < 1:
            raise bad
        out = {}
        for _ in range(n_entries):
            (length,) = struct.unpack_from("<i", data, at)
            name = data[at + 4:at + 4 + length].decode()
            at += 4 + length
            ncall, nval = struct.unpack_from("<ii", data, at)
            at += 8
            if nval < 1 or at + 4 * nval > len(data):
                raise bad
            sums = np.frombuffer(data, dtype="<f4", count=nval, offset=at)
            at += 4 * nval
            out[name] = (sums / ncall if ncall > 0 else sums).astype(np.float32)
        return out
    except (struct.error, UnicodeDecodeError):
        raise bad from None
