"""One end-to-end check at a real vocab size (262,144, Gemma-3) with a handful of tokens."""

from __future__ import annotations

import numpy as np
from conftest import (
    decoded_logprobs,
    kld64,
    log_softmax64,
    make_tokens,
    perturb,
    realistic_logits,
    stable_topk,
    write_store,
)

from qeval.compare import metrics
from qeval.compare.kernels import N_SUMS, decode_tables, kld_from_sums, pair_sums
from qeval.storage.codec import SqrtLogCode
from qeval.storage.store import StoreReader, codes_to_planes

V = 262_144


def test_vocab_262144_codec_kernel_store_and_compare(tmp_path):
    rng = np.random.default_rng(262144)
    n_ctx = 10  # 4 scored tokens per chunk
    tokens = make_tokens(rng, 1, n_ctx, V)
    ref_logits = realistic_logits(rng, 4, V, n_dominant=4)
    ref_logits[0, rng.choice(V, 5000, replace=False)] = -np.inf  # a masked slice of the vocab
    ref_logits[1, :] += 25.0  # large absolute logits, as real models emit
    cand_logits = perturb(rng, ref_logits, 0.5)
    targets = tokens[0, n_ctx // 2 + 1:]
    code = SqrtLogCode()
    lut = code.lut()

    # codec: exact scalars, top-k, noise floor
    enc = code.encode_block(ref_logits, targets)
    ls = log_softmax64(ref_logits)
    rows = np.arange(4)
    np.testing.assert_allclose(enc.logprob_target, ls[rows, targets], atol=1e-6, rtol=0)
    np.testing.assert_allclose(enc.logprob_max, ls.max(axis=1), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(enc.top_ids, stable_topk(ref_logits, 10))
    assert kld64(ls, decoded_logprobs(enc.codes, lut)).mean() < 2e-6

    # stores and the streaming comparison
    ref = write_store(tmp_path / "ref.qeval", tokens, {0: ref_logits}, V, label="ref")
    cand = write_store(tmp_path / "cand.qeval", tokens, {0: cand_logits}, V, label="cand")
    with StoreReader(ref.path, verify_chunks=True) as r, StoreReader(cand.path) as c:
        chunk = r.read_chunk(0)
        np.testing.assert_array_equal(chunk.codes(V), enc.codes)
        np.testing.assert_array_equal(chunk.logprob_target, enc.logprob_target)
        cmp = metrics.compare(r, c, threads=1)
    lp = decoded_logprobs(ref.chunks[0].codes(V), lut)
    lq = decoded_logprobs(cand.chunks[0].codes(V), lut)
    np.testing.assert_allclose(cmp.per_token["kld"], kld64(lp, lq), rtol=1e-9)
    np.testing.assert_allclose(cmp.per_token["kld_reverse"], kld64(lq, lp), rtol=1e-9)
    exact = kld64(ls, log_softmax64(cand_logits))
    assert exact.mean() > 0.05
    assert abs(cmp.per_token["kld"].mean() / exact.mean() - 1) < 1e-3
    np.testing.assert_array_equal(cmp.per_token["same_top1"],
                                  np.argmax(ref_logits, axis=1) == np.argmax(cand_logits, axis=1))

    # the kernel directly, on the last token
    out = np.empty((1, N_SUMS))
    pair_sums(codes_to_planes(ref.chunks[0].codes(V)[3:]), codes_to_planes(cand.chunks[0].codes(V)[3:]),
              *decode_tables(lut), *decode_tables(lut), out)
    fwd, rev = kld_from_sums(out)
    np.testing.assert_allclose(fwd, kld64(lp[3:], lq[3:]), rtol=1e-9)
    np.testing.assert_allclose(rev, kld64(lq[3:], lp[3:]), rtol=1e-9)
