"""The hidden form of a reference (qeval.storage.hidden_form, format version 6): the output head's input stored as
ggml's CPU kernel consumes it, replayed through the embedded head by a reader (qeval's portable kernel, or ggml's
own: qeval.storage.ggml_replay). Replay kernels against plain float64, stores written and read back, coded and
uncoded, the bound against float64 logits token by token, and a reader that trusts nothing."""

from __future__ import annotations

import ctypes
import json
import struct
import sys

import numpy as np
import pytest
import xxhash
from conftest import make_header, make_tokens, perturb, write_store
from test_error_bound import assert_bound_holds
from test_metrics import RowsSource
from test_store import _records, _rewrite_payload

from qeval import api
from qeval.compare import metrics
from qeval.errors import StoreFormatError
from qeval.identity import capture_conflicts, form
from qeval.storage import ggml_replay, ggml_types, hidden_form, llama_libraries
from qeval.storage.codec import REPLAY_ENGINES, SqrtLogCode, encode_hidden_block
from qeval.storage.ggml_replay import GgmlHead
from qeval.storage.hidden_form import (
    ACTIVATIONS,
    AUTO_REPLAY_KL,
    QK8_0,
    OutputHead,
    StoredActivations,
    activation_bytes,
    bf16_bits,
    encode_q8_0,
    head_entry,
    read_head,
)
from qeval.storage.store import (
    LEAN_VERSION,
    PIECE_ROWS,
    ChunkBuilder,
    HiddenChunk,
    StoreHeader,
    StoreReader,
    StoreWriter,
)

N_VOCAB, N_EMBD, N_CTX = 700, 64, 24


def tiny_head(rng: np.random.Generator, ggml_type: str = "Q8_0", softcap: float = 0.0) -> OutputHead:
    """A random head of `ggml_type` whose logits spread over a few nats."""
    w = (rng.standard_normal((N_VOCAB, N_EMBD)) * 0.4).astype(np.float32)
    if ggml_type == "Q8_0":
        d, q = encode_q8_0(w)
        data = np.concatenate([d.astype("<f2").view(np.uint8).reshape(N_VOCAB, -1, 2), q.view(np.uint8)], axis=2)
    elif ggml_type == "F16":
        data = w.astype("<f2")
    elif ggml_type == "BF16":
        data = bf16_bits(w)
    else:
        data = w
    return OutputHead(tensor="output.weight", ggml_type=ggml_type, n_vocab=N_VOCAB, n_embd=N_EMBD, softcap=softcap, data=np.ascontiguousarray(data).tobytes())


def dequantized(head: OutputHead) -> np.ndarray:
    """The head's weights as float64 [V, d], by the GGML layouts (independently of the kernels' parsing)."""
    raw = np.frombuffer(head.data, np.uint8)
    if head.ggml_type == "Q8_0":
        blocks = raw.reshape(N_VOCAB, -1, 2 + QK8_0)
        d = blocks[:, :, :2].copy().view("<f2").astype(np.float64)
        return (blocks[:, :, 2:].copy().view(np.int8) * d).reshape(N_VOCAB, -1)
    if head.ggml_type == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(N_VOCAB, -1).astype(np.float64)
    return raw.view({"F16": "<f2", "F32": "<f4"}[head.ggml_type]).reshape(N_VOCAB, -1).astype(np.float64)


def as_multiplied(hidden: np.ndarray, head: OutputHead) -> np.ndarray:
    """float64 of what ggml multiplies: the activations after the kernel's rounding (plain numpy)."""
    if head.ggml_type == "Q8_0":
        blocks = hidden.astype(np.float32).reshape(len(hidden), -1, QK8_0)
        amax = np.abs(blocks).max(axis=-1, keepdims=True)
        d = (amax / 127).astype(np.float16).astype(np.float64)
        with np.errstate(divide="ignore"):  # a block of zeros: q = 0
            q = np.rint(blocks * np.where(amax > 0, np.float32(127) / amax, 0).astype(np.float32))
        return (q * d).reshape(len(hidden), -1)
    if head.ggml_type == "F16":
        return hidden.astype(np.float16).astype(np.float64)
    if head.ggml_type == "BF16":
        return (bf16_bits(hidden).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return hidden.astype(np.float64)


@pytest.mark.parametrize("ggml_type", ["Q8_0", "F16", "BF16", "F32"])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_replay_is_the_float64_product_and_independent_of_the_block(ggml_type, softcap):
    """The kernels give W·h of the rounded activations (float64 to ~1e-15), soft-capped where asked, and the same
    bits for a row whatever rows are replayed beside it."""
    rng = np.random.default_rng(1)
    head = tiny_head(rng, ggml_type, softcap)
    hidden = rng.standard_normal((37, N_EMBD)).astype(np.float32) * 3
    rows = StoredActivations.parse(activation_bytes(hidden, head.activation), 37, N_EMBD, head.activation, "t")
    got = head.replay(rows)
    want = as_multiplied(hidden, head) @ dequantized(head).T
    if softcap:
        want = softcap * np.tanh(want / softcap)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-12)
    one_by_one = np.concatenate([head.replay(rows.rows(t, t + 1)) for t in range(37)])
    np.testing.assert_array_equal(got, one_by_one)


@pytest.mark.parametrize("ggml_type", ["Q8_0", "F16", "BF16", "F32"])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_ggml_replays_the_float64_product_to_float32_and_row_by_row(ggml_type, softcap):
    """llama.cpp's own kernel (this build's ggml) on the stored rows: W·h of the rounded activations to float32
    accumulation error, soft-capped where asked, and the same bits for a row at its row of the chunk whatever rows
    are multiplied beside it, and however the rows are split into calls (a capture's blocks, a reader's pieces):
    what makes its checksum a property of the rows."""
    rng = np.random.default_rng(2)
    head = tiny_head(rng, ggml_type, softcap)
    hidden = rng.standard_normal((70, N_EMBD)).astype(np.float32) * 3
    rows = StoredActivations.parse(activation_bytes(hidden, head.activation), 70, N_EMBD, head.activation, "t")
    ggml = GgmlHead.of(head, threads=2)
    got = ggml.replay(rows)
    assert got.dtype == np.float32 and got.shape == (70, N_VOCAB)
    want = as_multiplied(hidden, head) @ dequantized(head).T
    if softcap:
        want = softcap * np.tanh(want / softcap)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    for start, stop in ((0, 3), (69, 70), (16, 32), (60, 70)):
        np.testing.assert_array_equal(got[start:stop], ggml.replay(rows.rows(start, stop), start))


