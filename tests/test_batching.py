"""Batch sizes: several windows per llama_decode call, decode-ahead, and the default rule.

Real decodes of Gemma-3-270M at n_ctx 64 with flash attention off (on CPU its kernel depends on
how many tokens of a sequence share a ubatch; see docs/flash-attention-and-batches.md). The reference path is one window per
call; every other layout must give the very same float32 logits, and stores the very same bytes.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from qeval import api
from qeval.capture.capture import encoder_threads
from qeval.engine.engine import Engine, EngineSettings, available_cores
from qeval.inputs.corpus import load_corpus
from qeval.storage.store import StoreReader

N_CTX = 64
N_WINDOWS = 5  # not a multiple of the windows per call: the last call holds fewer
NO_FA = EngineSettings(flash_attn="off")
PIECES = EngineSettings(flash_attn="off", n_batch=32)  # each window in 32-token pieces


@pytest.fixture(scope="module")
def windows(models):
    with Engine(models["Q8_0"], N_CTX, NO_FA) as engine:
        tokens = engine.tokenize(load_corpus().text)
    return tokens[:N_WINDOWS * N_CTX].reshape(N_WINDOWS, N_CTX)


def decoded(model, windows: np.ndarray, flash_attn: str = "off", **batching) -> np.ndarray:
    """All scored logits [windows, n_scored, n_vocab], checking each call's rows come in order."""
    with Engine(model, N_CTX, EngineSettings(flash_attn=flash_attn, **batching)) as engine:
        positions = engine.scoring.positions(N_CTX)
        out = np.full((len(windows), len(positions), engine.n_vocab), np.nan, dtype=np.float32)
        expected = (0, 0)  # (window, row) the next rows must start at
        for call in engine.iter_calls(windows):
            assert sum(len(rows.logits) for rows in call) <= engine.max_scored_rows([positions])
            for rows in call:
                assert (rows.window, rows.first_row) == expected
                end = rows.first_row + len(rows.logits)
                np.testing.assert_array_equal(rows.positions, positions[rows.first_row:end])
                out[rows.window, rows.first_row:end] = rows.logits
                expected = (rows.window + 1, 0) if end == len(positions) else (rows.window, end)
        assert expected == (len(windows), 0)
    return out


@pytest.fixture(scope="module")
def one_per_call(models, windows):
    return decoded(models["Q8_0"], windows, n_batch=N_CTX)


@pytest.mark.parametrize("batching", [
    {"n_batch": 4 * N_CTX},  # 4 windows per call, one ubatch each
    {"n_batch": 2 * N_CTX, "n_ubatch": N_CTX},  # ubatches interleave 32 tokens of each window
    {"n_batch": 4 * N_CTX, "decode_ahead": True},
    {"n_batch": 32, "decode_ahead": True},  # pieces of a window
])
def test_layouts_give_the_logits_of_one_window_per_call(models, windows, one_per_call, batching):
    np.testing.assert_array_equal(decoded(models["Q8_0"], windows, **batching), one_per_call)


def test_a_short_last_call_is_decoded_like_a_full_one(models, windows):
    # Flash attention on: on CPU its kernel depends on the tokens of a sequence per ubatch, 32 in a
    # call of 4 windows here but 64 if the fifth window went alone, so the last call is filled up.
    batching = {"flash_attn": "on", "n_batch": 4 * N_CTX, "n_ubatch": 2 * N_CTX}
    last_call = decoded(models["Q8_0"], windows, **batching)[4]
    full_call = decoded(models["Q8_0"], windows[1:], **batching)[3]
    np.testing.assert_array_equal(last_call, full_call)


def test_decode_ahead_stops_cleanly_when_abandoned(models, windows):
    engine = Engine(models["Q8_0"], N_CTX, EngineSettings(flash_attn="off", n_batch=N_CTX, decode_ahead=True))
    calls = engine.iter_calls(windows)
    next(calls)  # the second window is now decoding in the background
    engine.close()  # waits for it instead of freeing the context under it
    calls.close()


def read_store(path):
    with StoreReader(path, verify_chunks=True) as store:
        chunks = [store.read_chunk(i) for i in store.chunk_indices]
        return store.header, [(bytes(c.codes_zst), c.logprob_target, c.top_ids) for c in chunks]


