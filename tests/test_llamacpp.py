"""Reading llama-perplexity --kl-divergence-base files, written here by an independent float64 encoder
(conftest.write_llamacpp_file) following /work/shared/reference/llama-perplexity.md."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import (
    SlowSeekFile,
    assert_cli_error,
    decoded_logprobs,
    kld64,
    log_softmax64,
    make_tokens,
    run_cli,
    stable_topk,
    synth_logits,
    write_llamacpp_file,
)

from qeval import api
from qeval.compare import metrics
from qeval.errors import StoreFormatError
from qeval.storage.llamacpp import LlamaCppBaseFile, import_llamacpp, is_llamacpp_file, record_values
from qeval.storage.store import StoreReader

N_CTX, N_CHUNKS = 16, 2
N_SCORED = N_CTX - 1 - N_CTX // 2


@pytest.fixture(params=[1000, 1001], ids=["even-vocab", "odd-vocab"])
def base(request, tmp_path):
    n_vocab = request.param
    rng = np.random.default_rng(n_vocab)
    tokens = make_tokens(rng, N_CHUNKS, N_CTX, n_vocab)
    logits = synth_logits(rng, tokens, n_vocab)
    path = tmp_path / "base.kld"
    encoded = write_llamacpp_file(path, tokens, logits, n_vocab)
    return path, tokens, logits, encoded, n_vocab


def llama_decoded(encoded, c):
    """float64 log p per llama.cpp: scale * code + min_log_prob (from the stored float32 values)."""
    return np.array([np.float64(s) * codes.astype(np.float64) + np.float64(m) for s, m, codes in encoded[c]])


def test_file_layout_size(base):
    path, tokens, _, _, n_vocab = base
    nv = 2 * ((n_vocab + 1) // 2) + 4
    assert record_values(n_vocab) == nv
    assert path.stat().st_size == 8 + 12 + 4 * tokens.size + N_CHUNKS * N_SCORED * 2 * nv
    assert record_values(262144) * 2 == 524296  # the reference's record size at Gemma's vocab


def test_reader_exposes_header_and_tokens(base):
    path, tokens, _, _, n_vocab = base
    assert is_llamacpp_file(path)
    with LlamaCppBaseFile(path) as f:
        np.testing.assert_array_equal(f.tokens, tokens)
        h = f.header
        assert (h.n_vocab, h.n_ctx, h.n_chunks, h.chunk_start, h.chunk_stop) == (n_vocab, N_CTX, N_CHUNKS, 0,
                                                                                  N_CHUNKS)
        assert h.n_scored == N_SCORED and f.complete and f.chunk_indices == [0, 1]
        assert h.source.startswith("llama.cpp")


def test_chunk_scalars_are_llamacpp_decoded_values(base):
    path, tokens, logits, encoded, n_vocab = base
    with LlamaCppBaseFile(path) as f:
        for c in range(N_CHUNKS):
            chunk = f.read_chunk(c)
            decoded = llama_decoded(encoded, c)
            targets = tokens[c, N_CTX // 2 + 1:]
            rows = np.arange(N_SCORED)
            np.testing.assert_allclose(chunk.logprob_target, decoded[rows, targets], rtol=0, atol=1e-5)
            np.testing.assert_allclose(chunk.logprob_max, decoded.max(axis=1), rtol=0, atol=1e-5)
            # llama.cpp's decoded values are close to the exact log-softmax for the head of each row
            exact = log_softmax64(logits[c])
            np.testing.assert_allclose(chunk.logprob_max, exact.max(axis=1), atol=1e-3)
            np.testing.assert_array_equal(chunk.top_ids[:, 0], np.argmax(decoded, axis=1))
            np.testing.assert_array_equal(chunk.top_ids, stable_topk(decoded.astype(np.float32), 10))
            # the re-coded row carries llama.cpp's distribution over the entries above its clamp (the
            # floor, code 0, means "at or below max - 16": no mass is made up for it)
            floor = decoded <= decoded.min(axis=1, keepdims=True)
            p_llama = log_softmax64(np.where(floor, -np.inf, decoded))
            p_hat = decoded_logprobs(chunk.codes(n_vocab), f.lut)
            assert kld64(p_llama, p_hat).max() < 1e-5


def test_independent_encoder_matches_the_documented_clamp():
    """Sanity of the test's own encoder: the clamp at max - 16 and the decode formula."""
    from conftest import llamacpp_encode_row

    x = np.array([10.0, 9.0, -10.0, -40.0, 10.0 - 16.0, 3.0])
    scale, mlp, codes = llamacpp_encode_row(x)
    lse = math.log(np.sum(np.exp(x - 10.0)))
    assert scale == pytest.approx(16.0 / 65535, rel=1e-6)
    assert mlp == pytest.approx(-6.0 - 10.0 - lse, rel=1e-6)
    assert codes[0] == 65535 and codes[3] == 0 and codes[4] == 0
    dec = np.float64(scale) * codes + np.float64(mlp)
    np.testing.assert_allclose(dec[[0, 1, 5]], x[[0, 1, 5]] - 10.0 - lse, atol=2e-4)


