"""Backends (qeval.engine.backends): a backend that is not llama.cpp, registered from here (tests/replay_backend.py),
captures through the normal capture() path and runs as a live candidate; the stores and numbers are those of
its logits written straight through the codec (tests/conftest.py)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import replay_backend
from conftest import decoded_logprobs, kld64, log_softmax64, make_tokens, realistic_logits, write_store

from qeval import api
from qeval.capture.capture import CaptureSpec, capture, open_live
from qeval.compare import metrics
from qeval.engine.backends import open_backend
from qeval.engine.engine import EngineSettings
from qeval.errors import QevalError
from qeval.storage.scoring import HALF
from qeval.storage.store import StoreReader

V, N_CTX, N = 300, 32, 3
REPLAY = EngineSettings(backend=replay_backend.NAME, n_threads=1)


@pytest.fixture
def replayed(tmp_path):
    """(saved logits file, corpus file, windows, logits of every position)."""
    replay_backend.register()
    rng = np.random.default_rng(3)
    windows = make_tokens(rng, N, N_CTX, V)
    logits = np.stack([realistic_logits(rng, N_CTX, V) for _ in range(N)])
    corpus = tmp_path / "ids.txt"
    corpus.write_text(replay_backend.corpus_text(windows))
    return replay_backend.save_replay(tmp_path / "model.npz", windows, logits), corpus, windows, logits


def test_capture_through_another_backend_equals_its_logits_coded(replayed, tmp_path):
    model, corpus, windows, logits = replayed
    res = capture(CaptureSpec(model=str(model), out=str(tmp_path / "replay.qeval"), label="replay",
                              corpus=str(corpus), n_ctx=N_CTX, settings=REPLAY, threads=1))
    positions = HALF.positions(N_CTX)
    direct = write_store(tmp_path / "direct.qeval", windows, {c: logits[c][positions] for c in range(N)}, V)
    with StoreReader(res.path, verify_chunks=True) as store:
        assert store.complete and store.header.kv["backend"] == replay_backend.NAME
        assert store.header.model["file_name"] == "model.npz" and not store.header.capture["bos_substituted"]
        np.testing.assert_array_equal(store.tokens, windows)
        for c in range(N):
            got, want = store.read_chunk(c), direct.chunks[c]
            np.testing.assert_array_equal(got.codes(V), want.codes(V))
            np.testing.assert_array_equal(got.top_ids, want.top_ids)
            exact = log_softmax64(logits[c][positions])[np.arange(len(positions)), direct.targets(c)]
            np.testing.assert_allclose(got.logprob_target, exact, rtol=0, atol=1e-5)
    same, _ = api.kld_report(str(direct.path), str(res.path))
    assert same["kld"]["mean"] == 0.0


def test_live_candidate_through_another_backend(replayed, tmp_path):
    """Its own logits, live and uncoded (open_live as `qeval kld` opens a GGUF), against their coded store:
    the codec's error alone, per token as float64 computes it from the codes and the logits."""
    model, _, windows, logits = replayed
    positions = HALF.positions(N_CTX)
    direct = write_store(tmp_path / "direct.qeval", windows, {c: logits[c][positions] for c in range(N)}, V)
    with StoreReader(direct.path) as ref:
        backend, live = open_live(str(model), ref, None, REPLAY, "live", None)
        with contextlib.closing(backend), contextlib.closing(live):
            assert live.header.model["file_name"] == "model.npz" and live.header.capture["live_against"] == "synth"
            kld = metrics.compare(ref, live, threads=1).per_token["kld"]
    expected = np.concatenate([kld64(decoded_logprobs(direct.chunks[c].codes(V), direct.lut),
                                     log_softmax64(logits[c][positions])) for c in range(N)])
    np.testing.assert_allclose(kld, expected, rtol=1e-3, atol=1e-7)


def test_an_unknown_backend_is_one_message(tmp_path):
    with pytest.raises(QevalError, match="unknown backend 'nope'; registered backends: llama.cpp"):
        open_backend(str(tmp_path / "m.gguf"), N_CTX, EngineSettings(backend="nope"), HALF)
