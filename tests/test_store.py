"""Store round trip, completeness, resume, torn tails and out-of-order chunks."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import xxhash
from conftest import (
    build_chunk,
    decoded_logprobs,
    kld64,
    log_softmax64,
    make_header,
    make_tokens,
    realistic_logits,
    stable_topk,
    synth_logits,
    write_store,
)

from qeval import api
from qeval.errors import QevalError, StoreFormatError
from qeval.storage.codec import SqrtLogCode
from qeval.storage.scoring import half_span
from qeval.storage.store import (
    MAGIC,
    PIECE_ROWS,
    TRAILER_MAGIC,
    ChunkBuilder,
    ChunkData,
    StoreComplete,
    StoreConflict,
    StoreHeader,
    StoreReader,
    StoreWriter,
    replacement_path,
    tokens_sha256,
)

N_VOCAB, N_CTX, N_CHUNKS = 1200, 16, 4


@pytest.fixture
def inputs():
    rng = np.random.default_rng(21)
    tokens = make_tokens(rng, N_CHUNKS, N_CTX, N_VOCAB)
    return tokens, synth_logits(rng, tokens, N_VOCAB)


def assert_chunk_matches(reader: StoreReader, store, c: int) -> None:
    """The chunk read back equals what was written, and what was written equals the float64 truth."""
    got = reader.read_chunk(c)
    want = store.chunks[c]
    assert got.index == c
    np.testing.assert_array_equal(got.logprob_target, want.logprob_target)
    np.testing.assert_array_equal(got.logprob_max, want.logprob_max)
    np.testing.assert_array_equal(got.top_ids, want.top_ids)
    np.testing.assert_array_equal(got.codes(N_VOCAB), want.codes(N_VOCAB))
    # independent truth from the logits that were encoded
    logits, targets = store.logits[c], store.targets(c)
    ls = log_softmax64(logits)
    rows = np.arange(len(targets))
    np.testing.assert_allclose(got.logprob_target, ls[rows, targets], atol=1e-6, rtol=0)
    np.testing.assert_allclose(got.logprob_max, ls.max(axis=1), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(got.top_ids, stable_topk(logits, 10))
    assert kld64(ls, decoded_logprobs(got.codes(N_VOCAB), reader.lut)).max() < 1e-6


def test_round_trip(tmp_path, inputs):
    tokens, logits = inputs
    store = write_store(tmp_path / "a.qeval", tokens, logits, N_VOCAB, label="Q8_0",
                        model={"file_name": "m.gguf"}, kv={"type_k": "f16", "type_v": "f16"})
    with StoreReader(store.path) as r:
        assert r.complete
        assert r.chunk_indices == list(range(N_CHUNKS))
        h = r.header
        assert (h.n_vocab, h.n_ctx, h.n_chunks, h.chunk_start, h.chunk_stop) == (N_VOCAB, N_CTX, N_CHUNKS, 0,
                                                                                  N_CHUNKS)
        assert h.label == "Q8_0" and h.model == {"file_name": "m.gguf"} and h.kv["type_k"] == "f16"
        assert h.n_scored == N_CTX - 1 - N_CTX // 2 and h.first_scored == N_CTX // 2
        assert h.tokens_sha256 == tokens_sha256(tokens)
        np.testing.assert_array_equal(r.tokens, tokens)
        np.testing.assert_array_equal(r.lut, SqrtLogCode().lut())
        for c in range(N_CHUNKS):
            assert_chunk_matches(r, store, c)


def test_header_json_and_file_layout(tmp_path, inputs):
    """Check the bytes against docs/store-format.md with a tiny independent parser."""
    tokens, logits = inputs
    store = write_store(tmp_path / "a.qeval", tokens, logits, N_VOCAB)
    data = store.path.read_bytes()
    magic, version, zero = struct.unpack_from("<8sII", data, 0)
    assert (magic, version, zero) == (MAGIC, 4, 0)
    pos, records = 16, []
    end_magic, index_offset = struct.unpack_from("<8sQ", data, len(data) - 16)
    assert end_magic == TRAILER_MAGIC
    while pos < len(data) - 16:
        tag, z, n = struct.unpack_from("<4sIQ", data, pos)
        payload = data[pos + 16:pos + 16 + n]
        (digest,) = struct.unpack_from("<Q", data, pos + 16 + n)
        assert z == 0 and digest == xxhash.xxh3_64_intdigest(payload)
        records.append((tag, pos, payload))
        pos += 16 + n + 8
    assert pos == len(data) - 16
    tags = [t for t, _, _ in records]
    assert tags == [b"HEAD", b"TOKS", b"LUT_"] + [b"CHNK", b"ERRS"] * N_CHUNKS + [b"INDX"]
    assert records[-1][1] == index_offset
    head = json.loads(records[0][2])
    assert head["n_scored"] == 7 and head["first_scored"] == 8 and head["format_version"] == 4
    assert head["scoring"] == "half"
    assert head["error"] == {"bands": 32, "band_width": 1.0} and "windows" not in head
    assert head["tokens_sha256"] == tokens_sha256(tokens)
    np.testing.assert_array_equal(np.frombuffer(records[1][2], "<i4").reshape(N_CHUNKS, N_CTX), tokens)
    index = np.frombuffer(records[-1][2], dtype=[("c", "<u4"), ("z", "<u4"), ("off", "<u8")])
    assert list(index["c"]) == list(range(N_CHUNKS))
    assert list(index["off"]) == [p for t, p, _ in records if t == b"CHNK"]
    # a CHNK payload: u32 index, n, K, 0, f64 scalars, i32 ids, then exactly n*2V decompressed bytes
    import zstandard
    chunk = records[3][2]
    c, n, k, z = struct.unpack_from("<IIII", chunk, 0)
    assert (c, n, k, z) == (0, 7, 10, 0)
    frame = chunk[16 + 16 * n + 4 * n * k:]
    raw = zstandard.ZstdDecompressor().decompressobj().decompress(frame)
    assert len(raw) == n * 2 * N_VOCAB
    planes = np.frombuffer(raw, np.uint8).reshape(n, 2, N_VOCAB)
    codes = (planes[:, 0].astype(np.uint16) << 8) | planes[:, 1]
    np.testing.assert_array_equal(codes, store.chunks[0].codes(N_VOCAB))
    # an ERRS payload: u32 index, n, K, first row, f64 KL(exact || stored), f64 log-normaliser of the stored row,
    # f32 lo and hi per band
    errs = records[4][2]
    assert struct.unpack_from("<IIII", errs, 0) == (0, 7, 32, 0) and len(errs) == 16 + 2 * 8 * 7 + 2 * 4 * 7 * 32
    kl, log_norm = (np.frombuffer(errs, "<f8", 7, 16 + 56 * k) for k in (0, 1))
    lo, hi = (np.frombuffer(errs, "<f4", 7 * 32, 16 + 112 + k * 4 * 7 * 32).reshape(7, 32) for k in (0, 1))
    exact = log_softmax64(store.logits[0])
    lut = np.frombuffer(records[2][2], "<f4").astype(np.float64)
    stored = decoded_logprobs(codes, lut)
    np.testing.assert_allclose(log_norm, np.log(np.exp(lut[codes]).sum(axis=1)), rtol=0, atol=1e-13)
    delta = exact - stored
    truth = (np.exp(exact) * delta).sum(axis=1)  # the record adds 1e-12 for float64 rounding
    assert np.all(kl >= truth) and np.all(kl <= truth + 1.01e-12)
    band = np.minimum(np.floor(-lut[codes]), 31).astype(int)
    for t in range(7):
        for b in range(32):
            held = delta[t][band[t] == b]
            if not len(held):
                assert lo[t, b] == hi[t, b] == 0
                continue
            assert lo[t, b] <= held.min() and held.max() <= hi[t, b]  # rounded outward
            np.testing.assert_allclose([lo[t, b], hi[t, b]], [held.min(), held.max()], rtol=1e-6, atol=2e-12)


def test_incomplete_store_reads_as_incomplete(tmp_path, inputs):
    tokens, logits = inputs
    store = write_store(tmp_path / "a.qeval", tokens, logits, N_VOCAB, finish=False, order=[0, 1])
    with StoreReader(store.path) as r:
        assert not r.complete
        assert r.chunk_indices == [0, 1]
        assert_chunk_matches(r, store, 1)
        with pytest.raises(StoreFormatError, match="chunk 3 is not in this store"):
            r.read_chunk(3)


def test_out_of_order_chunks(tmp_path, inputs):
    tokens, logits = inputs
    order = [2, 0, 3, 1]
    store = write_store(tmp_path / "a.qeval", tokens, logits, N_VOCAB, order=order)
    with StoreReader(store.path, verify_chunks=True) as r:
        assert r.complete and r.chunk_indices == [0, 1, 2, 3]
        for c in order:
            assert_chunk_matches(r, store, c)
    store2 = write_store(tmp_path / "b.qeval", tokens, logits, N_VOCAB, order=[3, 1], finish=False)
    with StoreReader(store2.path) as r:
        assert not r.complete and r.chunk_indices == [1, 3]
        assert_chunk_matches(r, store2, 3)


def test_resume_keeps_done_chunks(tmp_path, inputs):
    tokens, logits = inputs
    code = SqrtLogCode()
    path = tmp_path / "a.qeval"
    store = write_store(path, tokens, logits, N_VOCAB, finish=False, order=[0, 2])
    size = path.stat().st_size
    header = make_header(tokens, N_VOCAB, code, "synth")
    with StoreWriter.open(path, header, tokens, code.lut()) as w:
        assert w.done_chunks == {0, 2}
        assert path.stat().st_size == size  # nothing rewritten
        for c in (3, 1):
            store.chunks[c] = build_chunk(c, logits[c], store.targets(c), code)
            w.write_chunk(store.chunks[c])
        w.finish()
    with StoreReader(path, verify_chunks=True) as r:
        assert r.complete and r.chunk_indices == [0, 1, 2, 3]
        for c in range(N_CHUNKS):
            assert_chunk_matches(r, store, c)


def test_reopening_a_complete_store_raises_store_complete(tmp_path, inputs):
    tokens, logits = inputs
    code = SqrtLogCode()
    store = write_store(tmp_path / "a.qeval", tokens, logits, N_VOCAB)
    before = store.path.read_bytes()
    with pytest.raises(StoreComplete):
        StoreWriter.open(store.path, store.header, tokens, code.lut())
    assert store.path.read_bytes() == before


def test_finishing_twice_is_refused_or_harmless(tmp_path, inputs):
    tokens, logits = inputs
    code = SqrtLogCode()
    path = tmp_path / "a.qeval"
    header = make_header(tokens, N_VOCAB, code)
    with StoreWriter.open(path, header, tokens, code.lut()) as w:
        for c in range(N_CHUNKS):
            w.write_chunk(build_chunk(c, logits[c], tokens[c, N_CTX // 2 + 1:], code))
        w.finish()
        size = path.stat().st_size
        try:
            w.finish()
        except StoreComplete:
            pass
    assert path.stat().st_size == size


def test_resume_with_another_capture_is_refused(tmp_path, inputs):
    tokens, logits = inputs
    code = SqrtLogCode()
    path = tmp_path / "a.qeval"
    write_store(path, tokens, logits, N_VOCAB, finish=False, order=[0], model={"file_name": "a.gguf"})
    other = make_header(tokens, N_VOCAB, code, model={"file_name": "b.gguf"})
    with pytest.raises(StoreConflict, match="different capture.*model"):
        StoreWriter.open(path, other, tokens, code.lut())
    same = make_header(tokens, N_VOCAB, code, model={"file_name": "a.gguf"})
    with pytest.raises(StoreConflict, match="code table"):
        StoreWriter.open(path, same, tokens, SqrtLogCode(knee=-6.0).lut())


@pytest.mark.parametrize("cut", [1, 4, 30, 200, "half"])
def test_torn_tail_is_resumable(tmp_path, inputs, cut):
    tokens, logits = inputs
    code = SqrtLogCode()
    path = tmp_path / "a.qeval"
    store = write_store(path, tokens, logits, N_VOCAB, finish=False, order=[0, 1, 2])
    with StoreReader(path) as r:
        last = r.chunk_offsets[2]
    full = path.stat().st_size
    keep = (last + (full - last) // 2) if cut == "half" else full - cut
    with open(path, "r+b") as fh:
        fh.truncate(keep)
    with pytest.raises(StoreFormatError, match="truncated"):
        StoreReader(path)
    with StoreReader(path, tolerate_torn_tail=True) as r:
        assert r.chunk_indices == [0, 1] and not r.complete
        assert_chunk_matches(r, store, 0)
        assert_chunk_matches(r, store, 1)
    with StoreWriter.open(path, store.header, tokens, code.lut()) as w:
        assert w.done_chunks == {0, 1}
        assert path.stat().st_size == last  # the torn record is cut off, whole records kept
        for c in (2, 3):
            w.write_chunk(store.chunks.get(c) or build_chunk(c, logits[c], store.targets(c), code))
            store.chunks.setdefault(c, build_chunk(c, logits[c], store.targets(c), code))
        w.finish()
    with StoreReader(path, verify_chunks=True) as r:
        assert r.complete
        for c in range(N_CHUNKS):
            assert_chunk_matches(r, store, c)


def test_torn_index_of_a_finished_store_is_resumable(tmp_path, inputs):
    """A crash while writing INDX + trailer leaves all chunks: resume only rewrites the index."""
    tokens, logits = inputs
    code = SqrtLogCode()
    store = write_store(tmp_path / "a.qeval", tokens, logits, N_VOCAB)
    with open(store.path, "r+b") as fh:
        fh.truncate(store.path.stat().st_size - 10)
    with StoreWriter.open(store.path, store.header, tokens, code.lut()) as w:
        assert w.done_chunks == set(range(N_CHUNKS))
        w.finish()
    with StoreReader(store.path, verify_chunks=True) as r:
        assert r.complete
        for c in range(N_CHUNKS):
            assert_chunk_matches(r, store, c)


def test_shard_holds_only_its_range(tmp_path, inputs):
    tokens, logits = inputs
    code = SqrtLogCode()
    store = write_store(tmp_path / "s.qeval", tokens, {c: logits[c] for c in (1, 2)}, N_VOCAB,
                        chunk_range=(1, 3))
    with StoreReader(store.path) as r:
        assert r.complete and r.chunk_indices == [1, 2]
        assert r.header.chunk_range == range(1, 3)
        assert_chunk_matches(r, store, 2)
    header = make_header(tokens, N_VOCAB, code, chunk_range=(1, 3))
    with StoreWriter.open(tmp_path / "t.qeval", header, tokens, code.lut()) as w:
        with pytest.raises(ValueError, match="outside"):
            w.write_chunk(build_chunk(0, logits[0], tokens[0, N_CTX // 2 + 1:], code))


def test_writer_refuses_inconsistent_chunks(tmp_path, inputs):
    tokens, logits = inputs
    code = SqrtLogCode()
    header = make_header(tokens, N_VOCAB, code)
    with StoreWriter.open(tmp_path / "a.qeval", header, tokens, code.lut()) as w:
        c0 = build_chunk(0, logits[0], tokens[0, N_CTX // 2 + 1:], code)
        w.write_chunk(c0)
        with pytest.raises(ValueError, match="already stored"):
            w.write_chunk(c0)
        with pytest.raises(ValueError, match="does not fit 7 scored rows"):
            w.write_chunk(build_chunk(1, logits[1][:5], tokens[1, N_CTX // 2 + 1:][:5], code))
        with pytest.raises(ValueError, match="missing"):
            w.finish()
    with pytest.raises(ValueError, match="tokens_sha256"):
        StoreWriter.open(tmp_path / "b.qeval", header, tokens[::-1].copy(), code.lut())


def test_iter_planes_streams_in_blocks(tmp_path, inputs):
    tokens, logits = inputs
    store = write_store(tmp_path / "a.qeval", tokens, logits, N_VOCAB)
    with StoreReader(store.path) as r:
        chunk = r.read_chunk(1)
    full = chunk.codes(N_VOCAB)
    starts = []
    for start, planes in chunk.iter_planes(N_VOCAB, block_tokens=3):
        starts.append(start)
        assert planes.shape[1:] == (2, N_VOCAB) and len(planes) <= 3
        np.testing.assert_array_equal((planes[:, 0].astype(np.uint16) << 8) | planes[:, 1],
                                      full[start:start + len(planes)])
    assert starts == [0, 3, 6]
    # reading the codes with a wrong vocab is an error, not garbage
    with pytest.raises(StoreFormatError):
        chunk.codes(N_VOCAB - 1)
    with pytest.raises(StoreFormatError):
        chunk.codes(N_VOCAB + 1)


def test_store_with_another_knee_round_trips(tmp_path, inputs):
    tokens, logits = inputs
    code = SqrtLogCode(knee=-2.5)
    store = write_store(tmp_path / "k.qeval", tokens, logits, N_VOCAB, code=code)
    with StoreReader(store.path) as r:
        np.testing.assert_array_equal(r.lut, code.lut())
        assert r.complete


def test_vocab_smaller_than_top_k_round_trips(tmp_path):
    rng = np.random.default_rng(22)
    n_vocab = 5
    tokens = make_tokens(rng, 2, 8, n_vocab)
    logits = {c: realistic_logits(rng, half_span(8)[1], n_vocab) for c in range(2)}
    store = write_store(tmp_path / "v.qeval", tokens, logits, n_vocab)
    with StoreReader(store.path) as r:
        got = r.read_chunk(0)
        assert got.top_ids.shape[1] == n_vocab and got.top_ids.min() >= 0
        np.testing.assert_array_equal(got.top_ids, np.argsort(-logits[0], kind="stable", axis=1))


def test_header_rejects_bad_fields():
    tokens = np.zeros((2, 16), np.int32)
    good = make_header(tokens, 100, SqrtLogCode()).to_json()
    assert StoreHeader.from_json(good, "x").n_vocab == 100
    for key, value, pattern in [("n_vocab", 1, "n_vocab"), ("n_ctx", "16", "n_ctx"), ("chunk_stop", 3, "range"),
                                ("format_version", 3, "version 3"), ("scoring", "every:0", "scoring"), ("n_scored", 8, "n_scored"),
                                ("label", 5, "label"), ("model", [], "model"), ("n_chunks", True, "n_chunks")]:
        bad = dict(good, **{key: value})
        with pytest.raises(StoreFormatError, match=pattern):
            StoreHeader.from_json(bad, "x")
    with pytest.raises(StoreFormatError):
        StoreHeader.from_json([1, 2], "x")
    assert issubclass(StoreFormatError, QevalError)


def test_builder_or_writer_rejects_codes_passed_instead_of_planes(tmp_path, inputs):
    tokens, logits = inputs
    code = SqrtLogCode()
    header = make_header(tokens, N_VOCAB, code)
    enc = code.encode_block(logits[0], tokens[0, N_CTX // 2 + 1:])
    with StoreWriter.open(tmp_path / "a.qeval", header, tokens, code.lut()) as w:
        with pytest.raises((ValueError, QevalError)):
            from qeval.storage.store import ChunkBuilder

            b = ChunkBuilder(0)
            b.add(enc.codes, enc.logprob_target, enc.logprob_max, enc.top_ids)  # codes, not planes
            w.write_chunk(b.finish())


# ------------------------------------------------------------------------------------------------
# validation of well-framed but inconsistent content (valid CRCs, wrong meaning)
# ------------------------------------------------------------------------------------------------
def _records(data: bytes):
    """(tag, offset, payload_len) of every record, by the documented framing."""
    out, pos = [], 16
    end = len(data) - 16 if data[-16:-8] == TRAILER_MAGIC else len(data)
    while pos < end:
        tag, _, n = struct.unpack_from("<4sIQ", data, pos)
        out.append((tag, pos, n))
        pos += 16 + n + 8
    return out


def _rewrite_payload(path, tag: bytes, edit) -> None:
    """Replace one record's payload by edit(payload) (same length), with a correct CRC."""
    data = bytearray(path.read_bytes())
    for t, off, n in _records(bytes(data)):
        if t == tag:
            payload = edit(bytearray(data[off + 16:off + 16 + n]))
            assert len(payload) == n
            data[off + 16:off + 16 + n] = payload
            data[off + 16 + n:off + 24 + n] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(payload)))
            path.write_bytes(bytes(data))
            return
    raise AssertionError(f"no {tag} record")


