"""The KV-cache types of the llama.cpp build qeval loads, by name, from that build's own ggml type table.

A fork adds types of its own (TurboQuant's turbo3/turbo4) and numbers them as it likes (turbo3 is type 44 in one
build, 105 in another), and mainline adds types over time: so no type name or id is written down here. The table
is read from the build's libggml-base (ggml_type_name, ggml_blck_size, ggml_type_size, ggml_is_quantized over the
ids the build has) in the build check's child (qeval.engine.build_check), once per build, and held once per
process.

How many ids a build has. ggml exports no GGML_TYPE_COUNT, and its per-type getters index their table unchecked.
Its GGUF reader does check: a tensor of an out-of-range type is refused with "invalid ggml type N. should be in
[0, COUNT)". So a tiny GGUF holding one tensor of type INT32_MAX is handed to gguf_init_from_file, and the count is
read from the message it logs (ggml's log callback, set for that call). Ids below it whose block or type size is 0
are the slots of removed types (4, 5, 31-33, 36-38 in mainline) and are left out.

Which types can be a KV cache: those llama.cpp's CPU backend can write into the cache and read back, i.e. whose
CPU traits have a from_float (ggml_set_rows quantizes each new K/V row with it) and a vec_dot (attention multiplies
through it). Which of them llama.cpp then allocates for a given model is verified on every run from its own log
(qeval.engine.memory.allocated_cache): a type it would not take is refused there, never assumed.
"""

from __future__ import annotations

import ctypes
import re
import struct
import tempfile
from ctypes import c_bool, c_char_p, c_int, c_int64, c_size_t, c_void_p
from dataclasses import asdict, dataclass
from pathlib import Path

from qeval.errors import QevalError



@dataclass(frozen=True)
class GgmlType:
    """One type of a build's ggml type table."""

    id: int
    name: str
    block_size: int  # values per block
    type_size: int  # bytes per block
    quantized: bool
    kv: bool  # llama.cpp's CPU backend can hold a KV cache of it (the module's docstring)

    def row_bytes(self, values: int) -> int:
        """ggml_row_size: bytes of a row of `values` values of this type."""
        return values // self.block_size * self.type_size


class _TypeTraitsCpu(ctypes.Structure):  # ggml-cpu.h struct ggml_type_traits_cpu
    _fields_ = [("from_float", c_void_p), ("vec_dot", c_void_p), ("vec_dot_type", c_int), ("nrows", c_int64)]


class _GgufInitParams(ctypes.Structure):  # gguf.h struct gguf_init_params
    _fields_ = [("no_alloc", c_bool), ("ctx", c_void_p)]


_LOG_CALLBACK = ctypes.CFUNCTYPE(None, c_int, c_char_p, c_void_p)
_COUNT = re.compile(rb"should be in \[0, (\d+)\)")
_OUT_OF_RANGE = 0x7FFFFFFF


def _fn(lib, name, restype, *argtypes):
    f = getattr(lib, name)
    f.restype, f.argtypes = restype, list(argtypes)
    return f


def probe_gguf(folder: Path) -> Path:
    """A GGUF of one 32-value tensor of type INT32_MAX, which every ggml refuses by naming its type count."""
    name = b"t"
    data = (b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", len(name)) + name
            + struct.pack("<IqiQ", 1, 32, _OUT_OF_RANGE, 0))
    path = folder / "type-count-probe.gguf"
    path.write_bytes(data)
    return path


def type_count(base: ctypes.CDLL) -> int:
    """GGML_TYPE_COUNT of the ggml `base` (the module's docstring)."""
    logged: list[bytes] = []
    callback = _LOG_CALLBACK(lambda level, text, user: logged.append(text or b""))
    set_log = _fn(base, "ggml_log_set", None, _LOG_CALLBACK, c_void_p)
    init = _fn(base, "gguf_init_from_file", c_void_p, c_char_p, _GgufInitParams)
    with tempfile.TemporaryDirectory() as folder:
        set_log(callback, None)
        try:
            ctx = init(str(probe_gguf(Path(folder))).encode(), _GgufInitParams(True, None))
        finally:
            set_log(_LOG_CALLBACK(), None)  # back to ggml's default (llama.cpp's own is set when a model loads)
    found = _COUNT.search(b"".join(logged))
    if ctx or not found:
        raise QevalError("cannot read this llama.cpp build's ggml type count: its GGUF reader did not refuse a "
                         f"tensor of type {_OUT_OF_RANGE} as mainline ggml does")
    return int(found.group(1))


