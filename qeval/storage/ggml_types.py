"""ggml's tensor types by name (q8_0, F16, ...: either case), read from the gguf package's tables
(GGMLQuantizationType: the type's id; GGML_QUANT_SIZES: values and bytes per block), never written out by hand."""

from __future__ import annotations

from functools import cache


@cache
def _table() -> dict[str, tuple[int, int, int]]:
    """type name (lower case) -> (ggml type id, values per block, bytes per block)."""
    import gguf  # noqa: PLC0415 - a slow import, only where a type is asked for

    return {t.name.lower(): (int(t.value), *gguf.GGML_QUANT_SIZES[t])
            for t in gguf.GGMLQuantizationType if t in gguf.GGML_QUANT_SIZES}


def type_names() -> list[str]:
    """Every ggml type's name, lower case, in id order."""
    return list(_table())


def is_type(name: object) -> bool:
    return isinstance(name, str) and name.lower() in _table()


def type_id(name: str) -> int:
    """The ggml_type value of type `name` (KeyError for a name ggml does not know)."""
    return _table()[name.lower()][0]


def type_name(type_id: int) -> str:
    """The name (lower case) of ggml type id `type_id`; ValueError for an id gguf's tables do not hold."""
    for name, (tid, _, _) in _table().items():
        if tid == type_id:
            return name
    raise ValueError(f"ggml type id {type_id} is not in gguf's tables")


def bytes_per_value(name: str) -> float:
    """Bytes a value of type `name` takes on average (q8_0: 34 bytes per block of 32)."""
    _, block, size = _table()[name.lower()]
    return size / block


def row_bytes(name: str, values: int) -> int:
    """ggml_row_size: bytes of a row of `values` values of type `name`."""
    _, block, size = _table()[name.lower()]
    return values // block * size