def test_a_capture_replays_with_ggml_until_a_replay_gives_llamacpps_own_rows(monkeypatch):
    """GgmlHead.rows_of: rows equal to llama.cpp's logits bit for bit once, then the logits themselves without a
    replay; rows that differed once (here: llama.cpp's logits one ulp off), replayed every time."""
    rng = np.random.default_rng(3)
    head = tiny_head(rng)
    hidden = rng.standard_normal((20, N_EMBD)).astype(np.float32) * 3
    rows = StoredActivations.parse(activation_bytes(hidden, head.activation), 20, N_EMBD, head.activation, "t")
    exact = GgmlHead.of(head, threads=2).replay(rows)
    same, other = GgmlHead.of(head, threads=2), GgmlHead.of(head, threads=2)
    calls = {"same": 0, "other": 0}
    for name, ggml in (("same", same), ("other", other)):
        replay = ggml.replay
        monkeypatch.setattr(ggml, "replay", lambda *a, n=name, f=replay: (calls.__setitem__(n, calls[n] + 1), f(*a))[1])
    off = np.nextafter(exact, np.inf)
    for start in (0, 10):
        part = rows.rows(start, start + 10)
        np.testing.assert_array_equal(same.rows_of(part, start, exact[start:start + 10]), exact[start:start + 10])
        np.testing.assert_array_equal(other.rows_of(part, start, off[start:start + 10]), exact[start:start + 10])
    assert (same.reproduces, other.reproduces) == (True, False) and calls == {"same": 1, "other": 2}
    assert same.rows_of(rows, 0, exact) is exact


def test_ggml_types_are_gguf_tables_as_they_were_written_by_hand():
    """The ids and block sizes qeval used to write out (hidden_form, modelinfo, memory), now read from gguf."""
    ids = {"F32": 0, "F16": 1, "Q8_0": 8, "BF16": 30, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "iq4_nl": 20}
    blocks = {"f32": (4, 1), "f16": (2, 1), "bf16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32), "q4_1": (20, 32),
              "q5_0": (22, 32), "q5_1": (24, 32), "iq4_nl": (18, 32)}
    assert {name: ggml_types.type_id(name) for name in ids} == ids
    for name, (size, block) in blocks.items():
        assert ggml_types.row_bytes(name, 640) == 640 // block * size
        assert ggml_types.bytes_per_value(name) == size / block
    assert ggml_types.is_type("Q4_K") and not ggml_types.is_type("q9_9") and not ggml_types.is_type(None)
    assert [a.row_bytes(640) for a in ACTIVATIONS.values()] == [680, 1280, 1280, 2560]


@pytest.mark.parametrize("platform, names", [
    ("linux", ["libggml-base.so"]),
    ("darwin", ["libggml-base.so", "libggml-base.dylib"]),
    ("win32", ["ggml-base.dll", "libggml-base.dll"]),
])
def test_llamacpps_libraries_are_found_by_their_name_on_each_platform(monkeypatch, tmp_path, platform, names):
    """One lookup for every platform llama-cpp-python ships for (its own names, in its order); LLAMA_CPP_LIB_PATH
    is the folder it loads from when set. A folder of another platform's files holds no library."""
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))
    assert llama_libraries.library_file_names("ggml-base") == names
    assert llama_libraries.library_path("ggml-base") is None
    for name in reversed(names):  # the last one alone, then the first beside it: the first wins
        (tmp_path / name).write_bytes(b"")
        assert llama_libraries.library_path("ggml-base") == tmp_path / name
    other = tmp_path / "other"
    other.mkdir()
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        if name not in names:
            (other / name).write_bytes(b"")
    assert llama_libraries.library_path("ggml-base", other) is None
    assert llama_libraries.loaded_folder() == tmp_path


def test_without_its_libraries_the_ggml_replay_is_unavailable_not_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))
    ggml_replay._library.cache_clear()
    try:
        assert GgmlHead.of(tiny_head(np.random.default_rng(0))) is None
    finally:
        ggml_replay._library.cache_clear()