def assert_same_chunks(a, b):
    assert len(a) == len(b)
    for (zst_a, lt_a, top_a), (zst_b, lt_b, top_b) in zip(a, b):
        assert zst_a == zst_b
        np.testing.assert_array_equal(lt_a, lt_b)
        np.testing.assert_array_equal(top_a, top_b)


def test_capture_in_groups_writes_the_same_store(models, tmp_path):
    runs = tmp_path / "runs"
    api.capture_store(str(models["Q8_0"]), "pieces", runs_dir=runs, n_ctx=N_CTX, chunks=N_WINDOWS, settings=PIECES)
    proc = subprocess.run([sys.executable, "-m", "qeval", "capture", str(models["Q8_0"]), "--label", "groups",
                           "-c", str(N_CTX), "--chunks", str(N_WINDOWS), "-fa", "off", "-b", str(4 * N_CTX),
                           "-ub", str(2 * N_CTX), "--decode-ahead", "--runs-dir", str(runs)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    pieces_header, pieces = read_store(runs / "pieces.qeval")
    groups_header, groups = read_store(runs / "groups.qeval")
    assert_same_chunks(groups, pieces)
    assert (pieces_header.capture["n_batch"], pieces_header.capture["n_ubatch"]) == (32, 32)
    assert (groups_header.capture["n_batch"], groups_header.capture["n_ubatch"]) == (4 * N_CTX, 2 * N_CTX)


def test_live_candidate_in_groups_resumes_and_equals_capture(models, tmp_path):
    runs = tmp_path / "runs"
    api.capture_store(str(models["Q8_0"]), "ref", runs_dir=runs, n_ctx=N_CTX, chunks=N_WINDOWS, settings=NO_FA)
    api.capture_store(str(models["Q2_K"]), "q2", runs_dir=runs, n_ctx=N_CTX, chunks=N_WINDOWS, settings=PIECES,
                      reference_form="logits")  # coded, as the live candidate saved with --save is
    stored, _ = api.kld_report("ref", "q2", runs_dir=runs)
    groups = EngineSettings(flash_attn="off", n_batch=4 * N_CTX, decode_ahead=True)
    live, _ = api.kld_report("ref", str(models["Q2_K"]), runs_dir=runs, settings=groups, save="q2live")
    assert live["kld"] == stored["kld"] and live["perplexity"] == stored["perplexity"]
    assert_same_chunks(read_store(runs / "q2live.qeval")[1], read_store(runs / "q2.qeval")[1])
    # interrupted after two chunks: chunks 2, 3 and 4 are decoded in one call
    path = runs / "q2live.qeval"
    with StoreReader(path) as store:
        cut = store.chunk_offsets[2]
    with open(path, "r+b") as fh:
        fh.truncate(cut)
    resumed, _ = api.kld_report("ref", str(models["Q2_K"]), runs_dir=runs, settings=groups, save="q2live")
    assert resumed["kld"] == stored["kld"]
    assert_same_chunks(read_store(path)[1], read_store(runs / "q2.qeval")[1])


def test_default_batch_rule(monkeypatch):
    import llama_cpp

    cpu, gpu = EngineSettings(), EngineSettings(n_gpu_layers=99)
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: False)
    assert gpu.batch_sizes(512) == (128, 128) and not gpu.decodes_ahead  # -ngl on a CPU-only build
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
    assert cpu.batch_sizes(512) == (128, 128) and not cpu.decodes_ahead
    assert gpu.batch_sizes(512) == (2048, 512) and gpu.decodes_ahead  # llama-perplexity's -b 2048 -ub 512
    assert gpu.batch_sizes(4096) == (2048, 512)  # windows longer than a call: pieces, as llama-perplexity
    assert EngineSettings(n_batch=1500).batch_sizes(512) == (1024, 512)  # whole windows per call
    assert EngineSettings(n_batch=300, n_ubatch=1000).batch_sizes(512) == (300, 300)
    assert EngineSettings(n_gpu_layers=99, decode_ahead=False).decodes_ahead is False
    assert encoder_threads(None, cpu) == available_cores()
    assert encoder_threads(None, EngineSettings(n_threads=3)) == 3 and encoder_threads(5, cpu) == 5


def test_batch_flags_are_checked(models, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "qeval", "capture", str(models["Q8_0"]), "--label", "x",
                           "-ub", "0", "--runs-dir", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode != 0 and "-ub/--ubatch-size must be at least 1" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "n_batch" not in EngineSettings(n_batch=256).as_json()  # not part of the store's identity
