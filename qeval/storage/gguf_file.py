"""A GGUF file's metadata and tensor directory, read in one pass (the format: ggml's docs/gguf.md, versions 2 and 3).

gguf-py's GGUFReader builds a numpy view per part of every field: on a 262,144-token vocabulary that is ~3 million
views and 10-30 s per file (measured on a 2-core Xeon), paid by every GGUF qeval meets (a quant under test, each
recipe variant built). This reader walks the same bytes with struct and numpy.frombuffer, and returns the values as
gguf-py's `contents()` does (tests/test_gguf_file.py holds the two equal on real files); tensor data stays on disk,
read through a memory map only when asked for. Types and block sizes come from gguf's tables (storage/ggml_types).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qeval.errors import QevalError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# GGUF value type -> struct code (bool is one byte, read as a bool)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True, kw_only=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] (ne0) is the row length
    type_name: str  # ggml's name, upper case as gguf writes it (Q8_0, F16, ...)
    n_elements: int
    n_bytes: int
    offset: int  # from the start of the file


@dataclass(frozen=True)
class GgufFile:
    path: Path
    fields: dict[str, object]
    tensors: list[GgufTensor]

    def field(self, name: str):
        return self.fields.get(name)

    def tensor_bytes(self, tensor: GgufTensor) -> np.ndarray:
        """The tensor's bytes, uint8, memory-mapped (read-only)."""
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=tensor.offset, shape=(tensor.n_bytes,))

    def float_values(self, tensor: GgufTensor) -> np.ndarray:
        """An F32 or F16 tensor's values, flat, as float32."""
        dtypes = {"F32": np.float32, "F16": np.float16}
        if tensor.type_name not in dtypes:
            raise QevalError(f"{self.path}: tensor {tensor.name} is {tensor.type_name}, not F32 or F16")
        return self.tensor_bytes(tensor).view(dtypes[tensor.type_name]).astype(np.float32)


class _Cursor:
    def __init__(self, buf, order: str):
        self.buf, self.pos, self.order = buf, 0, order

    def unpack(self, code: str):
        value = struct.unpack_from(self.order + code, self.buf, self.pos)[0]
        self.pos += struct.calcsize(code)
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise struct.error(f"a string of {n} bytes runs past the end of the file")
        text = str(self.buf[self.pos:end], "utf-8")
        self.pos = end
        return text

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            return self.array()
        if kind not in SCALARS:
            raise struct.error(f"unknown value type {kind}")
        return self.unpack(SCALARS[kind])

    def array(self) -> list:
        kind, n = self.unpack("I"), self.unpack("Q")
        if kind == STRING:
            return [self.string() for _ in range(n)]
        if kind == ARRAY:
            return [self.array() for _ in range(n)]
        if kind not in SCALARS:
            raise struct.error(f"unknown array element type {kind}")
        dtype = np.dtype(SCALARS[kind]).newbyteorder(self.order)
        values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
        self.pos += n * dtype.itemsize
        return values.tolist()


def read_gguf(path: str | Path) -> GgufFile:
    """The fields and tensor directory of GGUF `path`; QevalError naming the file if it is not one qeval can read."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            # the map is left to the garbage collector: views of it may outlive the parse (in a traceback, say)
            return _parse(path, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
    except (OSError, ValueError, struct.error, UnicodeDecodeError, OverflowError) as exc:
        raise QevalError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def _parse(path: Path, buf: mmap.mmap) -> GgufFile:
    from qeval.storage import ggml_types  # noqa: PLC0415 - gguf's tables, a slow import

    if buf[:4] != MAGIC:
        raise ValueError("no GGUF magic")
    version_le = struct.unpack_from("<I", buf, 4)[0]
    order = "<" if version_le in VERSIONS else ">"
    cursor = _Cursor(buf, order)
    cursor.pos = 4
    version = cursor.unpack("I")
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version_le} is not one of {VERSIONS}")
    n_tensors, n_fields = cursor.unpack("Q"), cursor.unpack("Q")
    fields = {}
    for _ in range(n_fields):
        key = cursor.string()
        fields[key] = cursor.value(cursor.unpack("I"))
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        shape = tuple(cursor.unpack("Q") for _ in range(cursor.unpack("I")))
        infos.append((name, shape, cursor.unpack("I"), cursor.unpack("Q")))
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = []
    for name, shape, type_id, offset in infos:
        type_name = ggml_types.type_name(type_id).upper()
        n_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
        n_bytes = ggml_types.row_bytes(type_name, n_elements)
        if data_start + offset + n_bytes > len(buf):
            raise ValueError(f"tensor {name} runs past the end of the file")
        tensors.append(GgufTensor(name=name, shape=shape, type_name=type_name, n_elements=n_elements, n_bytes=n_bytes,
                                  offset=data_start + offset))
    return GgufFile(path, fields, tensors)