@pytest.fixture
def small_store(tmp_path):
    rng = np.random.default_rng(23)
    tokens = make_tokens(rng, 2, N_CTX, N_VOCAB)
    return write_store(tmp_path / "s.qeval", tokens, synth_logits(rng, tokens, N_VOCAB), N_VOCAB)


def test_tokens_not_matching_their_hash(small_store):
    def edit(p):
        p[0:4] = struct.pack("<i", (struct.unpack_from("<i", p, 0)[0] + 1) % N_VOCAB)
        return p
    _rewrite_payload(small_store.path, b"TOKS", edit)
    with pytest.raises(StoreFormatError, match="tokens_sha256"):
        StoreReader(small_store.path)


def test_non_monotone_code_table(small_store):
    def edit(p):
        lut = np.frombuffer(bytes(p), "<f4").copy()
        lut[100], lut[101] = lut[101], lut[100] - 1.0
        return bytearray(lut.tobytes())
    _rewrite_payload(small_store.path, b"LUT_", edit)
    with pytest.raises(StoreFormatError, match="code table"):
        StoreReader(small_store.path)


def test_index_pointing_outside_the_file(small_store):
    def edit(p):
        p[8:16] = struct.pack("<Q", 10 ** 9)
        return p
    _rewrite_payload(small_store.path, b"INDX", edit)
    with pytest.raises(StoreFormatError, match="outside the file"):
        StoreReader(small_store.path)


