"""The output head's input, read while llama.cpp computes it: ggml's graph-evaluation callback (llama_context_params
cb_eval) copies every `result_norm` tensor a decode computes into a buffer of qeval's.

Why not llama.cpp's embeddings output: with embeddings on, llama.cpp outputs every token of a call, so its output
head multiplies every token, not only the scored ones. At the seeds' width (a 248,320 × 2048 head, 8K windows scored
every 64th token) that made a hidden capture take 2.58× the logits capture's time, 71 of its 80 s in llama_decode
(AMD EPYC Zen 4, issue 42). Read in the graph, `result_norm` holds the rows of the call's requested outputs alone: the
rows whose logits llama.cpp computes anyway, in the order it computes them.

That order is the batch's while a call holds one sequence (llama.cpp's ubatches are then consecutive runs of the
batch); a call of several sequences is split into ubatches that interleave them, so an Engine taps only calls of one
sequence (Engine.output_hidden). A graph that names no `result_norm`, or rows that are not float32 rows of n_embd,
are refused with the count of rows found, never guessed (HiddenTap.rows).

The callback runs inside llama_decode, on the decoding thread: it copies with ggml_backend_tensor_get, which reads a
GPU's buffer as well as host memory, and never raises into C (an error is kept and raised after the decode).
"""

from __future__ import annotations

import ctypes
from ctypes import c_bool, c_char_p, c_int64, c_size_t, c_void_p
from functools import lru_cache

import numpy as np

from qeval.errors import QevalError
from qeval.storage.llama_libraries import library_path

RESULT_NORM = b"result_norm"  # llama.cpp's name of the output head's input (llama-model.cpp, every decoder)


class _GgmlTensorApi:
    """The functions of libggml-base the tap calls on a graph's tensors (no struct layout is assumed)."""

    def __init__(self, base: ctypes.CDLL):
        def fn(name, restype, *argtypes):
            f = getattr(base, name)
            f.restype, f.argtypes = restype, list(argtypes)
            return f

        self.get_name = fn("ggml_get_name", c_char_p, c_void_p)
        self.nrows = fn("ggml_nrows", c_int64, c_void_p)
        self.nelements = fn("ggml_nelements", c_int64, c_void_p)
        self.nbytes = fn("ggml_nbytes", c_size_t, c_void_p)
        self.is_contiguous = fn("ggml_is_contiguous", c_bool, c_void_p)
        self.tensor_get = fn("ggml_backend_tensor_get", None, c_void_p, c_void_p, c_size_t, c_size_t)


@lru_cache(maxsize=1)
def _api() -> _GgmlTensorApi | None:
    """libggml-base of the build qeval runs (the file llama-cpp-python loaded), or None."""
    try:
        base = library_path("ggml-base")
        return None if base is None else _GgmlTensorApi(ctypes.CDLL(str(base)))
    except (ImportError, OSError, AttributeError):
        return None


def available() -> bool:
    return _api() is not None


class HiddenTap:
    """Collects the `result_norm` rows of each decode, in the order llama.cpp computes them: at most `max_rows`
    (a call's tokens) of `n_embd` float32 each. `callback` goes into llama_context_params.cb_eval (keep this object
    alive as long as the context is)."""

    def __init__(self, n_embd: int, max_rows: int, callback_type=None):
        """callback_type: the llama_cpp module's ctypes type of cb_eval (default: one of the same signature)."""
        self._api = _api()
        if self._api is None:
            raise QevalError("this llama.cpp build's libggml-base could not be loaded to read hidden states")
        self.n_embd = n_embd
        self.buffer = np.empty((max_rows, n_embd), dtype=np.float32)
        self.n_rows = 0
        self._error: str | None = None
        self.callback = (callback_type or _EVAL_CALLBACK)(self._on_tensor)

    def start(self) -> None:
        """Before a decode: its rows start the buffer."""
        self.n_rows, self._error = 0, None

    def _on_tensor(self, tensor: int, ask: bool, _user_data) -> bool:
        api = self._api
        try:
            if ask:  # only the head's input is waited for and read: the graph computes in one piece otherwise
                return api.get_name(tensor) == RESULT_NORM
            if self._error is None:
                self._copy(tensor)
        except Exception as exc:  # noqa: BLE001 - nothing may raise into llama_decode; reported by rows()
            self._error = f"{type(exc).__name__}: {exc}"
        return True

    def _copy(self, tensor: int) -> None:
        api, rows = self._api, int(self._api.nrows(tensor))
        if not rows:
            return
        size = int(api.nbytes(tensor))
        want = rows * self.n_embd
        if not api.is_contiguous(tensor) or int(api.nelements(tensor)) != want or size != want * 4:
            self._error = (f"a result_norm of {api.nelements(tensor)} elements in {size} bytes is not float32 rows "
                           f"of {self.n_embd}")
        elif self.n_rows + rows > len(self.buffer):
            self._error = f"more than {len(self.buffer)} result_norm rows in one call"
        else:
            api.tensor_get(tensor, self.buffer[self.n_rows:].ctypes.data, 0, size)
            self.n_rows += rows

    def rows(self, expected: int) -> np.ndarray:
        """float32 [expected, n_embd]: the last decode's rows, a view valid until the next decode. QevalError when the
        graph gave another count (no `result_norm`, or outputs llama.cpp computes elsewhere) or the callback failed."""
        if self._error is not None or self.n_rows != expected:
            raise QevalError("could not read the output head's input from llama.cpp's graph: "
                             f"{self._error or f'{self.n_rows} result_norm rows for {expected} outputs'}")
        return self.buffer[:expected]


# typedef bool (*ggml_backend_sched_eval_callback)(struct ggml_tensor * t, bool ask, void * user_data)
_EVAL_CALLBACK = ctypes.CFUNCTYPE(c_bool, c_void_p, c_bool, c_void_p)
