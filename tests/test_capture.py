"""Real captures with Gemma-3-270M (vocab 262,144) at small n_ctx: seconds each."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple

import numpy as np
import pytest

from qeval import api
from qeval.engine.engine import Engine, EngineSettings
from qeval.errors import QevalError
from qeval.inputs.corpus import load_corpus
from qeval.storage.store import StoreReader

N_CTX = 64


@pytest.fixture
def runs(tmp_path):
    return tmp_path / "runs"


def run_cli(*args, check_ok=True, env=None):
    proc = subprocess.run([sys.executable, "-m", "qeval", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if check_ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_windows_tokens_and_bos_follow_llama_perplexity(models, runs):
    # flash attention off on both sides: on CPU its results depend on how tokens are batched
    api.capture_store(str(models["Q8_0"]), "ref", runs_dir=runs, n_ctx=N_CTX, chunks=3,
                      settings=EngineSettings(flash_attn="off"))
    with StoreReader(runs / "ref.qeval") as store, Engine(models["Q8_0"], N_CTX) as engine:
        tokens = engine.tokenize(load_corpus().text)
        assert tokens[0] == engine.bos and engine.add_bos
        np.testing.assert_array_equal(store.tokens, tokens[:3 * N_CTX].reshape(3, N_CTX))
        assert store.header.n_scored == N_CTX - 1 - N_CTX // 2 == 31
        chunk = store.read_chunk(1)
    # Independent path: llama-cpp-python's high-level API with all logits, the window's first
    # token replaced by BOS, positions from 0; scored rows are positions 32..62 predicting 33..63.
    import llama_cpp

    llm = llama_cpp.Llama(str(models["Q8_0"]), n_ctx=N_CTX, n_batch=N_CTX, logits_all=True, verbose=False,
                          n_threads=2, flash_attn=False)
    window = tokens[N_CTX:2 * N_CTX].copy()
    window[0] = llm.token_bos()
    llm.eval(window.tolist())
    logits = llm.scores[N_CTX // 2:N_CTX - 1].astype(np.float64)
    logp = logits - logits.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    expected = logp[np.arange(31), window[N_CTX // 2 + 1:]]
    np.testing.assert_allclose(chunk.logprob_target, expected, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(chunk.top_ids[:, 0], np.argmax(logits, axis=1))


RESUME_CHUNKS = 12  # the kill comes at 3 chunks, polled every 50 ms: ~9 chunks (seconds) of room


def test_rerun_is_a_noop_and_resume_after_kill(models, runs):
    proc = subprocess.Popen([sys.executable, "-m", "qeval", "capture", str(models["Q8_0"]), "--label", "ref",
                             "-c", "128", "--chunks", str(RESUME_CHUNKS), "--runs-dir", str(runs)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    path = runs / "ref.qeval"
    deadline = time.time() + 120
    while time.time() < deadline:
        if path.exists():
            try:
                with StoreReader(path, tolerate_torn_tail=True) as s:
                    if len(s.chunk_indices) >= 3:
                        break
            except QevalError:
                pass
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with StoreReader(path, tolerate_torn_tail=True) as partial:  # a hidden chunk is read while its store is open
        assert not partial.complete
        kept = {i: (partial.read_chunk(i).codes(partial.header.n_vocab), partial.read_chunk(i).logprob_target)
                for i in partial.chunk_indices}
    assert 3 <= len(kept) < RESUME_CHUNKS
    out = run_cli("capture", str(models["Q8_0"]), "--label", "ref", "-c", "128", "--chunks", str(RESUME_CHUNKS),
                  "--runs-dir", str(runs))
    assert f"({RESUME_CHUNKS - len(kept)} captured now)" in out.stdout
    with StoreReader(path, verify_chunks=True) as store:
        assert store.complete and store.chunk_indices == list(range(RESUME_CHUNKS))
        for i, (codes, logprob_target) in kept.items():  # earlier chunks untouched
            new = store.read_chunk(i)
            np.testing.assert_array_equal(new.codes(store.header.n_vocab), codes)
            np.testing.assert_array_equal(new.logprob_target, logprob_target)
    again = run_cli("capture", str(models["Q8_0"]), "--label", "ref", "-c", "128", "--chunks", str(RESUME_CHUNKS),
                    "--runs-dir", str(runs))
    assert "already complete" in again.stdout


def test_live_candidate_equals_stored_candidate(models, runs):
    api.capture_store(str(models["Q8_0"]), "ref", runs_dir=runs, n_ctx=N_CTX, chunks=3)
    live, _ = api.kld_report("ref", str(models["Q2_K"]), runs_dir=runs, save="q2")
    stored, _ = api.kld_report("ref", "q2", runs_dir=runs)
    for key in ("perplexity", "kld", "kld_reverse", "delta_p", "same_top1", "top5_agreement"):
        assert live[key] == stored[key]
    assert live["kld"]["mean"] > 0.05  # Q2_K really differs from Q8_0
    # a separately captured store of the same model in the logits form gives the same numbers too
    api.capture_store(str(models["Q2_K"]), "q2cap", runs_dir=runs, n_ctx=N_CTX, chunks=3, reference_form="logits")
    captured, _ = api.kld_report("ref", "q2cap", runs_dir=runs)
    assert captured["kld"] == stored["kld"]
    # in the default form, here its lean pieces code llama.cpp's own logits (replayed by ggml): the same numbers;
    # certified, they code the portable replay's rows, what any machine reads: within its error
    api.capture_store(str(models["Q2_K"]), "q2auto", runs_dir=runs, n_ctx=N_CTX, chunks=3)
    with StoreReader(runs / "q2auto.qeval") as q2auto:
        assert q2auto.header.hidden and q2auto.lean_pieces() == 3
    auto, _ = api.kld_report("ref", "q2auto", runs_dir=runs)
    assert auto["kld"] == stored["kld"]
    api.certify_report("q2auto", runs_dir=runs)
    auto, _ = api.kld_report("ref", "q2auto", runs_dir=runs)
    assert auto["kld"]["mean"] == pytest.approx(stored["kld"]["mean"], rel=1e-5)
    assert auto["kld"] != stored["kld"]


def test_live_candidate_uncoded_equals_coded_within_the_code_floor(models, runs):
    """Without --save the candidate's float32 logits meet the reference's codes directly; coding them first
    (--save) moves each token's KLD only by the code's rounding (noise floor ~4e-7 nats, README)."""
    from qeval.capture.capture import LiveLogitsChunk

    api.capture_store(str(models["Q8_0"]), "ref", runs_dir=runs, n_ctx=N_CTX, chunks=3)
    settings = EngineSettings(n_batch=24)  # 3 decode calls per window: rows cross call borders
    uncoded = api.compare("ref", str(models["Q2_K"]), runs_dir=runs, settings=settings)
    coded = api.compare("ref", str(models["Q2_K"]), runs_dir=runs, settings=settings, save="q2")
    a, b = uncoded.per_token, coded.per_token
    assert isinstance(uncoded.cand.read_chunk(0), LiveLogitsChunk)
    assert np.abs(a["kld"] - b["kld"]).max() < 2e-5 and abs(a["kld"].mean() - b["kld"].mean()) < 2e-6
    assert a["kld"].mean() > 0.05  # Q2_K really differs from Q8_0
    np.testing.assert_allclose(a["nll_cand"], b["nll_cand"], rtol=0, atol=1e-6)  # exact scalars on both paths
    np.testing.assert_array_equal(a["nll_ref"], b["nll_ref"])
    for key in ("same_top1", "top5_agreement", "top10_agreement", "token", "position"):
        np.testing.assert_array_equal(a[key], b[key])


def test_kv_cache_types_and_flash_attention_rule(models, runs):
    api.capture_store(str(models["Q8_0"]), "ref", runs_dir=runs, n_ctx=N_CTX, chunks=2)
    result, _ = api.kld_report("ref", str(models["Q8_0"]), runs_dir=runs,
                               settings=EngineSettings(type_k="q8_0", type_v="q8_0", flash_attn="on"))
    assert 0 < result["kld"]["mean"] < 0.05
    assert result["candidate"]["kv"] == {"type_k": "q8_0", "type_v": "q8_0", "flash_attn": "on",
                                          "rotation": {"k": True, "v": True}}  # Gemma-3: 256-wide heads
    bad = run_cli("kld", "--ref", "ref", "--cand", str(models["Q8_0"]), "-ctv", "q4_0", "-fa", "off",
                  "--runs-dir", str(runs), check_ok=False)
    assert bad.returncode != 0 and "needs flash attention" in bad.stderr and "Traceback" not in bad.stderr
    bad = run_cli("capture", str(models["Q8_0"]), "--label", "x", "-ctk", "q3_k", "--runs-dir", str(runs),
                  check_ok=False)
    assert bad.returncode != 0 and "unknown KV cache type" in bad.stderr


@pytest.mark.parametrize("args, message", [
    (["capture", "/nonexistent/model.gguf", "--label", "x"], "does not exist"),
    (["capture", "__README__", "--label", "x"], "not a GGUF model file"),
    (["capture", "__MODEL__", "--label", "x", "--corpus", "__SHORT__"], "needs 512 tokens of one document"),
    (["capture", "__MODEL__", "--label", "x", "--chunks", "100000"], "asks for more"),
    (["capture", "__MODEL__", "--label", "bad/label"], "label"),
])
def test_capture_bad_input(models, runs, tmp_path, args, message):
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.")
    subst = {"__MODEL__": str(models["Q8_0"]), "__SHORT__": str(short),
             "__README__": str(tmp_path / "fake.gguf")}
    (tmp_path / "fake.gguf").write_text("not a model")
    proc = run_cli(*[subst.get(a, a) for a in args], "--runs-dir", str(runs), check_ok=False)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_disk_full_keeps_store_valid_up_to_last_chunk(models, runs, monkeypatch):
    from qeval.storage import store as store_mod

    real = store_mod.StoreWriter.write_chunk
    calls = {"n": 0}

    def failing(self, chunk):
        calls["n"] += 1
        if calls["n"] == 3:
            # a partial record reaches the disk, then the device is full
            self._fh.write(b"CHNK" + b"\0" * 100)
            self._fh.flush()
            raise OSError(28, "No space left on device")
        return real(self, chunk)

    monkeypatch.setattr(store_mod.StoreWriter, "write_chunk", failing)
    with pytest.raises(OSError):
        api.capture_store(str(models["Q8_0"]), "ref", runs_dir=runs, n_ctx=N_CTX, chunks=4)
    monkeypatch.setattr(store_mod.StoreWriter, "write_chunk", real)
    with StoreReader(runs / "ref.qeval", tolerate_torn_tail=True) as partial:
        assert partial.chunk_indices == [0, 1] and not partial.complete
    api.capture_store(str(models["Q8_0"]), "ref", runs_dir=runs, n_ctx=N_CTX, chunks=4)
    with StoreReader(runs / "ref.qeval", verify_chunks=True) as store:
        assert store.complete and store.chunk_indices == [0, 1, 2, 3]


def test_real_enospc_write_is_reported_and_store_stays_valid(models, runs, tmp_path, monkeypatch):
    """A real full filesystem (tmpfs), where this machine lets us mount one. The capture is refused before it
    starts (qeval.orchestrate.budget sees the room is short); with the free space misreported as ample (a disk that
    other writers fill meanwhile), the write that hits ENOSPC is reported and the store stays valid."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        proc = run_cli("capture", str(models["Q8_0"]), "--label", "ref", "-c", str(N_CTX), "--chunks", "12",
                       "--out", str(mnt / "ref.qeval"), check_ok=False)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        assert "not enough disk space" in proc.stderr and not (mnt / "ref.qeval").exists()
        ample = namedtuple("Usage", "total used free")(1 << 40, 0, 1 << 40)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: ample)
        # the hidden form's head (178 MB) is what fills this disk: nothing is kept
        with pytest.raises(QevalError, match="cannot create store .*nothing was kept"):
            api.capture_store(str(models["Q8_0"]), "ref", out=str(mnt / "ref.qeval"), n_ctx=N_CTX, chunks=12)
        assert not (mnt / "ref.qeval").exists()
        with pytest.raises(QevalError, match="resume"):  # the logits form fills it chunk by chunk
            api.capture_store(str(models["Q8_0"]), "ref", out=str(mnt / "ref.qeval"), n_ctx=N_CTX, chunks=12,
                              reference_form="logits")
        with StoreReader(mnt / "ref.qeval", verify_chunks=True, tolerate_torn_tail=True) as partial:
            assert 1 <= len(partial.chunk_indices) < 12 and not partial.complete
    finally:
        subprocess.run(["umount", str(mnt)])