def test_index_missing_a_chunk(small_store):
    def edit(p):
        p[16:20] = struct.pack("<I", 0)  # entry for chunk 1 now says chunk 0
        return p
    _rewrite_payload(small_store.path, b"INDX", edit)
    with pytest.raises(StoreFormatError, match="does not cover|out of order"):
        StoreReader(small_store.path)


def test_trailer_pointing_outside(small_store):
    data = bytearray(small_store.path.read_bytes())
    data[-8:] = struct.pack("<Q", len(data) + 5)
    small_store.path.write_bytes(bytes(data))
    with pytest.raises(StoreFormatError, match="trailer points outside"):
        StoreReader(small_store.path)


def test_chunk_with_top_ids_outside_the_vocab(small_store):
    def edit(p):
        p[16 + 16 * 7:16 + 16 * 7 + 4] = struct.pack("<i", N_VOCAB)
        return p
    _rewrite_payload(small_store.path, b"CHNK", edit)
    with StoreReader(small_store.path) as r:
        with pytest.raises(StoreFormatError, match="outside the vocab"):
            r.read_chunk(0)


def test_corrupt_or_oversized_code_frame():
    import zstandard

    from qeval.storage.store import ChunkData

    n, v = 3, 50
    scalars = (np.zeros(n), np.zeros(n), np.zeros((n, 10), np.int32))
    too_long = ChunkData(0, *scalars, zstandard.ZstdCompressor().compress(bytes(2 * v * (n + 1))))
    with pytest.raises(StoreFormatError, match="more data"):
        too_long.codes(v)
    too_short = ChunkData(0, *scalars, zstandard.ZstdCompressor().compress(bytes(2 * v * n - 1)))
    with pytest.raises(StoreFormatError, match="ends early"):
        too_short.codes(v)
    garbage = ChunkData(0, *scalars, b"\x28\xb5\x2f\xfd" + bytes(range(40)))
    with pytest.raises(StoreFormatError):
        garbage.codes(v)