def test_import_round_trip(base, tmp_path):
    path, tokens, _, encoded, n_vocab = base
    out = tmp_path / "imported.qeval"
    assert import_llamacpp(path, out) == out
    with StoreReader(out, verify_chunks=True) as store, LlamaCppBaseFile(path) as f:
        assert store.complete and store.chunk_indices == [0, 1]
        assert store.header.source.startswith("llama.cpp") and store.header.label == "imported"
        np.testing.assert_array_equal(store.tokens, tokens)
        for c in range(N_CHUNKS):
            a, b = store.read_chunk(c), f.read_chunk(c)
            np.testing.assert_array_equal(a.logprob_target, b.logprob_target)
            np.testing.assert_array_equal(a.top_ids, b.top_ids)
            np.testing.assert_array_equal(a.codes(n_vocab), b.codes(n_vocab))
        # store and file compare as identical
        cmp = metrics.compare(f, store, threads=1)
        assert np.all(np.abs(cmp.per_token["kld"]) < 1e-12)
        assert cmp.per_token["same_top1"].all()
    # importing again is a no-op (already complete)
    before = out.read_bytes()
    import_llamacpp(path, out)
    assert out.read_bytes() == before


def test_ppl_of_a_llamacpp_file(base):
    path, tokens, _, encoded, _ = base
    nll = -np.concatenate([llama_decoded(encoded, c)[np.arange(N_SCORED), tokens[c, N_CTX // 2 + 1:]]
                           for c in range(N_CHUNKS)])
    result, _ = api.ppl_report(str(path))
    assert result["ppl"] == pytest.approx(math.exp(nll.mean()), rel=1e-5)


def test_kld_of_a_store_against_a_llamacpp_reference(base, tmp_path):
    """A llama.cpp reference compared with a qeval store of the same logits: tiny KLD (clamp at -16)."""
    from conftest import write_store

    path, tokens, logits, encoded, n_vocab = base
    store = write_store(tmp_path / "same.qeval", tokens, logits, n_vocab, label="same")
    with LlamaCppBaseFile(path) as f, StoreReader(store.path) as s:
        cmp = metrics.compare(f, s, threads=1)
    p_llama = np.concatenate([log_softmax64(llama_decoded(encoded, c)) for c in range(N_CHUNKS)])
    p_store = np.concatenate([decoded_logprobs(store.chunks[c].codes(n_vocab), store.lut)
                              for c in range(N_CHUNKS)])
    want = kld64(decoded_logprobs(np.concatenate([LlamaCppBaseFile(path).read_chunk(c).codes(n_vocab)
                                                  for c in range(N_CHUNKS)]), store.lut), p_store)
    np.testing.assert_allclose(cmp.per_token["kld"], want, rtol=1e-9, atol=1e-13)
    # the qeval store is ~exact, so the divergence is llama.cpp's own clamp/rounding loss
    exact = np.concatenate([log_softmax64(logits[c]) for c in range(N_CHUNKS)])
    np.testing.assert_allclose(kld64(p_llama, p_store), kld64(p_llama, exact), rtol=0.05, atol=2e-6)


def test_cli_import_and_compare(base, tmp_path):
    path, _, _, _, _ = base
    out = tmp_path / "imp.qeval"
    res = run_cli("import-llamacpp", path, out)
    assert res.returncode == 0, res.stderr
    assert "wrote" in res.stdout and out.is_file()
    res = run_cli("kld", "--ref", path, "--cand", out, "--chunks", "1", "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert abs(d["kld"]["mean"]) < 1e-12 and d["same_top1"]["fraction"] == 1.0


@pytest.mark.parametrize("cut", [2, 1000, "tokens"])
def test_truncated_llamacpp_file(base, cut):
    path, tokens, _, _, n_vocab = base
    data = path.read_bytes()
    keep = 8 + 12 + 4 * tokens.size - 10 if cut == "tokens" else len(data) - cut
    path.write_bytes(data[:keep])
    with pytest.raises(StoreFormatError, match="truncated"):
        LlamaCppBaseFile(path)
    if cut == 1000:
        msg = assert_cli_error(run_cli("info", path), "truncated", "base.kld")
        assert str(n_vocab) in msg


def test_oversized_and_malformed_llamacpp_files(tmp_path):
    rng = np.random.default_rng(3)
    tokens = make_tokens(rng, 1, N_CTX, 500)
    path = tmp_path / "x.kld"
    write_llamacpp_file(path, tokens, synth_logits(rng, tokens, 500), 500)
    good = path.read_bytes()
    path.write_bytes(good + b"\0" * 6)
    with pytest.raises(StoreFormatError, match="oversized"):
        LlamaCppBaseFile(path)
    bad_head = bytearray(good)
    bad_head[8:12] = np.array([-5], "<i4").tobytes()  # n_ctx = -5
    path.write_bytes(bytes(bad_head))
    with pytest.raises(StoreFormatError, match="implausible"):
        LlamaCppBaseFile(path)
    bad_tok = bytearray(good)
    bad_tok[20:24] = np.array([500], "<i4").tobytes()  # a token id == n_vocab
    path.write_bytes(bytes(bad_tok))
    with pytest.raises(StoreFormatError, match="outside the vocab"):
        LlamaCppBaseFile(path)
    bad_scale = bytearray(good)
    bad_scale[20 + 4 * tokens.size:24 + 4 * tokens.size] = np.array([np.nan], "<f4").tobytes()
    path.write_bytes(bytes(bad_scale))
    with LlamaCppBaseFile(path) as f:
        with pytest.raises(StoreFormatError, match="invalid scale"):
            f.read_chunk(0)
    path.write_bytes(b"_logits_\x01")
    with pytest.raises(StoreFormatError, match="bad magic"):
        LlamaCppBaseFile(path)


def test_concurrent_reads_of_a_llamacpp_file(tmp_path):
    rng = np.random.default_rng(4)
    tokens = make_tokens(rng, 6, 40, 800)  # 19 scored tokens: two blocks of reads per chunk
    path = tmp_path / "b.kld"
    write_llamacpp_file(path, tokens, synth_logits(rng, tokens, 800), 800)
    import_llamacpp(path, tmp_path / "b.qeval")
    with LlamaCppBaseFile(path) as f, StoreReader(tmp_path / "b.qeval") as s:
        f._fh = SlowSeekFile(f._fh)
        cmp = metrics.compare(f, s, threads=4)
    assert np.all(np.abs(cmp.per_token["kld"]) < 1e-12)


def test_info_of_a_llamacpp_file(base):
    path, tokens, _, _, n_vocab = base
    d, text = api.info_report(str(path))
    assert d["complete"] and d["chunks_present"] == N_CHUNKS and d["scored_tokens"] == N_CHUNKS * N_SCORED
    assert d["size_bytes"] == path.stat().st_size == d["llamacpp_equivalent_bytes"]
    assert "bytes per scored token" in text