@pytest.mark.parametrize("n_tokens", [1, 5, 37])
@pytest.mark.parametrize("threads", [1, 2, 5, 16])
def test_q8_0_replay_is_the_in_order_block_sum_bit_for_bit(n_tokens, threads, monkeypatch):
    """A store's checksum is over replayed rows, so the kernel must give one fixed sum on any machine and tiling:
    Σ_b int_dot_b · (d_x·d_w), blocks in order, float64, computed here with exact int64 dot products (plain numpy),
    over token counts that are not a multiple of the kernel's 4, a vocabulary that is not one of its tile (6 tiles
    of 128), and the tiles split into runs for 1, 2, 5 or 16 cores (more cores than tiles: one run per tile)."""
    monkeypatch.setattr(hidden_form, "REPLAY_THREADS", threads)
    rng = np.random.default_rng(7)
    head = tiny_head(rng)
    hidden = rng.standard_normal((n_tokens, N_EMBD)).astype(np.float32) * 5
    rows = StoredActivations.parse(activation_bytes(hidden, head.activation), n_tokens, N_EMBD, head.activation, "t")
    blocks = np.frombuffer(head.data, np.uint8).reshape(N_VOCAB, -1, 2 + QK8_0)
    w_scale = blocks[:, :, :2].copy().view("<f2")[..., 0].astype(np.float64)
    w_q = blocks[:, :, 2:].copy().view(np.int8).astype(np.int64)
    want = np.zeros((n_tokens, N_VOCAB))
    for b in range(N_EMBD // QK8_0):
        int_dot = rows.values[:, b, :].astype(np.int64) @ w_q[:, b, :].T
        want += int_dot.astype(np.float64) * (rows.scales[:, b][:, None] * w_scale[:, b][None, :])
    np.testing.assert_array_equal(head.replay(rows), want)


def test_q8_0_activations_as_ggml_stores_them():
    """34 bytes per 32 values; zero blocks stay zero; round-half-even of x·127/amax."""
    x = np.zeros((2, 64), np.float32)
    x[0, :32] = np.linspace(-1, 1, 32)
    x[1, 32] = 127 * 2.5 / 127  # amax 2.5: q = 127 there
    stored = activation_bytes(x, OutputHead(tensor="o", ggml_type="Q8_0", n_vocab=1, n_embd=64, softcap=0.0, data=b"").activation)
    assert len(stored) == 2 * 68
    rows = StoredActivations.parse(stored, 2, 64, OutputHead(tensor="o", ggml_type="Q8_0", n_vocab=1, n_embd=64, softcap=0.0, data=b"").activation, "t")
    assert rows.values[0, 0, 0] == -127 and rows.values[0, 0, -1] == 127 and rows.scales[0, 1] == 0
    assert rows.values[1, 1, 0] == 127 and np.all(rows.values[1, 1, 1:] == 0)


# --------------------------------------------------------------------------------------------------
# stores in the hidden form
# --------------------------------------------------------------------------------------------------
class HiddenCapture:
    """A synthetic capture: hidden rows, the head, and the 'exact' float32 logits llama.cpp would give (the float64
    product with float32 noise, as its accumulation order moves them)."""

    def __init__(self, seed: int, n_chunks: int = 3, ggml_type: str = "Q8_0", noise: float = 2e-6,
                 n_ctx: int = N_CTX):
        rng = np.random.default_rng(seed)
        self.head = tiny_head(rng, ggml_type)
        self.tokens = make_tokens(rng, n_chunks, n_ctx, N_VOCAB)
        self.hidden, self.logits = {}, {}
        n = n_ctx // 2 - 1
        for c in range(n_chunks):
            h = rng.standard_normal((n, N_EMBD)).astype(np.float32) * 2
            exact = as_multiplied(h, self.head) @ dequantized(self.head).T
            self.hidden[c] = h
            self.logits[c] = (exact * (1 + noise * rng.standard_normal(exact.shape))).astype(np.float32)

    def write(self, path, form_name: str = "hidden", finish: bool = True, block: int = 5, ggml: bool = True,
              **header_fields):
        code = SqrtLogCode()
        ggml_head = GgmlHead.of(self.head) if ggml else None
        header = make_header(self.tokens, N_VOCAB, code, "HID", head=head_entry(self.head, form_name), **header_fields)
        chunks = {}
        with StoreWriter.open(path, header, self.tokens, code.lut(), head=self.head) as w:
            for c in range(len(self.tokens)):
                targets = self.tokens[c, header.positions_of(c) + 1]
                pieces = []
                for first in range(0, len(targets), PIECE_ROWS):  # a long window: pieces of PIECE_ROWS rows
                    builder = ChunkBuilder(c, first_row=first, hidden=True)
                    end = min(first + PIECE_ROWS, len(targets))
                    for s in range(first, end, block):
                        e = min(s + block, end)
                        builder.add_block(encode_hidden_block(self.logits[c][s:e], self.hidden[c][s:e], targets[s:e],
                                                              code, self.head, ggml_head, s))
                    pieces.append(builder.finish())
                    w.write_chunk(pieces[-1])
                chunks[c] = pieces[0] if len(pieces) == 1 else pieces
            if finish:
                w.finish()
        return header, chunks


@pytest.fixture
def hidden_store(tmp_path):
    cap = HiddenCapture(seed=4)
    path = tmp_path / "HID.qeval"
    header, chunks = cap.write(path)
    return cap, path, chunks


def test_a_hidden_store_reads_back_as_the_capture_coded_it(hidden_store):
    """Version 6, the head once, HIDN pieces; a reader's rows are the capture's replayed rows exactly, coded and
    uncoded, its scalars exact from the capture's float32 logits, both error records as measured."""
    cap, path, chunks = hidden_store
    data = path.read_bytes()
    tags = [t for t, _, _ in _records(data)]
    assert tags[:4] == [b"HEAD", b"TOKS", b"LUT_", b"OUTW"] and tags.count(b"HIDN") == 3 and b"CHNK" not in tags
    with StoreReader(path) as r:
        assert r.header.format_version == LEAN_VERSION and r.header.head["type"] == "Q8_0"
        for c in range(3):
            at_capture = encode_hidden_block(cap.logits[c], cap.hidden[c], cap.tokens[c, r.header.positions_of(c) + 1],
                                             SqrtLogCode(), cap.head, GgmlHead.of(cap.head))
            assert [u.engine for u in at_capture.uncoded] == list(REPLAY_ENGINES)
            piece = r.read_chunk(c)
            assert [p.engine for p in piece.replays] == list(REPLAY_ENGINES)
            rows = list(piece.iter_rows(N_VOCAB))  # ggml's rows: this machine's ggml is the capture's
            assert [k for k, _, _ in rows] == list(range(len(at_capture)))
            np.testing.assert_array_equal(np.stack([row for _, row, _ in rows]), at_capture.uncoded[0].rows)
            np.testing.assert_array_equal(np.concatenate([e.hi for _, _, e in rows]), piece.replays[0].record.hi)
            for at_write, read, made in zip(chunks[c].replays, piece.replays, at_capture.uncoded, strict=True):
                assert at_write.checksum == read.checksum == xxhash.xxh3_64_intdigest(made.rows.data)
                np.testing.assert_array_equal(read.record.kl, made.record.kl)
                assert read.record.lo.shape == (len(at_capture), 1)  # one band
        assert [f for _, _, f in r.piece_forms()] == ["hidden"] * 3
        for c in range(3):
            got = r.read_chunk(c)
            assert isinstance(got, HiddenChunk)
            targets = cap.tokens[c, r.header.positions_of(c) + 1]
            at_capture = encode_hidden_block(cap.logits[c], cap.hidden[c], targets, SqrtLogCode(), cap.head)
            np.testing.assert_array_equal(got.codes(N_VOCAB), at_capture.codes)
            x = cap.logits[c].astype(np.float64)
            lp = x - x.max(axis=1, keepdims=True)
            lp -= np.log(np.exp(lp).sum(axis=1, keepdims=True))
            targets = cap.tokens[c, r.header.positions_of(c) + 1]
            np.testing.assert_allclose(got.logprob_target, lp[np.arange(len(targets)), targets], atol=1e-12, rtol=0)
            np.testing.assert_array_equal(got.error.kl, chunks[c].error.kl)


def test_the_replayed_rows_are_the_codes_of_the_replay(hidden_store):
    """What a reader compares: the store's code of the float64 replay of the stored rows, rounded to float32."""
    cap, path, _ = hidden_store
    code = SqrtLogCode()
    with StoreReader(path) as r:
        for c in range(3):
            replay = (as_multiplied(cap.hidden[c], cap.head) @ dequantized(cap.head).T).astype(np.float32)
            want = code.encode_block(replay, np.zeros(len(replay), np.int64)).codes
            assert np.mean(r.read_chunk(c).codes(N_VOCAB) == want) > 0.999  # float64 sums to ~1e-16: a rare ulp


@pytest.mark.parametrize("sigma", [0.0, 0.3])
def test_the_bound_holds_against_float64_logits(hidden_store, tmp_path, sigma):
    """A hidden reference against a stored and a live candidate: every token's |ΔKLD| from the float64 KLD of the
    exact rows is within its bound, both directions; identical logits give a bound as small as the code's. Against
    the live candidate the reference is read uncoded (version 6; a version 5 copy is read coded only): for a copy
    its bound is the replay's alone, far below the coded one's."""
    cap, path, _ = hidden_store
    rng = np.random.default_rng(8)
    cand_logits = {c: perturb(rng, x, sigma) if sigma else x for c, x in cap.logits.items()}
    cand = write_store(tmp_path / "CAND.qeval", cap.tokens, cand_logits, N_VOCAB, label="CAND")
    cap.write(tmp_path / "V5.qeval", format_version=5)
    bounds = {}
    with StoreReader(path) as ref, StoreReader(cand.path) as cr, StoreReader(tmp_path / "V5.qeval") as v5:
        assert v5.header.format_version == 5
        for name, r, source in (("stored", ref, cr), ("live", ref, RowsSource(ref, cand_logits)),
                                ("live v5", v5, RowsSource(v5, cand_logits))):
            cmp = metrics.compare(r, source, threads=2)
            _, bounds[name], _, _ = assert_bound_holds(cmp, cap.logits, cand_logits)
            if not sigma:
                assert np.max(bounds[name]) < 1e-5
    if not sigma:  # a copy: the code's share, most of the coded bound, is gone (a far candidate's bound is mostly
        # the reference's error against the rows' difference: one band of the replay's error, not the code's bands)
        assert np.mean(bounds["live"]) < np.mean(bounds["live v5"]) / 5


def _uncoded_entries_at(n: int) -> int:
    """Where a HIDN payload's first uncoded replay entry starts (n rows, top_k 10)."""
    return 16 + 16 * n + 40 * n + 8 + 8


def _set_uncoded_checksum(path, entry: int) -> None:
    """Replace (checksum made right) the rows' checksum of the `entry`-th uncoded replay of every HIDN record."""
    n = N_CTX // 2 - 1

    def other(payload: bytearray) -> bytearray:
        at = _uncoded_entries_at(n) + entry * (16 + 16 + 24 * n) + 8
        payload[at:at + 8] = struct.pack("<Q", 12345)
        return payload

    _rewrite_payload(path, b"HIDN", other)


def test_a_long_window_in_pieces_is_read_uncoded_piece_by_piece(tmp_path):
    """A window of 299 scored rows in two HIDN pieces (256 + 43): read uncoded as one chunk, its rows those of the
    whole window replayed at once (each row at its row of the chunk), each with its own piece's record; the bound
    holds against a live candidate."""
    cap = HiddenCapture(seed=12, n_chunks=1, n_ctx=600)
    _, chunks = cap.write(tmp_path / "L.qeval", block=16)
    assert [p.n_tokens for p in chunks[0]] == [256, 43]
    rng = np.random.default_rng(13)
    cand_logits = {0: perturb(rng, cap.logits[0], 0.2)}
    with StoreReader(tmp_path / "L.qeval") as r:
        rows = list(r.read_chunk(0).iter_rows(N_VOCAB))
        whole = encode_hidden_block(cap.logits[0], cap.hidden[0], cap.tokens[0, r.header.positions_of(0) + 1],
                                    SqrtLogCode(), cap.head, GgmlHead.of(cap.head)).uncoded[0]
        assert whole.engine == "ggml" and [k for k, _, _ in rows] == list(range(299))
        np.testing.assert_array_equal(np.stack([row for _, row, _ in rows]), whole.rows)
        np.testing.assert_array_equal(np.concatenate([e.kl for _, _, e in rows]), whole.record.kl)
        assert_bound_holds(metrics.compare(r, RowsSource(r, cand_logits), threads=2), cap.logits, cand_logits)


def test_where_ggml_sums_otherwise_the_portable_replay_is_read(hidden_store):
    """A machine whose ggml gives other rows than the capture's (here: the capture's checksum of them changed):
    the uncoded read takes the portable replay's rows and record instead, and does not try ggml again."""
    cap, path, chunks = hidden_store
    _set_uncoded_checksum(path, 0)
    with StoreReader(path) as r:
        for c in range(3):
            rows = list(r.read_chunk(c).iter_rows(N_VOCAB))
            portable = encode_hidden_block(cap.logits[c], cap.hidden[c], cap.tokens[c, r.header.positions_of(c) + 1],
                                           SqrtLogCode(), cap.head).uncoded[0]
            assert portable.engine == "portable"
            np.testing.assert_array_equal(np.stack([row for _, row, _ in rows]), portable.rows)
            np.testing.assert_array_equal(np.concatenate([e.kl for _, _, e in rows]), portable.record.kl)
        assert r.replay_matches == {"ggml": False, "portable": True}


def test_auto_keeps_hidden_only_where_the_replay_is_within_its_target(tmp_path):
    """PieceBuilder: a piece keeps the hidden form when its worst token's replay KL is within AUTO_REPLAY_KL, and
    then never codes its logits (it has no code to do so here); a piece with one block that misses is the logits
    code of every one of its rows, the blocks before the miss included, exactly as the logits form codes them."""
    from qeval.capture.capture import PieceBuilder, StoredForm

    code = SqrtLogCode()
    cap = HiddenCapture(seed=2, n_chunks=1, noise=1e-7)
    form_ = StoredForm("auto", cap.head, "auto")
    n_rows = len(cap.logits[0])
    targets = cap.tokens[0, 1:n_rows + 1]
    missed = cap.logits[0].copy()
    missed[4:8] *= 1 + 3e-2 * np.random.default_rng(3).standard_normal(missed[4:8].shape).astype(np.float32)
    for logits, kept in ((cap.logits[0], HiddenChunk), (missed, None)):
        builder = PieceBuilder(0, None, 0, code=None if kept else code)
        for start in range(0, n_rows, 4):  # the second block misses
            builder.add(form_.encode(logits[start:start + 4], cap.hidden[0][start:start + 4],
                                     targets[start:start + 4], code, start))
        piece = builder.finish()
        if kept:
            assert isinstance(piece, kept) and builder.worst_replay_kl <= AUTO_REPLAY_KL
            continue
        assert not isinstance(piece, HiddenChunk) and builder.worst_replay_kl > AUTO_REPLAY_KL
        np.testing.assert_array_equal(piece.codes(N_VOCAB), code.encode_block(logits, targets).codes)


# --------------------------------------------------------------------------------------------------
# a reader that trusts nothing
# --------------------------------------------------------------------------------------------------
def _read_all(path) -> None:
    with StoreReader(path) as r:
        for c in r.chunk_indices:
            r.read_chunk(c).codes(N_VOCAB)
            list(r.read_chunk(c).iter_rows(N_VOCAB))


@pytest.mark.parametrize("seed", range(16))
def test_random_corruption_of_a_hidden_store_is_refused_cleanly(hidden_store, tmp_path, seed):
    """A byte flipped anywhere (head, hidden rows, their checksum, the error records ...): StoreFormatError when the
    store or a chunk is read, or identical data; never another exception, never a wrong number."""
    cap, path, chunks = hidden_store
    with StoreReader(path) as r:
        want = {c: r.read_chunk(c).codes(N_VOCAB) for c in range(3)}
        want_rows = {c: [row for _, row, _ in r.read_chunk(c).iter_rows(N_VOCAB)] for c in range(3)}
    rng = np.random.default_rng(seed)
    data = bytearray(path.read_bytes())
    # half the flips in the head record (most of the file), half elsewhere
    outw = next((off, n) for t, off, n in _records(bytes(data)) if t == b"OUTW")
    at = int(rng.integers(outw[0], outw[0] + 16 + outw[1])) if seed % 2 else int(rng.integers(0, len(data)))
    data[at] ^= 1 << int(rng.integers(0, 8))
    bad = tmp_path / "bad.qeval"
    bad.write_bytes(bytes(data))
    try:
        with StoreReader(bad) as r:
            for c in r.chunk_indices:
                got = r.read_chunk(c)
                np.testing.assert_array_equal(got.codes(N_VOCAB), want[c])
                np.testing.assert_array_equal(got.error.kl, chunks[c].error.kl)
                for (_, row, record), want_row in zip(r.read_chunk(c).iter_rows(N_VOCAB), want_rows[c], strict=True):
                    np.testing.assert_array_equal(row, want_row)
                np.testing.assert_array_equal(r.read_chunk(c).replay_error.lo, chunks[c].replay_error.lo)
    except StoreFormatError:
        pass


@pytest.mark.parametrize("fraction", [0.01, 0.3, 0.6, 0.97, 0.9999])
def test_a_truncated_hidden_store_is_incomplete_or_refused(hidden_store, tmp_path, fraction):
    _, path, _ = hidden_store
    data = path.read_bytes()
    cut = tmp_path / "cut.qeval"
    cut.write_bytes(data[:int(len(data) * fraction)])
    with pytest.raises(StoreFormatError):
        _read_all(cut)


def test_a_head_that_is_not_the_headers_is_refused(hidden_store):
    """The head's bytes replaced (checksum made right): its fingerprint is not the header's."""
    _, path, _ = hidden_store

    def other_weights(payload: bytearray) -> bytearray:
        payload[-5] ^= 0x10
        return payload

    _rewrite_payload(path, b"OUTW", other_weights)
    with pytest.raises(StoreFormatError, match="does not match the header's description and fingerprint"):
        _read_all(path)


def test_rows_replayed_otherwise_than_at_capture_are_refused(hidden_store):
    """The capture's checksum of its replayed rows no longer matches (a machine that codes a row differently)."""
    _, path, _ = hidden_store
    n_scored = N_CTX // 2 - 1

    def other_checksum(payload: bytearray) -> bytearray:
        at = 16 + 16 * n_scored + 40 * n_scored
        payload[at:at + 8] = struct.pack("<Q", 12345)
        return payload

    _rewrite_payload(path, b"HIDN", other_checksum)
    with StoreReader(path) as r, pytest.raises(StoreFormatError, match="replayed on this machine differ"):
        r.read_chunk(0).codes(N_VOCAB)


def test_a_capture_without_ggml_records_the_portable_replay_alone(tmp_path):
    """Where no ggml library is at hand, the capture records only the portable replay, and a reader reads it."""
    cap = HiddenCapture(seed=6, n_chunks=1)
    cap.write(tmp_path / "P.qeval", ggml=False)
    with StoreReader(tmp_path / "P.qeval") as r:
        piece = r.read_chunk(0)
        assert [p.engine for p in piece.replays] == ["portable"]
        rows = np.stack([row for _, row, _ in piece.iter_rows(N_VOCAB)])
        assert r.replay_matches == {"portable": True}
    want = encode_hidden_block(cap.logits[0], cap.hidden[0], cap.tokens[0, r.header.positions_of(0) + 1],
                               SqrtLogCode(), cap.head).uncoded[0].rows
    np.testing.assert_array_equal(rows, want)


@pytest.mark.parametrize("field, value, message", [("count", 0, "names 0 uncoded replays"),
                                                   ("count", 3, "names 3 uncoded replays"),
                                                   ("engine", 7, "unknown or repeated replay engine"),
                                                   ("engine", 2, "unknown or repeated replay engine")])
def test_malformed_uncoded_replays_are_refused(hidden_store, field, value, message):
    """A HIDN record (checksum made right) naming no replay, too many, an unknown engine or one twice (the first
    entry renamed to the second's engine)."""
    _, path, _ = hidden_store
    at = _uncoded_entries_at(N_CTX // 2 - 1) - (8 if field == "count" else 0)

    def changed(payload: bytearray) -> bytearray:
        payload[at:at + 4] = struct.pack("<I", value)
        return payload

    _rewrite_payload(path, b"HIDN", changed)
    with StoreReader(path) as r, pytest.raises(StoreFormatError, match=message):
        r.read_chunk(0)


def test_rows_read_uncoded_otherwise_than_at_capture_are_refused(hidden_store):
    """No engine's float32 rows hash as the capture's (version 6): the uncoded read (a live comparison's) is refused;
    the coded read, whose checksum still holds, is not."""
    _, path, _ = hidden_store
    _set_uncoded_checksum(path, 0)
    _set_uncoded_checksum(path, 1)
    with StoreReader(path) as r:
        r.read_chunk(0).codes(N_VOCAB)
        with pytest.raises(StoreFormatError, match="replayed on this machine differ"):
            list(r.read_chunk(0).iter_rows(N_VOCAB))


def test_version_5_header_rules(hidden_store):
    """`head` exactly in version 5; a form, head type or activation it does not know: one message."""
    _, path, _ = hidden_store
    with StoreReader(path) as r:
        h = r.header.to_json()
    StoreHeader.from_json(h, "x")
    for bad, message in (({**h, "head": {}}, "without an output head"),
                         ({**h, "format_version": 4}, "with an output head"),
                         ({**h, "head": {**h["head"], "form": "sparse"}}, "does not know"),
                         ({**h, "head": {**h["head"], "type": "Q4_K"}}, "does not know"),
                         ({**h, "head": {**h["head"], "type": ["Q8_0"]}}, "does not know"),
                         ({**h, "head": {**h["head"], "n_vocab": 5}}, "does not know"),
                         ({**h, "head": "yes"}, "must be an object")):
        with pytest.raises(StoreFormatError, match=message):
            StoreHeader.from_json(bad, "x")


def test_a_header_naming_an_unknown_form_is_refused_by_the_reader(hidden_store):
    _, path, _ = hidden_store

    def renamed(payload: bytearray) -> bytearray:
        text = bytes(payload).replace(b'"form": "hidden"', b'"form": "hiddex"')
        assert text != bytes(payload)
        return bytearray(text)

    _rewrite_payload(path, b"HEAD", renamed)
    with pytest.raises(StoreFormatError, match="does not know"):
        StoreReader(path)


def test_a_writer_embeds_the_head_its_header_names(tmp_path):
    cap = HiddenCapture(seed=6, n_chunks=1)
    code = SqrtLogCode()
    header = make_header(cap.tokens, N_VOCAB, code, head=head_entry(cap.head, "hidden"))
    other = tiny_head(np.random.default_rng(99))
    for head in (None, other):
        with pytest.raises(ValueError, match="embeds the output head"):
            StoreWriter.open(tmp_path / "x.qeval", header, cap.tokens, code.lut(), head=head)


# --------------------------------------------------------------------------------------------------
# identity, info, an interrupted capture
# --------------------------------------------------------------------------------------------------
def test_the_form_is_part_of_a_stores_identity(hidden_store, tmp_path):
    """The same capture in the logits form and in the hidden form (or auto) are different producers: a store of one
    is never resumed, reused or grown as the other."""
    cap, path, _ = hidden_store
    logits = write_store(tmp_path / "L.qeval", cap.tokens, cap.logits, N_VOCAB, label="HID")
    with StoreReader(path) as h, StoreReader(logits.path) as lr:
        assert form(h.header) != form(lr.header)
        assert form(h.header)["head"] == {"form": "hidden", "fingerprint": cap.head.fingerprint, "read_uncoded": True}
        assert any("codec" in c or "form" in c for c in capture_conflicts(lr.header, lr.tokens, True, h.header,
                                                                          h.tokens))
    auto = make_header(cap.tokens, N_VOCAB, SqrtLogCode(), "HID", head=head_entry(cap.head, "auto"))
    assert form(auto) != form(StoreReader(path).header)
    # a format-5 copy (read coded only) is another form: its results are never reused for the format-6 store
    older = make_header(cap.tokens, N_VOCAB, SqrtLogCode(), "HID", head=head_entry(cap.head, "hidden"),
                        format_version=5)
    assert older.format_version == 5 and form(older) != form(StoreReader(path).header)


def test_auto_takes_a_complete_store_of_its_capture_in_any_form(hidden_store, tmp_path):
    """The default form (auto) takes as it is a complete store of the same capture made in the logits or the hidden
    form (a reference captured before auto was the default is not captured again); hidden asked for by name does
    not take a logits store, and auto takes no store of another capture, nor an interrupted one of another form."""
    from qeval.storage.store import StoreComplete, StoreConflict

    cap, path, _ = hidden_store
    logits = write_store(tmp_path / "L.qeval", cap.tokens, cap.logits, N_VOCAB, label="HID")
    lut = SqrtLogCode().lut()
    auto = make_header(cap.tokens, N_VOCAB, SqrtLogCode(), "HID", head=head_entry(cap.head, "auto"))
    for stored, name in ((logits.path, "logits"), (path, "hidden")):
        with pytest.raises(StoreComplete) as done:
            StoreWriter.open(stored, auto, cap.tokens, lut, head=cap.head)
        assert done.value.stored_form == name
    hidden = make_header(cap.tokens, N_VOCAB, SqrtLogCode(), "HID", head=head_entry(cap.head, "hidden"))
    with pytest.raises(StoreConflict):
        StoreWriter.open(logits.path, hidden, cap.tokens, lut, head=cap.head)
    other = make_header(cap.tokens, N_VOCAB, SqrtLogCode(), "OTHER", head=head_entry(cap.head, "auto"))
    with pytest.raises(StoreConflict):
        StoreWriter.open(logits.path, other, cap.tokens, lut, head=cap.head)
    partial = write_store(tmp_path / "P.qeval", cap.tokens, cap.logits, N_VOCAB, label="HID", finish=False)
    with pytest.raises(StoreConflict):
        StoreWriter.open(partial.path, auto, cap.tokens, lut, head=cap.head)


def test_info_reads_pieces_of_any_size(tmp_path):
    """A later piece larger than the first (its hidden rows compress less): info reads every replay record."""
    cap = HiddenCapture(seed=5, n_chunks=2)
    cap.hidden[0][:, 8:] = 0  # mostly zeros: a small frame
    cap.logits[0] = (as_multiplied(cap.hidden[0], cap.head) @ dequantized(cap.head).T).astype(np.float32)
    cap.write(tmp_path / "S.qeval")
    d, _ = api.info_report(str(tmp_path / "S.qeval"))
    assert all(e["tokens"] == d["scored_tokens"] for e in d["replay"].values())


def test_info_says_a_format_5_store_is_read_coded_only(tmp_path):
    cap = HiddenCapture(seed=3, n_chunks=1)
    cap.write(tmp_path / "V5.qeval", format_version=5)
    d, text = api.info_report(str(tmp_path / "V5.qeval"))
    assert d["header"]["format_version"] == 5 and not d["replay"]
    assert "read coded only (format 5" in text


def test_an_interrupted_hidden_capture_resumes(tmp_path):
    cap = HiddenCapture(seed=7)
    path = tmp_path / "R.qeval"
    cap.write(path, finish=False)
    with StoreReader(path, tolerate_torn_tail=True) as r:
        assert not r.complete and r.chunk_indices == [0, 1, 2]
    header = StoreReader(path, tolerate_torn_tail=True).header
    with StoreWriter.open(path, header, cap.tokens, SqrtLogCode().lut(), head=cap.head) as w:
        assert w.done_chunks == {0, 1, 2}
        w.finish()
    _read_all(path)


def test_info_shows_the_form_of_every_piece_and_the_head(hidden_store):
    _, path, _ = hidden_store
    d, text = api.info_report(str(path))
    assert d["pieces_by_form"] == {"hidden": 3} and d["head"]["type"] == "Q8_0"
    assert d["error"]["recorded"] and d["error"]["kl_max"] < 1e-5
    assert "hidden" in text and "head" in text
    assert list(d["replay"]) == list(REPLAY_ENGINES)
    assert all(e["tokens"] == d["scored_tokens"] for e in d["replay"].values())
    assert d["replay"]["portable"]["max_abs_dlogp"] < d["error"]["max_abs_dlogp"]  # the replay alone: no code's rounding
    assert "read uncoded against a live candidate" in text and "ggml (" in text
    assert json.dumps(d)
    # a small store with its code table and head is larger than llama.cpp's file: said so, never "0.1x larger"
    assert d["ratio_vs_llamacpp"] < 1
    vs_llamacpp = next(line for line in text.splitlines() if line.startswith("vs llama.cpp:"))
    assert f"{1 / d['ratio_vs_llamacpp']:.1f}x smaller: this store is the larger" in vs_llamacpp
    assert "x larger" not in vs_llamacpp


# --------------------------------------------------------------------------------------------------
# real captures (slow)
# --------------------------------------------------------------------------------------------------
def captured_pair(model, runs, chunks: int, n_ctx: int = 512, cand_model=None):
    """The same capture in the hidden and the logits form, llama.cpp's exact rows of its windows, and a
    candidate's (`cand_model`, else the model's own)."""
    from test_error_bound import exact_rows  # noqa: PLC0415

    api.capture_store(str(model), "HID", runs_dir=runs, chunks=chunks, n_ctx=n_ctx, reference_form="hidden")
    api.capture_store(str(model), "LOG", runs_dir=runs, chunks=chunks, n_ctx=n_ctx, reference_form="logits")
    with StoreReader(runs / "LOG.qeval") as lr:
        exact = exact_rows(model, lr.tokens)
        cand = exact_rows(cand_model, lr.tokens) if cand_model is not None else exact
    return exact, cand


def assert_hidden_reference_holds(runs, exact: dict, cand: dict, code_equal: float) -> dict:
    """The hidden store against the logits one and against live candidate rows: every piece hidden, its replayed
    rows the logits store's codes (all but a `code_equal` fraction), its record within the code's error, scalars
    exact, the bound holding token by token against float64 KLDs of llama.cpp's rows."""
    with StoreReader(runs / "HID.qeval") as h, StoreReader(runs / "LOG.qeval") as lr:
        assert {f for _, _, f in h.piece_forms()} == {"hidden"}
        for c in h.chunk_indices:
            same = np.mean(h.read_chunk(c).codes(h.header.n_vocab) == lr.read_chunk(c).codes(h.header.n_vocab))
            assert same >= code_equal
            np.testing.assert_array_equal(h.read_chunk(c).logprob_target, lr.read_chunk(c).logprob_target)
        kl = np.concatenate([e.kl for _, e in h.iter_errors()])
        kl_logits = np.concatenate([e.kl for _, e in lr.iter_errors()])
        assert kl.max() < 2e-6 and abs(kl.mean() / kl_logits.mean() - 1) < 0.05
        for source in (lr, RowsSource(h, cand)):
            cmp = metrics.compare(h, source, threads=2)
            assert_bound_holds(cmp, exact, cand if source is not lr else exact)
            # against the stored candidate too, the reference's rows were read uncoded (metrics.row_plane_sums)
            assert True in h.replay_matches.values()
        # the live rows read the replay uncoded: ggml's where it hashed as the capture's, else the portable one's;
        # either way the reference's share of the bound is the replay's, far below the code's
        assert True in h.replay_matches.values()
        coded = metrics.compare(lr, RowsSource(lr, cand), threads=2).per_token["kld_bound"]
        assert np.mean(cmp.per_token["kld_bound"]) < np.mean(coded) / 10
        return {"hidden_bytes": (runs / "HID.qeval").stat().st_size, "head_bytes": h.header.head["bytes"],
                "replay_matches": h.replay_matches}


def test_gemma_q8_0_in_the_hidden_form(models, tmp_path):
    """Gemma-3-270M Q8_0, one window of 512: the hidden capture replays llama.cpp's logits to the code's own rows
    (the codes equal the logits store's but for rare float32 ulps), its bound holds token by token against float64
    (a live Q4_0 candidate and the logits store), and it costs under 2.5 KB per scored token beyond the head."""
    runs = tmp_path / "runs"
    exact, cand = captured_pair(models["Q8_0"], runs, chunks=1, cand_model=models["Q4_0"])
    sizes = assert_hidden_reference_holds(runs, exact, cand, code_equal=0.9999)
    assert (sizes["hidden_bytes"] - sizes["head_bytes"]) / 255 < 2500


# (route, -b, decode-ahead): one window per call (-b 128 < n_ctx 512) reads the head's input in llama.cpp's graph;
# two windows per call (-b 1024) interleave in ubatches, so their rows come from an embeddings context; decode-ahead
# copies hidden rows with the logits before the next decode overwrites both
ROUTES = [("graph", 128, False), ("embeddings", 1024, False), ("graph", 128, True)]


@pytest.mark.parametrize("scoring", ["half", "every:64"])
@pytest.mark.parametrize(("route", "n_batch", "ahead"), ROUTES)
def test_an_engine_asked_for_hidden_rows_returns_the_scored_rows_it_returns_without(models, scoring, route, n_batch,
                                                                                    ahead):
    """The engine's hidden rows come with the scored rows it returns without them, in the same order, and each is
    the input of its own logits row (replayed through the head, ~1e-6 nats away). Read in the graph, the logits
    are those of an engine without hidden rows bit for bit (the head multiplies the same rows); from an embeddings
    context, where llama.cpp outputs every token of a call, within 1e-3."""
    from qeval.engine.engine import Engine, EngineSettings  # noqa: PLC0415
    from qeval.storage.scoring import Scoring  # noqa: PLC0415

    windows = np.random.default_rng(5).integers(100, 20_000, size=(3, 512)).astype(np.int32)
    settings = EngineSettings(n_batch=n_batch, decode_ahead=ahead)
    plain, hidden = (Engine(str(models["Q8_0"]), 512, settings, scoring=Scoring.parse(scoring)) for _ in range(2))
    hidden.output_hidden()
    assert (plain.hidden_source, hidden.hidden_source) == (None, route)
    head = read_head(models["Q8_0"])
    with plain, hidden:
        for want, got in zip(plain.iter_calls(windows), hidden.iter_calls(windows), strict=True):
            for w, g in zip(want, got, strict=True):
                assert (w.window, w.first_row, list(w.positions)) == (g.window, g.first_row, list(g.positions))
                if route == "graph":
                    np.testing.assert_array_equal(g.logits, w.logits)
                else:  # equal bit for bit on an AMD EPYC Zen 4; room for another CPU's kernel at another row count
                    np.testing.assert_allclose(g.logits, w.logits, rtol=0, atol=1e-3)
                    top2 = np.partition(w.logits, -2, axis=1)[:, -2:]
                    clear = top2[:, 1] - top2[:, 0] > 2e-3  # a top-1 that a 1e-3 move cannot flip
                    assert np.array_equal(g.logits.argmax(axis=1)[clear], w.logits.argmax(axis=1)[clear])
                picked = np.unique(np.linspace(0, len(g.hidden) - 1, 8).astype(int))  # first, last and between
                rows = StoredActivations.parse(activation_bytes(g.hidden[picked], head.activation), len(picked),
                                               head.n_embd, head.activation, "rows")
                np.testing.assert_allclose(head.replay(rows), g.logits[picked], rtol=0, atol=1e-3)


def test_a_tap_that_read_other_rows_than_the_decode_output_is_refused():
    """A graph that named no result_norm, or another count of rows than the call's outputs, is an error that says
    so, never rows guessed."""
    from qeval.engine.hidden_tap import HiddenTap  # noqa: PLC0415
    from qeval.errors import QevalError  # noqa: PLC0415
    from qeval.storage.ggml_replay import _InitParams  # noqa: PLC0415

    base = ctypes.CDLL(str(llama_libraries.library_path("ggml-base")))
    for name, restype, argtypes in (("ggml_init", ctypes.c_void_p, [_InitParams]), ("ggml_free", None, [ctypes.c_void_p]),
                                    ("ggml_new_tensor_2d", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int,
                                                                             ctypes.c_int64, ctypes.c_int64]),
                                    ("ggml_backend_cpu_buffer_type", ctypes.c_void_p, []),
                                    ("ggml_backend_alloc_ctx_tensors_from_buft", ctypes.c_void_p,
                                     [ctypes.c_void_p, ctypes.c_void_p]),
                                    ("ggml_backend_buffer_free", None, [ctypes.c_void_p]),
                                    ("ggml_backend_tensor_set", None, [ctypes.c_void_p, ctypes.c_void_p,
                                                                       ctypes.c_size_t, ctypes.c_size_t])):
        getattr(base, name).restype, getattr(base, name).argtypes = restype, argtypes
    # float32 tensors in a backend buffer, as a graph's are (ggml_backend_tensor_get reads only those)
    shapes = {"two": (4, 2), "one": (4, 1), "wide": (5, 2), "many": (4, 9)}
    ctx = base.ggml_init(_InitParams(1 << 16, None, True))
    tensors = {name: base.ggml_new_tensor_2d(ctx, 0, *shape) for name, shape in shapes.items()}
    buffer = base.ggml_backend_alloc_ctx_tensors_from_buft(ctx, base.ggml_backend_cpu_buffer_type())
    try:
        for name, (n_embd, rows) in shapes.items():
            values = np.arange(n_embd * rows, dtype=np.float32)
            base.ggml_backend_tensor_set(tensors[name], values.ctypes.data, 0, values.nbytes)

        def tensor(n_embd: int, rows: int) -> int:
            return tensors[next(name for name, shape in shapes.items() if shape == (n_embd, rows))]

        tap = HiddenTap(n_embd=4, max_rows=8)
        tap.start()
        with pytest.raises(QevalError, match="0 result_norm rows for 3 outputs"):
            tap.rows(3)
        for rows in (2, 1):  # two tensors of one call (its ubatches), in order
            assert tap.callback(tensor(4, rows), False, None)
        np.testing.assert_array_equal(tap.rows(3), np.concatenate([np.arange(8).reshape(2, 4), np.arange(4)[None]]))
        tap.start()
        assert tap.callback(tensor(5, 2), False, None)  # rows of another width: kept as an error, never raised into C
        with pytest.raises(QevalError, match="10 elements in 40 bytes is not float32 rows of 4"):
            tap.rows(2)
        tap.start()
        assert tap.callback(tensor(4, 9), False, None)
        with pytest.raises(QevalError, match="more than 8 result_norm rows"):
            tap.rows(9)
    finally:
        base.ggml_backend_buffer_free(buffer)
        base.ggml_free(ctx)


def test_an_f16_head_in_the_hidden_form(gemma_tokenizer, tmp_path):
    """A tiny random model whose head is F16 (its activations fp16): the same, with fp16 rows."""
    import tinymodels  # noqa: PLC0415

    model = tinymodels.build_mamba(tmp_path / "mamba.gguf", gemma_tokenizer)
    runs = tmp_path / "runs"
    exact, cand = captured_pair(model, runs, chunks=2, n_ctx=64)
    with StoreReader(runs / "HID.qeval") as h:
        assert h.header.head["type"] == "F16" and h.header.head["activation"] == "f16"
    assert_hidden_reference_holds(runs, exact, cand, code_equal=0.999)


def head_only_gguf(path, ggml_type, arch: str = "gemma3", **keys):
    """A GGUF of one output head tensor (and `<arch>.KEY` values): enough for read_head."""
    import gguf  # noqa: PLC0415

    writer = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        writer.add_float32(f"{arch}.{key}", value)
    w = np.random.default_rng(0).standard_normal((N_VOCAB, N_EMBD)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[ggml_type]
    data = w if ggml_type == "F32" else gguf.quants.quantize(w, qtype)
    writer.add_tensor("output.weight", data, raw_dtype=None if ggml_type == "F32" else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_head_read_from_a_gguf_and_what_cannot_be_replayed(tmp_path):
    """output.weight with its soft-cap; a k-quant head or another post-head op: --reference-form hidden is refused
    with one message, auto stores the logits form and says why."""
    from qeval.capture.capture import stored_form  # noqa: PLC0415
    from qeval.engine.engine import EngineSettings  # noqa: PLC0415
    from qeval.errors import QevalError  # noqa: PLC0415
    from qeval.storage.hidden_form import read_head  # noqa: PLC0415

    head = read_head(head_only_gguf(tmp_path / "q8.gguf", "Q8_0", final_logit_softcapping=30.0))
    assert (head.tensor, head.ggml_type, head.n_vocab, head.n_embd, head.softcap) == ("output.weight", "Q8_0",
                                                                                       N_VOCAB, N_EMBD, 30.0)
    assert len(head.data) == N_VOCAB * N_EMBD * 34 // 32
    for name, path, why in (("q4_0", head_only_gguf(tmp_path / "k.gguf", "Q4_0"), "head is Q4_0"),
                            ("scaled", head_only_gguf(tmp_path / "s.gguf", "F16", logit_scale=0.5), "op after")):
        with pytest.raises(QevalError, match=why):
            stored_form("hidden", str(path), EngineSettings())
        auto = stored_form("auto", str(path), EngineSettings())
        assert auto.head is None and why in auto.facts()["reference_form"]["why_logits"]
    with pytest.raises(QevalError, match="--reference-form must be one of"):
        stored_form("sparse", str(tmp_path / "q8.gguf"), EngineSettings())


def test_layers_offloaded_are_measured_not_refused_and_another_backend_is_refused(tmp_path, monkeypatch):
    """A GPU run's replay is certified or not by its record (auto keeps a piece hidden only where it holds), so
    -ngl asks for the hidden form as a CPU run does; a backend with no llama.cpp output layer is still refused."""
    from qeval.capture.capture import AUTO, stored_form  # noqa: PLC0415
    from qeval.engine.engine import EngineSettings  # noqa: PLC0415
    from qeval.errors import QevalError  # noqa: PLC0415

    path = head_only_gguf(tmp_path / "q8.gguf", "Q8_0")
    monkeypatch.setattr(EngineSettings, "offloaded", property(lambda self: self.n_gpu_layers != 0))
    offloaded = EngineSettings(n_gpu_layers=99)
    assert offloaded.offloaded
    for asked in ("hidden", AUTO):
        form = stored_form(asked, str(path), offloaded)
        assert form.name == asked and form.head is not None and form.ggml is not None
    other = EngineSettings(backend="other")
    with pytest.raises(QevalError, match="another backend"):
        stored_form("hidden", str(path), other)
    assert "another backend" in stored_form(AUTO, str(path), other).facts()["reference_form"]["why_logits"]


def test_shards_of_a_hidden_capture_merge_into_one_store(tmp_path):
    """Merging copies the head once and every HIDN piece verbatim: the merged store reads as the shards did."""
    from qeval.orchestrate.merge import merge_stores  # noqa: PLC0415

    cap = HiddenCapture(seed=11, n_chunks=3)
    whole, _ = cap.write(tmp_path / "whole.qeval")
    code = SqrtLogCode()
    parts = []
    for rng in ((0, 2), (2, 3)):
        header = make_header(cap.tokens, N_VOCAB, code, "HID", chunk_range=rng, head=head_entry(cap.head, "hidden"))
        path = tmp_path / f"part{rng[0]}.qeval"
        with StoreReader(tmp_path / "whole.qeval") as r, StoreWriter.open(path, header, cap.tokens, code.lut(),
                                                                          head=cap.head) as w:
            for c in range(*rng):
                for piece in r.iter_pieces(c):
                    w.write_chunk(piece)
            w.finish()
        parts.append(path)
    merge_stores(parts, tmp_path / "merged.qeval")
    with StoreReader(tmp_path / "merged.qeval") as m, StoreReader(tmp_path / "whole.qeval") as r:
        assert m.header.head == r.header.head
        for c in range(3):
            np.testing.assert_array_equal(m.read_chunk(c).codes(N_VOCAB), r.read_chunk(c).codes(N_VOCAB))
            for (_, got, _), (_, want, _) in zip(m.read_chunk(c).iter_rows(N_VOCAB), r.read_chunk(c).iter_rows(N_VOCAB),
                                                 strict=True):
                np.testing.assert_array_equal(got, want)
