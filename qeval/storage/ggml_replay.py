"""The hidden form's head replayed by llama.cpp's own CPU kernel: ggml's mul_mat from the build qeval runs (the
llama_cpp package's libggml, or LLAMA_CPP_LIB_PATH's), called through its C API.

The stored activations are exactly what ggml's mul_mat multiplied when llama.cpp computed the capture's logits
(hidden_form.ACTIVATIONS: for a Q8_0 head, the q8_0 blocks it quantized its float32 input to), and a mul_mat given
an input already of the weight's vec_dot_type multiplies it as it is. So on a machine whose ggml takes the same
kernel path, this replay gives llama.cpp's float32 logits bit for bit (measured: Gemma-3-270M Q8_0, 765 of 765
rows identical, AMD EPYC Zen 4), at ggml's own speed; the post-head soft-cap is applied with the ops llama.cpp's
graph uses (scale, tanh, scale). Another CPU may sum in another order: the capture records the checksum of these
rows and their error against the exact logits, and a reader uses them only where its rows hash the same
(store.HiddenChunk), else qeval's portable replay (hidden_form.OutputHead.replay).

Only the few C functions below are used; a library that lacks them, or none at all, makes this engine unavailable
(`GgmlHead.of` returns None), never an error.
"""

from __future__ import annotations

import ctypes
import os
import threading
from ctypes import c_bool, c_float, c_int, c_int64, c_size_t, c_void_p
from functools import lru_cache

import numpy as np

from qeval.errors import QevalError
from qeval.storage.ggml_types import type_id
from qeval.storage.hidden_form import QK8_0, OutputHead, StoredActivations
from qeval.storage.llama_libraries import library_path

# Rows multiplied per graph, always (padded with zero rows): ggml picks its kernel by the shape of the product (an
# F16 head's rows come out otherwise one by one than 64 at a time), so a fixed shape, and a row always in the same
# place of it (its row in the chunk, modulo ROWS_PER_CALL, whoever replays it: the capture block by block, a reader
# piece by piece), make a row's logits a property of the row alone. The output buffer, reused, is 64 MB at a 262K
# vocabulary.
ROWS_PER_CALL = 64
_SLACK = 32 << 20  # what a context needs beyond its tensors' data: objects, the graph, the kernel's work buffer


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", c_size_t), ("mem_buffer", c_void_p), ("no_alloc", c_bool)]


class _Ggml:
    """The C functions of libggml-base and libggml-cpu this engine calls."""

    def __init__(self, base: ctypes.CDLL, cpu: ctypes.CDLL):
        def fn(lib, name, restype, *argtypes):
            f = getattr(lib, name)
            f.restype, f.argtypes = restype, list(argtypes)
            return f

        self.init = fn(base, "ggml_init", c_void_p, _InitParams)
        self.free = fn(base, "ggml_free", None, c_void_p)
        self.reset = fn(base, "ggml_reset", None, c_void_p)
        self.new_tensor_2d = fn(base, "ggml_new_tensor_2d", c_void_p, c_void_p, c_int, c_int64, c_int64)
        self.mul_mat = fn(base, "ggml_mul_mat", c_void_p, c_void_p, c_void_p, c_void_p)
        self.scale = fn(base, "ggml_scale", c_void_p, c_void_p, c_void_p, c_float)
        self.tanh = fn(base, "ggml_tanh", c_void_p, c_void_p, c_void_p)
        self.new_graph = fn(base, "ggml_new_graph", c_void_p, c_void_p)
        self.build_forward_expand = fn(base, "ggml_build_forward_expand", None, c_void_p, c_void_p)
        self.get_data = fn(base, "ggml_get_data", c_void_p, c_void_p)
        self.tensor_overhead = fn(base, "ggml_tensor_overhead", c_size_t)
        self.graph_overhead = fn(base, "ggml_graph_overhead", c_size_t)
        self.compute = fn(cpu, "ggml_graph_compute_with_ctx", c_int, c_void_p, c_void_p, c_int)
        fn(cpu, "ggml_cpu_init", None)()


@lru_cache(maxsize=1)
def _library() -> _Ggml | None:
    """The ggml of the llama.cpp build qeval runs (llama-cpp-python loads the same files), or None."""
    try:
        base, cpu = library_path("ggml-base"), library_path("ggml-cpu")
        return None if base is None or cpu is None else _Ggml(ctypes.CDLL(str(base)), ctypes.CDLL(str(cpu)))
    except (ImportError, OSError, AttributeError):
        return None


