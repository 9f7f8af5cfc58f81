"""The hidden form of a reference: the output head's input, stored as the capturing CPU kernel consumes it, and
the head itself, replayed into logits when a comparison reads the store.

llama.cpp's `result_norm` (read in its graph, or as its embeddings output: qeval.engine.hidden_tap) is the input
of `logits = W_out @ h` (then, where the GGUF says so, c·tanh(x/c): `<arch>.final_logit_softcapping`). On CPU a
mul_mat first rounds its float32 activations to the weight type's vec_dot_type (ggml-cpu type_traits_cpu): Q8_0 →
q8_0 blocks (per 32 values an fp16 scale d = amax/127 and int8 q = round-half-even(x·127/amax), quantize_row_q8_0),
F16 → fp16, BF16 → bf16, F32 → f32. The store keeps exactly that (ACTIVATIONS), so a replay multiplies what ggml
multiplied. The replay here is qeval's portable one: only the float32 accumulation order of ggml's dot products is
not reproduced (docs/why-logits.md: mean KL ~7e-12 on Gemma-3-270M Q8_0); ggml_replay is llama.cpp's own kernel,
exact where the CPU sums as the capturing one did. The capture measures each replay against llama.cpp's own logits
token by token (the ERRS record of the coded rows, a replay record per engine), so that difference is inside the
certified bound.

A replay must give the same rows wherever it runs: the bound was measured on the rows the capture replayed. The
kernels here are deterministic by construction (no BLAS: a q8_0 block's int8 dot product is an exact integer,
each product of scales exact in float64, and the float64 sums run in a fixed order), and every replayed piece
carries the checksum of its coded rows, which a reader verifies (a machine whose numpy codes a row differently is
refused, never trusted).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numba
import numpy as np

from qeval.errors import QevalError, StoreFormatError
from qeval.storage import ggml_types
from qeval.storage.gguf_file import read_gguf

QK8_0 = 32
FORMS = ("logits", "hidden", "auto")  # --reference-form: what a capture stores (auto: hidden where it replays)
LOGITS, HIDDEN, AUTO = FORMS
DEFAULT_FORM = AUTO  # every capture's unless asked otherwise: the compact form wherever its replay holds
# Auto keeps a chunk hidden only where every token's replay is this close to llama.cpp's own logits
# (KL(exact ‖ replay), nats): ~20x Gemma-3-270M Q8_0's worst token (4.5e-11), ~400x below the code's own error.
AUTO_REPLAY_KL = 1e-9
# post-head ops qeval replays (gemma2/gemma3: c·tanh(x/c)); any other post-head key makes a head unreplayable
SOFTCAP_KEY = "final_logit_softcapping"
UNREPLAYABLE_KEYS = ("logit_scale", "attn_logit_softcapping_final")
VOCAB_TILE = 128  # vocabulary rows the Q8_0 kernel walks at a time: their weights stay in L2 (82 KB of int8 at 640)
REPLAY_THREADS = os.cpu_count() or 1  # runs of tiles replayed at once


@dataclass(frozen=True)
class Activation:
    """How ggml's CPU mul_mat rounds its activations for one weight type, and how a row of them is stored."""

    name: str  # the vec_dot_type, a ggml type: q8_0, f16, bf16, f32

    def row_bytes(self, n_embd: int) -> int:
        return ggml_types.row_bytes(self.name, n_embd)


# weight type (GGML name) -> the activation form its CPU kernel multiplies
ACTIVATIONS = {"Q8_0": Activation("q8_0"), "F16": Activation("f16"), "BF16": Activation("bf16"),
               "F32": Activation("f32")}


class NotReplayable(QevalError):
    """A model whose logits qeval cannot replay exactly from its hidden state (auto then keeps logits)."""


# --- activations: what the kernel multiplies ------------------------------------------------------------------
def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bits (nearest, ties to even, as ggml_compute_fp32_to_bf16; NaN kept quiet)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(np.isnan(x), (bits >> np.uint32(16)) | np.uint32(0x40), rounded).astype(np.uint16)