def test_info_on_a_torn_capture_reports_it_incomplete(tmp_path):
    from conftest import run_cli

    rng = np.random.default_rng(24)
    tokens = make_tokens(rng, 3, N_CTX, N_VOCAB)
    store = write_store(tmp_path / "t.qeval", tokens, synth_logits(rng, tokens, N_VOCAB), N_VOCAB,
                        finish=False, order=[0, 1])
    with open(store.path, "r+b") as fh:
        fh.truncate(store.path.stat().st_size - 50)
    res = run_cli("info", store.path)
    assert res.returncode == 0, res.stderr
    assert "INCOMPLETE" in res.stdout and "1 of 3 chunks" in res.stdout


# --------------------------------------------------------------------------------------------------
# long windows: a chunk in pieces of PIECE_ROWS rows (one record each), never held whole
# --------------------------------------------------------------------------------------------------
def _pieces(index: int, logits: np.ndarray, targets: np.ndarray, code: SqrtLogCode, rows: int = PIECE_ROWS):
    out = []
    for first in range(0, len(logits), rows):
        builder = ChunkBuilder(index, first_row=first)
        enc = code.encode_block(logits[first:first + rows], targets[first:first + rows])
        builder.add(enc.planes, enc.logprob_target, enc.logprob_max, enc.top_ids, enc.error)
        out.append(builder.finish())
    return out