def ggml_rows(rows: StoredActivations, activation: str) -> np.ndarray:
    """Stored activation rows as ggml lays out a tensor of their type: q8_0 blocks of an fp16 scale then 32 int8
    (uint8 [n, nb·34]); fp16 / bf16 bits or float32 values otherwise. Exact: the stored values are kept as they are."""
    if rows.scales is not None:
        n, nb = rows.scales.shape
        blocks = np.empty((n, nb, 2 + QK8_0), dtype=np.uint8)
        blocks[..., :2] = rows.scales.astype("<f2").view(np.uint8).reshape(n, nb, 2)
        blocks[..., 2:] = rows.values.view(np.uint8)
        return blocks.reshape(n, -1)
    if activation == "f16":
        return rows.values.astype("<f2")
    if activation == "bf16":
        return (rows.values.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype("<u2")
    return rows.values.astype("<f4")


class GgmlHead:
    """An output head held in a ggml context, replaying stored rows through ggml's mul_mat on `threads` threads."""

    def __init__(self, lib: _Ggml, head: OutputHead, threads: int):
        self.lib, self.head, self.threads = lib, head, threads
        self._lock = threading.Lock()  # one graph at a time: the work context is reused
        self.reproduces: bool | None = None  # whether a replay here gave llama.cpp's own logits (rows_of)
        self._weights_ctx = lib.init(_InitParams(len(head.data) + lib.tensor_overhead() + _SLACK, None, False))
        self._weights = lib.new_tensor_2d(self._weights_ctx, type_id(head.ggml_type), head.n_embd,
                                          head.n_vocab)
        ctypes.memmove(lib.get_data(self._weights), np.frombuffer(head.data, dtype=np.uint8).ctypes.data,
                       len(head.data))
        out_bytes = ROWS_PER_CALL * head.n_vocab * 4 * (4 if head.softcap else 1)  # the soft-cap's ops: 3 more
        in_bytes = ROWS_PER_CALL * head.n_embd * 4
        self._work_ctx = lib.init(_InitParams(in_bytes + out_bytes + 8 * lib.tensor_overhead() + lib.graph_overhead()
                                              + _SLACK, None, False))

    @classmethod
    def of(cls, head: OutputHead, threads: int | None = None) -> "GgmlHead | None":
        """This head in ggml, or None where no ggml library is at hand."""
        lib = _library()
        return None if lib is None else cls(lib, head, threads or os.cpu_count() or 1)

    def replay(self, rows: StoredActivations, first_row: int = 0) -> np.ndarray:
        """float32 logits [n, n_vocab] of stored rows, as llama.cpp's graph computes them on this machine; `first_row`:
        the first one's row in its chunk (each row goes to its place in a call: ROWS_PER_CALL)."""
        layout = np.ascontiguousarray(ggml_rows(rows, self.head.activation.name))
        out = np.empty((len(rows), self.head.n_vocab), dtype=np.float32)
        done = 0
        with self._lock:
            while done < len(rows):
                place = (first_row + done) % ROWS_PER_CALL
                take = min(ROWS_PER_CALL - place, len(rows) - done)
                padded = np.zeros((ROWS_PER_CALL, layout.shape[1]), dtype=layout.dtype)
                padded[place:place + take] = layout[done:done + take]
                out[done:done + take] = self._multiply(padded)[place:place + take]
                done += take
        return out

    def rows_of(self, rows: StoredActivations, first_row: int, logits: np.ndarray) -> np.ndarray:
        """The rows a replay on this machine gives for stored rows that llama.cpp computed as float32 `logits`, for a
        capture's record of this engine: replayed until a replay is seen to give `logits` bit for bit, then `logits`
        themselves (the kernel and its summation order are fixed by the call's shape: a capture need not multiply
        the head again); replayed always where the first replay gave other rows. A record of `logits` is true
        whatever a reader's ggml does: rows that hash as they do are llama.cpp's own, and a reader whose rows do not
        reads the portable replay (store.HiddenChunk)."""
        if self.reproduces:
            return logits
        replayed = self.replay(rows, first_row)
        if self.reproduces is None:
            self.reproduces = bool(np.array_equal(replayed.view(np.uint32), np.ascontiguousarray(
                logits, dtype=np.float32).view(np.uint32)))
        return replayed

    def _multiply(self, part: np.ndarray) -> np.ndarray:
        lib, ctx, head = self.lib, self._work_ctx, self.head
        lib.reset(ctx)
        x = lib.new_tensor_2d(ctx, type_id(head.ggml_type), head.n_embd, len(part))  # the vec_dot_type
        ctypes.memmove(lib.get_data(x), part.ctypes.data, part.nbytes)
        logits = lib.mul_mat(ctx, self._weights, x)
        if head.softcap:  # as llama.cpp's graph: scale by 1/c, tanh, scale by c, in float32
            logits = lib.scale(ctx, lib.tanh(ctx, lib.scale(ctx, logits, 1.0 / head.softcap)), head.softcap)
        graph = lib.new_graph(ctx)
        lib.build_forward_expand(graph, logits)
        if lib.compute(ctx, graph, self.threads) != 0:
            raise QevalError(f"ggml could not compute the replay of the output head {head.tensor} ({head.ggml_type})")
        values = (c_float * (len(part) * head.n_vocab)).from_address(lib.get_data(logits))
        return np.ctypeslib.as_array(values).reshape(len(part), head.n_vocab).copy()

    def __del__(self):
        for ctx in (getattr(self, "_work_ctx", None), getattr(self, "_weights_ctx", None)):
            if ctx:
                self.lib.free(ctx)