def read_type_table(base: ctypes.CDLL, cpu: ctypes.CDLL) -> list[GgmlType]:
    """Every type of the ggml of libggml-base `base` (its CPU backend `cpu`), in id order, removed ones left out."""
    size = _fn(base, "ggml_type_size", c_size_t, c_int)
    name = _fn(base, "ggml_type_name", c_char_p, c_int)
    block = _fn(base, "ggml_blck_size", c_int64, c_int)
    quantized = _fn(base, "ggml_is_quantized", c_bool, c_int)
    cpu_traits = _fn(cpu, "ggml_get_type_traits_cpu", ctypes.POINTER(_TypeTraitsCpu), c_int)
    table = []
    for type_id in range(type_count(base)):
        if size(type_id) and block(type_id):
            traits = cpu_traits(type_id).contents
            table.append(GgmlType(id=type_id, name=name(type_id).decode(), block_size=int(block(type_id)),
                                  type_size=int(size(type_id)),
                                  quantized=bool(quantized(type_id)), kv=bool(traits.from_float and traits.vec_dot)))
    return table


def table_json(table: list[GgmlType]) -> list[dict]:
    return [asdict(t) for t in table]


def table_from_json(rows: list[dict]) -> list[GgmlType]:
    return [GgmlType(**row) for row in rows]


def cache_types(table: list[GgmlType]) -> dict[str, GgmlType]:
    """{name: type} of the types of `table` a KV cache can be."""
    return {t.name: t for t in table if t.kv}


def cache_type(name: str, flag: str, table: list[GgmlType]) -> GgmlType:
    """The cache type of that name of `table` (the loaded build's: qeval.engine.build_check.cache_type); an unknown
    one refused with the table's cache types."""
    types = cache_types(table)
    if name not in types:
        raise QevalError(f"unknown KV cache type {name!r} for {flag}: this llama.cpp build's cache types are "
                         f"{', '.join(types)}")
    return types[name]


def verified_cache(allocated: dict, type_k: str, type_v: str, flash_attn: str, has_cache: bool,
                   described: str, rotation: dict | None = None, rotation_mode: str = "auto") -> dict:
    """The cache llama.cpp made, as it says (qeval.engine.memory.allocated_cache), held against what was asked
    for: {"type_k", "type_v", "flash_attn": bool}. A type it did not allocate (a fallback, an ignored setting),
    flash attention asked on or off and run otherwise, or a log that does not say (for a model with an attention
    cache) is refused: a number is never reported under a name that did not run. `described`: the model, for the
    message. `rotation`: the rotation llama.cpp reported ({"k", "v"}: qeval.engine.numerics.reported_rotation),
    held against --kv-rotation `rotation_mode` (on: every quantized cache rotated; off: none)."""
    asked = f"-ctk {type_k} -ctv {type_v} -fa {flash_attn}"
    made = set(allocated["types"])
    if not made and has_cache:
        raise QevalError(f"llama.cpp's log did not say which KV cache types it allocated for {described} "
                         f"({asked}): qeval cannot verify them, so it does not run them")
    wrong = sorted(f"K {k}, V {v}" for k, v in made if (k, v) != (type_k, type_v))
    if wrong:
        raise QevalError(f"llama.cpp allocated a KV cache of {'; '.join(wrong)} for {described}, not the "
                         f"{asked} asked for: it fell back or ignored the type, so nothing is measured under "
                         "that name")
    ran = allocated["flash_attn"]
    if flash_attn in ("on", "off") and ran is not None and ran != (flash_attn == "on"):
        raise QevalError(f"llama.cpp ran {described} with flash attention {'on' if ran else 'off'}, not the "
                         f"-fa {flash_attn} asked for")
    if rotation is not None and rotation_mode in ("on", "off"):
        quantized = {"k": type_k, "v": type_v}
        off = [c.upper() for c in "kv" if rotation_mode == "on" and quantized[c] not in ("f32", "f16", "bf16")
               and not rotation[c]]
        on = [c.upper() for c in "kv" if rotation_mode == "off" and rotation[c]]
        if off or on:
            raise QevalError(f"llama.cpp {'did not rotate' if off else 'rotated'} the {'/'.join(off or on)} cache "
                             f"of {described}, not the --kv-rotation {rotation_mode} asked for")
    return {"type_k": type_k, "type_v": type_v, "flash_attn": ran}
