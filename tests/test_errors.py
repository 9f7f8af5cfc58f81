"""Bad inputs: each must raise a QevalError subclass with a helpful message, through the API and
through the CLI (`python -m qeval ...`: non-zero exit, 'qeval: error:' on stderr, no traceback)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from conftest import assert_cli_error, make_pair, make_tokens, run_cli, synth_logits, write_store

from qeval import api
from qeval.compare import metrics
from qeval.errors import MismatchError, QevalError, StoreFormatError
from qeval.storage.store import StoreReader


@pytest.fixture
def one(tmp_path):
    """A single-chunk pair (the CLI then compares without concurrent reads of one file)."""
    return make_pair(tmp_path / "runs", seed=31, n_chunks=1, n_ctx=16, n_vocab=1000)


@pytest.fixture
def three(tmp_path):
    return make_pair(tmp_path / "runs3", seed=32, n_chunks=3, n_ctx=16, n_vocab=1000)


def kld_cli(ref, cand, runs_dir, *extra):
    return run_cli("kld", "--ref", ref, "--cand", cand, "--runs-dir", runs_dir, *extra)


def api_kld(ref, cand, runs_dir, **kw):
    return api.kld_report(str(ref), str(cand), runs_dir=runs_dir, threads=1, **kw)


def corrupt(path, offset, new: bytes | None = None):
    data = bytearray(path.read_bytes())
    if new is None:
        data[offset] ^= 0x5A
    else:
        data[offset:offset + len(new)] = new
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------------
# corrupt or unusable store files
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["mid_chunk", "in_header", "in_trailer", "preamble_only"])
def test_truncated_store(one, where):
    path = one.cand.path
    size = path.stat().st_size
    with StoreReader(path) as r:
        chunk0 = r.chunk_offsets[0]
    keep = {"mid_chunk": chunk0 + 40, "in_header": 30, "in_trailer": size - 5, "preamble_only": 16}[where]
    with open(path, "r+b") as fh:
        fh.truncate(keep)
    with pytest.raises(StoreFormatError, match="truncated"):
        StoreReader(path)
    with pytest.raises(StoreFormatError, match="truncated"):
        api_kld(one.ref.path, path, one.directory)
    with pytest.raises(StoreFormatError, match="truncated"):
        api.ppl_report(str(path))
    if where == "mid_chunk":
        assert_cli_error(kld_cli("REF", "CAND", one.directory), "truncated", "CAND.qeval")
    elif where == "in_header":
        assert_cli_error(run_cli("info", path), "truncated")


def test_flipped_byte_in_chunk_payload_fails_the_checksum(one):
    path = one.cand.path
    with StoreReader(path) as r:
        offset = r.chunk_offsets[0]
    corrupt(path, offset + 16 + 16 + 8 * 7 * 2 + 4 * 7 * 10 + 100)  # inside the zstd frame
    with StoreReader(path) as r:  # opening reads the index only; the chunk is checked when read
        with pytest.raises(StoreFormatError, match="checksum mismatch"):
            r.read_chunk(0)
    with pytest.raises(StoreFormatError, match="checksum"):
        api_kld(one.ref.path, path, one.directory)
    assert_cli_error(kld_cli("REF", "CAND", one.directory), "checksum", "corrupt")
    with pytest.raises(StoreFormatError, match="checksum"):
        api.ppl_report(str(path))


@pytest.mark.parametrize("field_offset", [16 + 16, 16 + 16 + 3 * 8 + 4 * 7])  # chunk index; a logprob
def test_flipped_byte_in_chunk_scalars_fails_the_checksum(one, field_offset):
    path = one.ref.path
    with StoreReader(path) as r:
        offset = r.chunk_offsets[0]
    corrupt(path, offset + field_offset)
    with pytest.raises(StoreFormatError, match="checksum"):
        api.ppl_report(str(path))


def test_flipped_byte_in_header_tokens_and_lut(one):
    for i, (record_offset, what) in enumerate([(16 + 16 + 5, "HEAD"), (None, "TOKS"), (None, "LUT_")]):
        p = one.directory / f"c{i}.qeval"
        p.write_bytes(one.cand.path.read_bytes())
        data = p.read_bytes()
        off = record_offset if record_offset is not None else data.index(what.encode()) + 16 + 7
        corrupt(p, off)
        with pytest.raises(StoreFormatError, match=f"checksum mismatch in {what}"):
            StoreReader(p)
    assert_cli_error(run_cli("info", p), "checksum", "LUT_")


def test_wrong_magic(one, tmp_path):
    path = one.cand.path
    corrupt(path, 0, b"NOTQEVAL")
    with pytest.raises(StoreFormatError, match="not a qeval store"):
        StoreReader(path)
    with pytest.raises(QevalError, match="neither a qeval store nor a llama.cpp"):
        api_kld(one.ref.path, path, one.directory)
    assert_cli_error(kld_cli("REF", "CAND", one.directory), "neither a qeval store nor a llama.cpp")
    empty = tmp_path / "empty.qeval"
    empty.write_bytes(b"")
    assert_cli_error(run_cli("info", empty), "neither a qeval store")
    text = tmp_path / "notes.txt"
    text.write_text("hello world, this is not a store\n")
    with pytest.raises(QevalError, match="notes.txt"):
        api_kld(one.ref.path, text, one.directory)


def test_unsupported_preamble_version(one):
    path = one.cand.path
    corrupt(path, 8, struct.pack("<I", 9))
    with pytest.raises(StoreFormatError, match="version 9 is not supported"):
        StoreReader(path)
    assert_cli_error(kld_cli("REF", "CAND", one.directory), "version 9 is not supported")


def test_unsupported_header_version(tmp_path):
    rng = np.random.default_rng(33)
    tokens = make_tokens(rng, 1, 16, 500)
    store = write_store(tmp_path / "v.qeval", tokens, synth_logits(rng, tokens, 500), 500, format_version=8)
    with pytest.raises(StoreFormatError, match="version 8 is not supported"):
        StoreReader(store.path)
    assert_cli_error(run_cli("info", store.path), "version 8 is not supported")


def test_store_still_being_written(tmp_path, one):
    rng = np.random.default_rng(34)
    tokens = make_tokens(rng, 3, 16, 1000)
    logits = synth_logits(rng, tokens, 1000)
    a = write_store(tmp_path / "a.qeval", tokens, logits, 1000, finish=False, order=[0, 1])
    b = write_store(tmp_path / "b.qeval", tokens, logits, 1000)
    for ref, cand, role in [(a, b, "reference"), (b, a, "candidate")]:
        with pytest.raises(QevalError, match=f"{role} store .* is incomplete: 2 of 3 chunks"):
            api_kld(ref.path, cand.path, tmp_path)
        # even a --chunks range the partial store holds is refused: a partial store is not a result
        with pytest.raises(QevalError, match="incomplete"):
            api_kld(ref.path, cand.path, tmp_path, chunks=1)
    assert_cli_error(kld_cli(a.path, b.path, tmp_path), "incomplete", "2 of 3 chunks", "resume")
    assert_cli_error(kld_cli(b.path, a.path, tmp_path, "--chunks", "1"), "candidate", "incomplete")
    with pytest.raises(QevalError, match="incomplete"):
        api.ppl_report(str(a.path))


def test_chunks_beyond_what_exists(three):
    d = three.directory
    with pytest.raises(QevalError, match="--chunks 4"):
        api_kld("REF", "CAND", d, chunks=4)
    with pytest.raises(QevalError, match="--chunks"):
        api_kld("REF", "CAND", d, chunks=0)
    with pytest.raises(QevalError, match="--chunks 0"):
        api.ppl_report("REF", chunks=0, runs_dir=d)
    assert_cli_error(kld_cli("REF", "CAND", d, "--chunks", "4"), "--chunks 4", "3")
    assert_cli_error(run_cli("ppl", "REF", "--chunks", "9", "--runs-dir", d), "--chunks 9")


def test_nonexistent_and_unreadable_paths(one, tmp_path):
    d = one.directory
    missing = tmp_path / "no" / "such.qeval"
    with pytest.raises(QevalError, match="neither a file nor a label"):
        api_kld(missing, "CAND", d)
    assert_cli_error(kld_cli(missing, "CAND", d), "such.qeval", "neither a file nor a label")
    with pytest.raises(QevalError, match="such.qeval"):
        api.info_report(str(missing), runs_dir=d)
    a_dir = tmp_path / "adir.qeval"
    a_dir.mkdir()
    assert_cli_error(kld_cli("REF", a_dir, d), "not a regular file")
    with pytest.raises(StoreFormatError, match="cannot open store"):
        StoreReader(missing)


def test_label_not_found_lists_the_known_labels(one, tmp_path):
    msg = assert_cli_error(kld_cli("REF", "Q4_K_M", one.directory), "'Q4_K_M'", "runs directory")
    assert "CAND" in msg and "REF" in msg  # the hint names the labels that do exist
    empty = tmp_path / "empty-runs"
    with pytest.raises(QevalError, match=r"empty-runs \(no stores\)"):
        api.ppl_report("REF", runs_dir=empty)


def _pair_with(tmp_path, name, n_vocab=1000, n_ctx=16, tokens=None, seed=35, **extra):
    rng = np.random.default_rng(seed)
    tokens = make_tokens(rng, 1, n_ctx, n_vocab) if tokens is None else tokens
    return write_store(tmp_path / f"{name}.qeval", tokens, synth_logits(rng, tokens, n_vocab), n_vocab,
                       label=name, **extra)


def test_vocab_mismatch(tmp_path):
    rng = np.random.default_rng(36)
    tokens = make_tokens(rng, 1, 16, 900)
    a = _pair_with(tmp_path, "A", 1000, tokens=tokens)
    b = _pair_with(tmp_path, "B", 900, tokens=tokens)
    with pytest.raises(MismatchError, match="vocab size differs: reference 1000, candidate 900"):
        api_kld("A", "B", tmp_path)
    assert_cli_error(kld_cli(a.path, b.path, tmp_path), "vocab", "1000", "900")


def test_n_ctx_mismatch(tmp_path):
    _pair_with(tmp_path, "A", n_ctx=16)
    _pair_with(tmp_path, "B", n_ctx=32)
    with pytest.raises(MismatchError, match="n_ctx 16.*n_ctx 32"):
        api_kld("A", "B", tmp_path)
    assert_cli_error(kld_cli("A", "B", tmp_path), "context size differs", "16", "32")


def test_token_mismatch_names_the_first_differing_position(tmp_path):
    rng = np.random.default_rng(37)
    tokens = make_tokens(rng, 2, 16, 1000)
    other = tokens.copy()
    other[1, 5] = (other[1, 5] + 1) % 1000  # first difference: flat position 21 = chunk 1, offset 5
    other[1, 9] = (other[1, 9] + 7) % 1000
    a = write_store(tmp_path / "A.qeval", tokens, synth_logits(rng, tokens, 1000), 1000, label="A")
    write_store(tmp_path / "B.qeval", other, synth_logits(rng, other, 1000), 1000, label="B")
    with pytest.raises(MismatchError) as info:
        api_kld("A", "B", tmp_path)
    msg = str(info.value)
    assert "position 21" in msg and "chunk 1, offset 5" in msg and "2 positions differ" in msg
    assert f"reference {tokens[1, 5]}, candidate {other[1, 5]}" in msg
    assert_cli_error(kld_cli(a.path, "B", tmp_path), "position 21", "chunk 1, offset 5")
    # the first chunk alone is identical, so --chunks 1 compares fine
    assert api_kld("A", "B", tmp_path, chunks=1)[0]["chunks"] == 1


def test_tokenizer_mismatch(tmp_path):
    rng = np.random.default_rng(38)
    tokens = make_tokens(rng, 1, 16, 1000)
    _pair_with(tmp_path, "A", tokens=tokens, tokenizer_sha256="a" * 64)
    _pair_with(tmp_path, "B", tokens=tokens, tokenizer_sha256="b" * 64)
    assert_cli_error(kld_cli("A", "B", tmp_path), "tokenizers differ")


def test_shard_that_does_not_start_at_chunk_zero(tmp_path):
    rng = np.random.default_rng(39)
    tokens = make_tokens(rng, 3, 16, 1000)
    logits = synth_logits(rng, tokens, 1000)
    write_store(tmp_path / "A.qeval", tokens, logits, 1000, label="A")
    write_store(tmp_path / "B.qeval", tokens, {c: logits[c] for c in (1, 2)}, 1000, label="B",
                chunk_range=(1, 3))
    assert_cli_error(kld_cli("A", "B", tmp_path), "share no chunk range", "merge")


def test_save_needs_a_live_model_candidate(one):
    assert_cli_error(kld_cli("REF", "CAND", one.directory, "--save", "X"), "--save")


def test_errors_are_qeval_errors():
    assert issubclass(StoreFormatError, QevalError) and issubclass(MismatchError, QevalError)
    assert QevalError.exit_code != 0


def test_select_chunks(one):
    with StoreReader(one.ref.path) as ref, StoreReader(one.cand.path) as cand:
        assert metrics.select_chunks(ref, cand, None) == [0]
        assert metrics.select_chunks(ref, cand, 1) == [0]
        with pytest.raises(QevalError, match="at least 1"):
            metrics.select_chunks(ref, cand, 0)
        with pytest.raises(QevalError, match="--chunks 2"):
            metrics.select_chunks(ref, cand, 2)