@pytest.fixture
def long_inputs():
    rng = np.random.default_rng(11)
    n_ctx, n_vocab = 600, 300  # 299 scored rows: pieces of 256 and 43
    tokens = rng.integers(0, n_vocab, size=(3, n_ctx)).astype(np.int32)
    logits = {c: realistic_logits(rng, n_ctx - 1 - n_ctx // 2, n_vocab) for c in range(3)}
    return tokens, logits, n_vocab


def test_pieced_chunks_read_back_like_whole_ones(tmp_path, long_inputs):
    tokens, logits, n_vocab = long_inputs
    code = SqrtLogCode()
    header = make_header(tokens, n_vocab, code)
    targets = {c: tokens[c, header.positions + 1] for c in range(3)}
    with StoreWriter.open(tmp_path / "p.qeval", header, tokens, code.lut()) as w:
        for c in range(3):
            for piece in _pieces(c, logits[c], targets[c], code):
                w.write_chunk(piece)
        w.finish()
    whole = write_store(tmp_path / "w.qeval", tokens, logits, n_vocab, code=code)
    with StoreReader(tmp_path / "p.qeval", verify_chunks=True) as r:
        assert [len(r.chunk_pieces[c]) for c in range(3)] == [2, 2, 2]
        for c in range(3):
            chunk = r.read_chunk(c)
            np.testing.assert_array_equal(chunk.codes(n_vocab), whole.chunks[c].codes(n_vocab))
            np.testing.assert_array_equal(chunk.logprob_target, whole.chunks[c].logprob_target)
            np.testing.assert_array_equal(chunk.top_ids, whole.chunks[c].top_ids)
    # a store in pieces against the same capture in one record: token blocks stay aligned, KLD exactly 0
    result, _ = api.kld_report(str(tmp_path / "p.qeval"), str(whole.path), threads=2)
    assert result["scored_tokens"] == 3 * 299 and result["kld"]["mean"] == 0.0


def test_resume_drops_the_pieces_of_an_unfinished_window(tmp_path, long_inputs):
    tokens, logits, n_vocab = long_inputs
    code = SqrtLogCode()
    header = make_header(tokens, n_vocab, code)
    targets = {c: tokens[c, header.positions + 1] for c in range(3)}
    path = tmp_path / "r.qeval"
    with StoreWriter.open(path, header, tokens, code.lut()) as w:
        for piece in _pieces(0, logits[0], targets[0], code):
            w.write_chunk(piece)
        first_of_1 = _pieces(1, logits[1], targets[1], code)[0]
        w.write_chunk(first_of_1)  # then the process dies inside window 1
        with pytest.raises(ValueError, match="chunk 1 is unfinished"):
            w.write_chunk(ChunkData(2, first_of_1.logprob_target, first_of_1.logprob_max, first_of_1.top_ids,
                                    first_of_1.codes_zst, 0))
    size_before = path.stat().st_size
    with StoreReader(path, tolerate_torn_tail=True) as r:
        assert r.chunk_indices == [0] and not r.complete
    with StoreWriter.open(path, header, tokens, code.lut()) as w:
        assert w.done_chunks == {0} and path.stat().st_size < size_before  # window 1's piece is gone
        with pytest.raises(ValueError, match="at row 256, expected row 0"):
            w.write_chunk(_pieces(1, logits[1], targets[1], code)[1])
        for c in (1, 2):
            for piece in _pieces(c, logits[c], targets[c], code):
                w.write_chunk(piece)
        w.finish()
    with StoreReader(path, verify_chunks=True) as r:
        assert r.complete and r.chunk_indices == [0, 1, 2]


# ------------------------------------------------------------------------------------------------
# the per-token error record (ERRS, format version 4): checked like every other record
# ------------------------------------------------------------------------------------------------
def _errs_payload_offset(path) -> int:
    data = path.read_bytes()
    return next(off for tag, off, _ in _records(data) if tag == b"ERRS") + 16


@pytest.mark.parametrize("what, edit, message", [
    ("kl negative", lambda p: p.__setitem__(slice(16, 24), struct.pack("<d", -1.0)) or p, "invalid values"),
    ("kl NaN", lambda p: p.__setitem__(slice(16, 24), struct.pack("<d", float("nan"))) or p, "invalid values"),
    ("log-normaliser below 0", lambda p: p.__setitem__(slice(16 + 56, 24 + 56), struct.pack("<d", -0.5)) or p,
     "invalid values"),
    ("lo above hi", lambda p: p.__setitem__(slice(128, 132), struct.pack("<f", 5.0)) or p, "invalid values"),
    ("hi infinite", lambda p: p.__setitem__(slice(128 + 4 * 7 * 32, 132 + 4 * 7 * 32), struct.pack("<f", np.inf)) or p,
     "invalid values"),
    ("wrong chunk", lambda p: p.__setitem__(slice(0, 4), struct.pack("<I", 1)) or p, "disagrees with its chunk"),
    ("wrong rows", lambda p: p.__setitem__(slice(4, 8), struct.pack("<I", 6)) or p, "disagrees with its chunk"),
    ("wrong bands", lambda p: p.__setitem__(slice(8, 12), struct.pack("<I", 31)) or p, "disagrees with its chunk"),
])
def test_error_record_with_wrong_content(small_store, what, edit, message):
    """Well-framed (valid checksum) but wrong: refused when the chunk is read, naming the chunk."""
    _rewrite_payload(small_store.path, b"ERRS", edit)
    with StoreReader(small_store.path) as r:
        with pytest.raises(StoreFormatError, match=message):
            r.read_chunk(0)
        with pytest.raises(StoreFormatError, match=message):
            list(r.iter_errors())


def test_error_record_flipped_byte_missing_or_torn(small_store, tmp_path):
    data = small_store.path.read_bytes()
    at = _errs_payload_offset(small_store.path)
    flipped = tmp_path / "flipped.qeval"
    flipped.write_bytes(data[:at + 40] + bytes([data[at + 40] ^ 0x5A]) + data[at + 41:])
    with StoreReader(flipped) as r:
        with pytest.raises(StoreFormatError, match="checksum mismatch in ERRS"):
            r.read_chunk(0)
    # a CHNK record not followed by its ERRS (another record's tag there): refused as the wrong record
    retagged = tmp_path / "retagged.qeval"
    retagged.write_bytes(data[:at - 16] + b"CHNK" + data[at - 12:])
    with StoreReader(retagged) as r:
        with pytest.raises(StoreFormatError, match="expected a ERRS record"):
            r.read_chunk(0)
    # cut inside the first chunk's error record: an interrupted capture, resumable from chunk 0
    torn = tmp_path / "torn.qeval"
    torn.write_bytes(data[:at + 30])
    with StoreReader(torn, tolerate_torn_tail=True) as r:
        assert not r.complete and r.chunk_indices == []
    with pytest.raises(StoreFormatError, match="truncated"):
        StoreReader(torn)


@pytest.mark.parametrize("seed", range(12))
def test_random_corruption_of_a_version_4_store_is_refused_cleanly(small_store, tmp_path, seed):
    """A byte flipped anywhere: a StoreFormatError when the store or a chunk is read, or (a flip in the trailer's
    padding that changes nothing it reads) identical data; never another exception, never a wrong number."""
    rng = np.random.default_rng(seed)
    data = bytearray(small_store.path.read_bytes())
    at = int(rng.integers(0, len(data)))
    data[at] ^= 1 << int(rng.integers(0, 8))
    bad = tmp_path / "bad.qeval"
    bad.write_bytes(bytes(data))
    try:
        with StoreReader(bad) as r:
            for c in r.chunk_indices:
                got = r.read_chunk(c)
                want = small_store.chunks[c]
                np.testing.assert_array_equal(got.codes(N_VOCAB), want.codes(N_VOCAB))
                np.testing.assert_array_equal(got.error.lo, want.error.lo)
                np.testing.assert_array_equal(got.error.kl, want.error.kl)
    except StoreFormatError:
        pass


def test_version_4_header_rules():
    tokens = np.zeros((1, 16), np.int32)
    with_error = make_header(tokens, 100, SqrtLogCode()).to_json()
    assert with_error["format_version"] == 4 and with_error["error"] == {"bands": 32, "band_width": 1.0}
    without = make_header(tokens, 100, SqrtLogCode(error=None)).to_json()
    assert without["format_version"] == 2 and "error" not in without
    for bad, message in (({**with_error, "error": {}}, "without an error record"),
                         ({**without, "error": {"bands": 32, "band_width": 1.0}}, "with an error record"),
                         ({**with_error, "error": {"bands": 0, "band_width": 1.0}}, "'bands'"),
                         ({**with_error, "error": {"bands": 32, "band_width": -1}}, "'band_width'"),
                         ({**with_error, "error": "yes"}, "must be an object")):
        with pytest.raises(StoreFormatError, match=message):
            StoreHeader.from_json(bad, "x")


def test_a_reader_of_versions_1_to_3_refuses_version_4_cleanly(small_store, monkeypatch):
    """What an older qeval does with a store that records its error: one message, its version named."""
    from qeval.storage import store as store_module

    monkeypatch.setattr(store_module, "READABLE_VERSIONS", (1, 2, 3))
    with pytest.raises(StoreFormatError, match="version 4 is not supported"):
        StoreReader(small_store.path)


def test_info_shows_the_form_and_the_recorded_error(small_store, tmp_path):
    d, text = api.info_report(str(small_store.path))
    assert d["form"]["error"] == {"bands": 32, "band_width": 1.0} and d["error"]["recorded"]
    assert d["error"]["tokens"] == 2 * 7 and 0 < d["error"]["kl_mean"] <= d["error"]["kl_max"] < 1e-6
    assert d["error"]["max_abs_dlogp_top_band"] < 1e-4 < d["error"]["max_abs_dlogp"]
    assert "KL(exact ‖ stored) mean" in text
    rng = np.random.default_rng(3)
    tokens = make_tokens(rng, 1, N_CTX, N_VOCAB)
    old = write_store(tmp_path / "o.qeval", tokens, synth_logits(rng, tokens, N_VOCAB), N_VOCAB,
                      code=SqrtLogCode(error=None))
    d, text = api.info_report(str(old.path))
    assert d["error"] == {"recorded": False} and "error      : not recorded" in text and "capture it" in text.lower()


# --------------------------------------------------------------------------------------------------
# a complete store grows to more windows of the same capture
# --------------------------------------------------------------------------------------------------
def _grown(tmp_path, n_old: int, n_new: int, **capture):
    """A complete store of n_old windows, and a writer opened for the same capture over n_new windows."""
    rng = np.random.default_rng(5)
    tokens = make_tokens(rng, n_new, 16, 500)
    logits = synth_logits(rng, tokens, 500)
    path = tmp_path / "REF.qeval"
    old = write_store(path, tokens[:n_old], {c: logits[c] for c in range(n_old)}, 500, label="REF",
                      capture=dict(capture))
    header = make_header(tokens, 500, SqrtLogCode(), "REF", capture=dict(capture))
    return path, old, tokens, logits, StoreWriter.open(path, header, tokens, SqrtLogCode().lut())


def test_a_complete_store_grows_to_more_windows_of_the_same_capture(tmp_path):
    path, old, tokens, logits, writer = _grown(tmp_path, 3, 5, n_batch=8)  # one window per decode call
    with StoreReader(path) as before:
        kept = {c: before.raw_record(before.chunk_pieces[c][0][1]) for c in range(3)}
    with writer:
        assert writer.done_chunks == {0, 1, 2} and writer.path != path  # written beside the old store
        assert StoreReader(path).complete  # which stays whole until the new one is
        for c in (3, 4):
            writer.write_chunk(build_chunk(c, logits[c], tokens[c, 8:15], SqrtLogCode()))
        writer.finish()
    with StoreReader(path, verify_chunks=True) as grown:
        assert grown.complete and grown.header.n_chunks == 5 and grown.chunk_indices == [0, 1, 2, 3, 4]
        assert all(grown.raw_record(grown.chunk_pieces[c][0][1]) == kept[c] for c in range(3))  # byte for byte
        for c in range(3):  # the kept chunks keep their error records (ERRS copied with each CHNK)
            np.testing.assert_array_equal(grown.read_chunk(c).error.kl, old.chunks[c].error.kl)
        assert b"ERRS" in kept[0] and grown.header.format_version == 4
        np.testing.assert_array_equal(grown.tokens, tokens)
    assert not replacement_path(path).exists()


def test_a_store_grows_by_whole_decode_calls_only(tmp_path):
    """Windows decoded side by side (n_batch 32 = 2 windows of 16 per call): of 3 kept windows the third was decoded
    alone, as it would not be in the larger capture, so it runs again."""
    _, _, _, _, writer = _grown(tmp_path, 3, 6, n_batch=32)
    with writer:
        assert writer.done_chunks == {0, 1}


def test_other_windows_or_a_shard_do_not_grow_a_store(tmp_path):
    rng = np.random.default_rng(6)
    tokens = make_tokens(rng, 4, 16, 500)
    path = tmp_path / "REF.qeval"
    write_store(path, tokens[:2], synth_logits(rng, tokens[:2], 500), 500, label="REF")
    other = tokens.copy()
    other[1, 3] += 1  # the second old window differs
    for wanted, span in ((other, None), (tokens, (1, 4))):
        header = make_header(wanted, 500, SqrtLogCode(), "REF", chunk_range=span)
        with pytest.raises(StoreConflict, match="token windows differ"):
            StoreWriter.open(path, header, wanted, SqrtLogCode().lut())