def test_candidate_with_another_vocab_is_refused(models, runs, tmp_path):
    from conftest import make_tokens, realistic_logits, write_store  # synthetic stores (tests/conftest.py)

    rng = np.random.default_rng(5)
    runs.mkdir()
    tokens = make_tokens(rng, 2, N_CTX, 1000)
    write_store(runs / "tiny.qeval", tokens, {c: realistic_logits(rng, 31, 1000) for c in range(2)}, 1000)
    proc = run_cli("kld", "--ref", "tiny", "--cand", str(models["Q8_0"]), "--runs-dir", str(runs), check_ok=False)
    assert proc.returncode != 0 and "vocab size differs" in proc.stderr and "Traceback" not in proc.stderr


def test_model_facts_in_store_and_report(models, runs):
    api.capture_store(str(models["Q4_K_M"]), "q4", runs_dir=runs, n_ctx=N_CTX, chunks=2)
    info, text = api.info_report("q4", runs_dir=runs)
    model = info["header"]["model"]
    assert model["quant"] == "Q4_K_M" and model["architecture"] == "gemma3"
    assert model["vocab_size"] == 262144 and model["n_params"] > 2e8
    assert 4 < model["bits_per_weight"] < 9 and model["file_size"] == models["Q4_K_M"].stat().st_size
    assert "Q4_K" in model["tensor_types"]
    assert info["header"]["corpus"]["n_tokens"] >= 41_000  # the shipped corpus fills 80 chunks of 512
    assert info["header"]["kv"]["type_k"] == "f16"
    json.dumps(info)