def encode_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [n, d] as ggml's quantize_row_q8_0 (x86) makes them: (fp16 d [n, d/32], int8 q [n, d/32, 32])."""
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(len(x), -1, QK8_0)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float16)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv).astype(np.int8)  # _mm256_round_ps(_MM_ROUND_NEAREST): ties to even, as np.rint
    return d[..., 0], q


def activation_bytes(hidden: np.ndarray, activation: Activation) -> bytes:
    """float32 hidden rows [n, d] in their stored form: per row, q8_0: the d/32 fp16 scales then the d int8
    values; f16 / bf16 / f32: the values (little-endian)."""
    hidden = np.ascontiguousarray(hidden, dtype=np.float32)
    n = len(hidden)
    if activation.name == "q8_0":
        d, q = encode_q8_0(hidden)
        return np.concatenate([d.astype("<f2").view(np.uint8).reshape(n, -1), q.view(np.uint8).reshape(n, -1)],
                              axis=1).tobytes()
    if activation.name == "f16":
        return hidden.astype("<f2").tobytes()
    if activation.name == "bf16":
        return bf16_bits(hidden).astype("<u2").tobytes()
    return hidden.astype("<f4").tobytes()


@dataclass
class StoredActivations:
    """Hidden rows as stored, split for the replay kernels: q8_0 (scale float64 [n, nb], int8 [n, nb, 32]), or
    the values as float64 [n, d] (fp16 / bf16 / f32 are exact in float64)."""

    scales: np.ndarray | None
    values: np.ndarray

    def __len__(self) -> int:
        return len(self.values)

    def rows(self, start: int, stop: int) -> "StoredActivations":
        return StoredActivations(None if self.scales is None else self.scales[start:stop], self.values[start:stop])

    @classmethod
    def parse(cls, payload, n: int, n_embd: int, activation: Activation, where: str) -> "StoredActivations":
        raw = np.frombuffer(payload, dtype=np.uint8)
        if len(raw) != n * activation.row_bytes(n_embd):
            raise StoreFormatError(f"{where}: hidden rows have {len(raw)} bytes, expected "
                                   f"{n * activation.row_bytes(n_embd)} ({n} rows of {activation.name})")
        rows = raw.reshape(n, -1)
        if activation.name == "q8_0":
            nb = n_embd // QK8_0
            scales = rows[:, :2 * nb].copy().view("<f2").astype(np.float64)
            values = rows[:, 2 * nb:].copy().view(np.int8).reshape(n, nb, QK8_0)
            out = cls(scales, values)
        elif activation.name == "f16":
            out = cls(None, rows.copy().view("<f2").astype(np.float64))
        elif activation.name == "bf16":
            out = cls(None, (rows.copy().view("<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64))
        else:
            out = cls(None, rows.copy().view("<f4").astype(np.float64))
        if not (np.all(np.isfinite(out.values)) and (out.scales is None or np.all(np.isfinite(out.scales)))):
            raise StoreFormatError(f"{where}: hidden rows hold values that are not finite")
        return out


# --- the output head --------------------------------------------------------------------------------------------
_HEAD_PREFIX = struct.Struct("<II")  # u32 length of the JSON description, u32 0; then JSON, then the weight bytes


@dataclass(frozen=True, kw_only=True)
class OutputHead:
    """The output layer of a model as llama.cpp computes it: its weight tensor (raw GGUF bytes of `ggml_type`,
    n_vocab rows of n_embd values) and the post-head soft-cap (0: none)."""

    tensor: str
    ggml_type: str
    n_vocab: int
    n_embd: int
    softcap: float
    data: bytes | memoryview  # the tensor's bytes as in the GGUF

    @property
    def activation(self) -> Activation:
        return ACTIVATIONS[self.ggml_type]

    def describe(self) -> dict:
        """What a store's header says of its head (`head`): enough to check a head against it."""
        return {"tensor": self.tensor, "type": self.ggml_type, "n_vocab": self.n_vocab, "n_embd": self.n_embd,
                "softcap": self.softcap, "activation": self.activation.name, "bytes": len(self.data),
                "fingerprint": self.fingerprint}

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over the description and the weight bytes: equal only for the same head."""
        h = hashlib.sha256(f"{self.tensor}:{self.ggml_type}:{self.n_vocab}:{self.n_embd}:{self.softcap!r}\n".encode())
        h.update(self.data)
        return h.hexdigest()

    def payload_parts(self) -> list:
        """The OUTW record's payload (docs/store-format.md) in the parts it joins: its description, then the weights
        as they are held (not copied)."""
        desc = json.dumps({k: v for k, v in self.describe().items() if k not in ("fingerprint", "bytes")},
                          sort_keys=True).encode()
        return [_HEAD_PREFIX.pack(len(desc), 0) + desc, self.data]

    @classmethod
    def from_payload(cls, payload, where: str) -> "OutputHead":
        """The head of an OUTW payload, checked (StoreFormatError)."""
        view = memoryview(payload)
        if len(view) < _HEAD_PREFIX.size:
            raise StoreFormatError(f"{where}: output head record is too short")
        n_desc, zero = _HEAD_PREFIX.unpack_from(view)
        if zero or _HEAD_PREFIX.size + n_desc > len(view):
            raise StoreFormatError(f"{where}: output head record is malformed")
        try:
            d = json.loads(bytes(view[_HEAD_PREFIX.size:_HEAD_PREFIX.size + n_desc]))
        except (UnicodeDecodeError, ValueError):
            raise StoreFormatError(f"{where}: output head description is not JSON") from None
        head = head_of_description(d, view[_HEAD_PREFIX.size + n_desc:], where)
        return head

    @cached_property
    def weights(self) -> StoredActivations:
        """The weights laid out for the replay kernels, once per head: Q8_0 in tiles of VOCAB_TILE vocabulary rows,
        scales float64 [tiles, nb, VOCAB_TILE] and int8 values [tiles, nb, 32, VOCAB_TILE] (the vocabulary last, so
        the kernel's inner loop runs along it; each tile contiguous; the last one padded with zeros); F16 / BF16 /
        F32 as float32 [V, d]."""
        if self.ggml_type == "Q8_0":
            nb = self.n_embd // QK8_0
            n_tiles = -(-self.n_vocab // VOCAB_TILE)
            blocks = np.zeros((n_tiles * VOCAB_TILE, nb, 2 + QK8_0), dtype=np.uint8)
            blocks[:self.n_vocab] = np.frombuffer(self.data, dtype=np.uint8).reshape(self.n_vocab, nb, 2 + QK8_0)
            tiled = blocks.reshape(n_tiles, VOCAB_TILE, nb, 2 + QK8_0)
            scales = np.ascontiguousarray(tiled[..., :2]).view("<f2")[..., 0].transpose(0, 2, 1).astype(np.float64)
            values = np.ascontiguousarray(tiled[..., 2:].transpose(0, 2, 3, 1)).view(np.int8)
            return StoredActivations(np.ascontiguousarray(scales), values)
        dtype = {"F16": "<f2", "F32": "<f4"}.get(self.ggml_type)
        raw = np.frombuffer(self.data, dtype=dtype or "<u2").reshape(self.n_vocab, self.n_embd)
        if dtype is None:  # BF16
            return StoredActivations(None, (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float32))
        return StoredActivations(None, raw.astype(np.float32))

    def replay(self, rows: StoredActivations) -> np.ndarray:
        """float64 logits [n, n_vocab] of stored hidden rows, post-head ops applied; the same on every machine.
        The vocabulary's tiles are split into REPLAY_THREADS runs, one compiled call each (each tile's rows are
        independent sums, so the split changes no bit; a Python task per tile cost a fifth of a capture's encoding
        at 16 rows a call)."""
        out = np.empty((len(rows), self.n_vocab), dtype=np.float64)
        n_tiles = -(-self.n_vocab // VOCAB_TILE)
        runs = np.linspace(0, n_tiles, min(REPLAY_THREADS, n_tiles) + 1).astype(np.int64)
        multiplied = rows.values.astype(np.float32) if rows.scales is not None else np.ascontiguousarray(rows.values.T)

        def replay_run(first: int, stop: int) -> None:
            vocab = slice(first * VOCAB_TILE, stop * VOCAB_TILE)
            if rows.scales is not None:
                _replay_q8_0_tiles(multiplied, rows.scales, self.weights.values, self.weights.scales, out, first,
                                   stop)
            else:
                _replay_float(multiplied, self.weights.values[vocab], out[:, vocab])
            if self.softcap:
                out[:, vocab] = self.softcap * np.tanh(out[:, vocab] / self.softcap)

        with ThreadPoolExecutor(len(runs) - 1) as pool:
            list(pool.map(replay_run, runs[:-1], runs[1:]))
        return out


def head_entry(head: OutputHead, form: str) -> dict:
    """A store header's `head`: the head's description and the form the capture was asked for (hidden, auto)."""
    return {**head.describe(), "form": form}


def check_head_entry(entry: dict, n_vocab: int, where: str) -> None:
    """A header's `head` entry, checked (StoreFormatError): what a reader needs before it reads the head itself."""
    ok = (entry.get("form") in FORMS[1:] and isinstance(entry.get("type"), str) and entry["type"] in ACTIVATIONS and entry.get("n_vocab") == n_vocab
          and isinstance(entry.get("n_embd"), int) and isinstance(entry.get("fingerprint"), str)
          and entry.get("activation") == ACTIVATIONS[entry["type"]].name)
    if not ok:
        raise StoreFormatError(f"{where}: header field 'head' is malformed or names a form or head type this qeval "
                               f"does not know ({ {k: entry.get(k) for k in ('form', 'type', 'activation')} })")


def head_of_description(d: object, data, where: str) -> OutputHead:
    """An OutputHead from a description (OUTW's JSON) and its weight bytes, checked."""
    if not isinstance(d, dict):
        raise StoreFormatError(f"{where}: output head description is not an object")
    tensor, ggml_type = d.get("tensor"), d.get("type")
    n_vocab, n_embd, softcap = d.get("n_vocab"), d.get("n_embd"), d.get("softcap", 0.0)
    if ggml_type not in ACTIVATIONS:
        raise StoreFormatError(f"{where}: output head of type {ggml_type!r}: qeval replays "
                               f"{', '.join(ACTIVATIONS)} heads only")
    ints_ok = all(isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 24 for v in (n_vocab, n_embd))
    if not (isinstance(tensor, str) and ints_ok and isinstance(softcap, (int, float)) and math.isfinite(softcap)
            and softcap >= 0 and (ggml_type != "Q8_0" or n_embd % QK8_0 == 0)):
        raise StoreFormatError(f"{where}: output head description is malformed ({d!r})")
    expected = n_vocab * ggml_types.row_bytes(ggml_type, n_embd)
    if len(data) != expected:
        raise StoreFormatError(f"{where}: output head has {len(data)} bytes of weights, expected {expected}")
    return OutputHead(tensor=tensor, ggml_type=ggml_type, n_vocab=n_vocab, n_embd=n_embd, softcap=float(softcap),
                      data=data)


def read_head(model_path: str | Path) -> OutputHead:
    """The output head of a GGUF as llama.cpp uses it: `output.weight`, else the tied `token_embd.weight`; its
    soft-cap. NotReplayable for a head type or post-head op qeval does not replay exactly."""
    gguf_file = read_gguf(model_path)
    tensors = {t.name: t for t in gguf_file.tensors}
    tensor = tensors.get("output.weight") or tensors.get("token_embd.weight")
    arch = gguf_file.field("general.architecture") or "?"
    if tensor is None:
        raise NotReplayable(f"{Path(model_path).name} has no output head tensor (output.weight or token_embd.weight)")
    ggml_type = tensor.type_name
    if ggml_type not in ACTIVATIONS:
        raise NotReplayable(f"{Path(model_path).name}'s output head is {ggml_type}: qeval replays "
                            f"{', '.join(ACTIVATIONS)} heads exactly, not k-quants or others")
    if "output.bias" in tensors or any(gguf_file.field(f"{arch}.{k}") is not None for k in UNREPLAYABLE_KEYS):
        raise NotReplayable(f"{Path(model_path).name} applies an op after its output head that qeval does not replay")
    n_embd, n_vocab = tensor.shape[:2]  # ggml order: ne0 = the row length
    softcap = float(gguf_file.field(f"{arch}.{SOFTCAP_KEY}") or 0.0)
    return OutputHead(tensor=tensor.name, ggml_type=ggml_type, n_vocab=n_vocab, n_embd=n_embd, softcap=softcap,
                      data=memoryview(gguf_file.tensor_bytes(tensor)))


# --- replay kernels (deterministic: no BLAS, a fixed summation order, whatever thread runs a tile) ---------------
@numba.njit(nogil=True, cache=True, fastmath=False)
def _replay_q8_0(x_q, x_scale, w_t, w_scale_t, out):  # pragma: no cover - compiled
    """out[t, v] = Σ_b (Σ_j x_q[t,b,j]·w_t[b,j,v]) · (x_scale[t,b]·w_scale_t[b,v]), b in order, in float64; four
    tokens at a time along the vocabulary (each weight loaded once for four). x_q float32 [T, nb, 32] (int values),
    x_scale float64 [T, nb], w_t int8 [nb, 32, ≥ V], w_scale_t float64 [nb, ≥ V], out [T, V]. A block's integer dot product is at
    most 32·127·127 < 2^24, so every partial sum of it is exact in float32; each scale product is exact in float64
    (fp16 · fp16), each term too (< 2^19 times a 22-bit product), and the blocks are summed in order."""
    n, nb, _ = x_q.shape
    vt = out.shape[1]
    dots = np.empty((4, vt), dtype=np.float32)
    acc = np.empty((4, vt))
    zero = np.float32(0)
    for t0 in range(0, n, 4):
        m = min(4, n - t0)
        acc[:] = 0.0
        for b in range(nb):
            dots[:] = 0.0
            for j in range(QK8_0):
                x0 = x_q[t0, b, j]
                x1 = x_q[t0 + 1, b, j] if m > 1 else zero
                x2 = x_q[t0 + 2, b, j] if m > 2 else zero
                x3 = x_q[t0 + 3, b, j] if m > 3 else zero
                w = w_t[b, j]
                for v in range(vt):
                    wv = np.float32(w[v])
                    dots[0, v] += x0 * wv
                    dots[1, v] += x1 * wv
                    dots[2, v] += x2 * wv
                    dots[3, v] += x3 * wv
            for k in range(m):
                xs = x_scale[t0 + k, b]
                for v in range(vt):
                    acc[k, v] += np.float64(dots[k, v]) * (xs * w_scale_t[b, v])
        for k in range(m):
            out[t0 + k, :] = acc[k]


@numba.njit(nogil=True, cache=True, fastmath=False)
def _replay_q8_0_tiles(x_q, x_scale, w_tiles, w_scale_tiles, out, first, stop):  # pragma: no cover - compiled
    """_replay_q8_0 of tiles [first, stop) of a tiled Q8_0 head (OutputHead.weights) into their columns of out."""
    vt, n_vocab = w_tiles.shape[3], out.shape[1]
    for tile in range(first, stop):
        start = tile * vt
        _replay_q8_0(x_q, x_scale, w_tiles[tile], w_scale_tiles[tile], out[:, start:min(start + vt, n_vocab)])


@numba.njit(nogil=True, cache=True, fastmath=False)
def _replay_float(x_t, w, out):  # pragma: no cover - compiled
    """out[t, v] = Σ_i x[t,i]·w[v,i] in float64, i in order (fp16 / bf16 products are exact in float64).
    x_t float64 [d, T], w float32 [V, d]."""
    d, n = x_t.shape
    acc = np.empty(n)
    for v in range(w.shape[0]):
        acc[:] = 0.0
        for i in range(d):
            wi = np.float64(w[v, i])
            x = x_t[i]
            for t in range(n):
                acc[t] += x[t] * wi
        out[:, v] = acc
