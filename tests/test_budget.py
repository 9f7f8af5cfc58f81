"""A first run that cannot surprise (qeval.orchestrate.budget): every long command says up front what it will write
and roughly how long it takes, and refuses, in one message, when the disk it writes to has not the room: the bytes
it needs, the bytes free, the flag that writes less. Free space is mocked (shutil.disk_usage); expected byte counts
are worked out here from the store format's documented figures. And a GGUF given where a reference store belongs is
refused with the commands that capture it and then compare against it."""

from __future__ import annotations

import math
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from conftest import assert_cli_error, make_pair, run_cli
from test_backends import N, N_CTX, REPLAY, V, replayed  # noqa: F401 - replayed: the backend's model and corpus

from qeval import api
from qeval.engine.engine import EngineSettings
from qeval.errors import QevalError
from qeval.orchestrate import budget
from qeval.storage.scoring import HALF

Usage = namedtuple("Usage", "total used free")
# the store format's figures (docs/store-format.md): 132,203 bytes per scored token at a 262,144 vocab, 56 of them
# the two float64 log-probs and ten int32 top ids; since version 4 its error record too: two float64 and a float32
# min and max for each of 32 bands (272 bytes), and 40 bytes of an ERRS record per piece of <= 256 rows, counted as
# one byte a row; per store its int32 tokens and the 65,536-entry float32 table
PER_TOKEN_262K, FIXED_PER_ROW, ERROR_PER_ROW, TABLE = 132_203, 56, 16 + 32 * 8 + 1, 65_536 * 4


def store_bytes(windows: int, n_ctx: int, rows: int, n_vocab: int) -> int:
    per_entry = (PER_TOKEN_262K - FIXED_PER_ROW) / 262_144
    return math.ceil(TABLE + 4 * windows * n_ctx + rows * (FIXED_PER_ROW + ERROR_PER_ROW + n_vocab * per_entry))


# Gemma-3-270M Q8_0's output head, as a default (auto) capture embeds it (test_a_hidden_store_...: measured bytes)
GEMMA_HEAD = {"form": "auto", "type": "Q8_0", "n_embd": 640, "bytes": 178_257_920}


def reference_bytes(windows: int, n_ctx: int, rows: int) -> int:
    """A default capture of Gemma-3-270M Q8_0: the hidden form, its head once."""
    return budget.Run("R", 1, windows * n_ctx, rows, 262_144, live=False, keeps_store=True, head=GEMMA_HEAD).bytes


@pytest.fixture
def free_space(monkeypatch):
    """Set the free bytes every disk reports: free_space(n)."""
    def set_free(n: int) -> None:
        monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 * n + 1, 9 * n, n))
    return set_free


# --------------------------------------------------------------------------------------------------
# the estimate reproduces the measurements its constants come from
# --------------------------------------------------------------------------------------------------
TWO = EngineSettings(n_threads=2)


def test_time_rates_give_back_the_measured_runs():
    """2-core Intel Xeon, Gemma-3-270M, 16 windows of 512 (4,080 scored): capture of the Q8_0 38.5 s, the Q2_K live
    (not coded) 35.2 s (docs/benchmarks.md)."""
    capture = budget.Run("Q8_0", 291_543_744, 16 * 512, 4080, 262_144, live=False, keeps_store=True, settings=TWO)
    live = budget.Run("Q2_K", 237_077_184, 16 * 512, 4080, 262_144, live=True, keeps_store=False, settings=TWO)
    assert capture.seconds == pytest.approx(38.5, rel=0.02)
    assert live.seconds == pytest.approx(35.2, rel=0.02)
    # twice the threads, half the time; no estimate on a GPU
    assert budget.Run(**{**capture.__dict__, "settings": EngineSettings(n_threads=4)}).seconds == \
        pytest.approx(capture.seconds / 2)
    assert budget.Run(**{**capture.__dict__, "settings": EngineSettings(n_gpu_layers=99)}).seconds is None


def test_an_early_board_says_its_range_from_the_minimum_to_every_chunk(tmp_path):
    """`--early` over 80 chunks: the reference captures every chunk, each of 3 pairs runs 8 to 80 of them; the time
    is said from every pair at its minimum to every chunk (not the full run's alone: the demo's said 29 min and
    took 4), the bytes as the most it can write."""
    capture = budget.Run("R", 291_543_744, 80 * 512, 80 * 255, 262_144, live=False, keeps_store=True, settings=TWO)
    pair = budget.Run("P", 237_077_184, 80 * 512, 80 * 255, 262_144, live=True, keeps_store=False,
                      keeps_result=True, settings=TWO)
    full = budget.Budget(what="matrix: reference R + 3 pairs", runs=(capture, pair, pair, pair), directory=tmp_path, chunks=80)
    early = budget.Budget(what=full.what, runs=full.runs, directory=tmp_path, chunks=80, early_min_chunks=8)
    whole, least = capture.seconds + 3 * pair.seconds, capture.seconds + 3 * pair.seconds * 8 / 80
    assert budget.time_text(least) != budget.time_text(whole)
    text = early.text(10**12)
    assert "decided early: each pair 8 to 80 chunks (24 to 240 pair-chunks)" in text
    assert f"roughly {budget.time_text(least)} (every pair at its minimum) to {budget.time_text(whole)} on 2 CPU " \
           "threads" in text
    assert f"writes up to ~{budget.size_text(full.bytes)}" in text and early.bytes == full.bytes
    plain = full.text(10**12)
    assert f"; roughly {budget.time_text(whole)} on 2 CPU threads" in plain and "decided early" not in plain
    # a corpus shorter than the minimum: every pair runs it all
    short = budget.Budget(what=full.what, runs=full.runs, directory=tmp_path, chunks=80, early_min_chunks=100).text(10**12)
    assert "each pair 80 to 80 chunks" in short and f"roughly {budget.time_text(whole)} (every pair" in short


def test_store_bytes_bound_the_demos_measured_disk():
    """The demo wrote 21.7 GB: 9 stores (reference, 6 candidates, control, floor) of 20,400 scored tokens."""
    runs = [budget.Run(f"s{i}", 1, 80 * 512, 20_400, 262_144, live=i > 0, keeps_store=True, keeps_result=i > 0)
            for i in range(9)]
    total = sum(r.bytes for r in runs)
    assert 21.7e9 <= total <= 1.15 * 21.7e9
    assert runs[0].bytes == store_bytes(80, 512, 20_400, 262_144)


# --------------------------------------------------------------------------------------------------
# capture: refused before a window is decoded, nothing left behind
# --------------------------------------------------------------------------------------------------
def test_capture_refuses_a_disk_too_small_and_leaves_no_store(replayed, tmp_path, free_space, capsys):
    model, corpus, _, _ = replayed
    needed = store_bytes(N, N_CTX, N * len(HALF.positions(N_CTX)), V)
    free = needed // 2  # room for one of the three windows
    free_space(free)
    runs = tmp_path / "runs"
    with pytest.raises(QevalError) as err:
        api.capture_store(str(model), "R", runs_dir=runs, corpus=str(corpus), n_ctx=N_CTX, settings=REPLAY,
                          progress=True)
    assert str(err.value) == (
        f"not enough disk space in {runs}: capture R needs ~{budget.size_text(needed)} ({needed:,} bytes), "
        f"{budget.size_text(free)} ({free:,} bytes) are free. Write less: --chunks 1 writes "
        f"~{budget.size_text(needed / 3)}; or point --out or --runs-dir at a larger disk")
    assert not list(runs.glob("*.qeval"))  # the store file the capture had opened is gone
    said = capsys.readouterr().err
    assert f"qeval: capture R: 3 chunks, writes ~{budget.size_text(needed)} to {runs} (1 store of " \
           f"{N * len(HALF.positions(N_CTX))} scored tokens); {budget.size_text(free)} free there; roughly" in said


def test_capture_with_room_says_what_it_writes_and_writes_it(replayed, tmp_path, free_space, capsys):
    model, corpus, _, _ = replayed
    free_space(10**12)
    out, _ = api.capture_store(str(model), "R", runs_dir=tmp_path / "runs", corpus=str(corpus), n_ctx=N_CTX,
                               settings=REPLAY, progress=True)
    assert out["status"] == "complete"
    assert "qeval: capture R: 3 chunks, writes ~" in capsys.readouterr().err
    # quiet without progress (the API's callers, notebooks)
    api.capture_store(str(model), "R2", runs_dir=tmp_path / "runs", corpus=str(corpus), n_ctx=N_CTX, settings=REPLAY)
    assert "writes" not in capsys.readouterr().err


def test_capture_cli_refuses_with_one_message(models, tmp_path, free_space):
    """The real command on Gemma-3-270M: 4 windows of 512, 255 scored tokens each, at a 262,144 vocab."""
    free_space(50_000_000)
    needed = reference_bytes(4, 512, 4 * 255)
    res = run_cli("capture", models["Q8_0"], "--label", "Q8_0", "--chunks", 4, "--runs-dir", tmp_path / "runs")
    per_chunk = budget.size_text((needed - GEMMA_HEAD["bytes"]) / 4)
    assert_cli_error(res, f"capture Q8_0 needs ~{budget.size_text(needed)} ({needed:,} bytes)",
                     "50.0 MB (50,000,000 bytes) are free",  # the head alone does not fit: no chunk count does
                     f"--chunks N writes ~{per_chunk} per chunk plus ~178.3 MB once (the hidden form's output head)")
    free_space(179_000_000)  # the head and two chunks fit
    res = run_cli("capture", models["Q8_0"], "--label", "Q8_0", "--chunks", 4, "--runs-dir", tmp_path / "runs")
    two = GEMMA_HEAD["bytes"] + (needed - GEMMA_HEAD["bytes"]) / 2
    assert_cli_error(res, f"--chunks 2 writes ~{budget.size_text(two)}")
    assert "qeval: capture Q8_0: 4 chunks, writes ~" in res.stderr and "CPU threads" in res.stderr
    assert not list((tmp_path / "runs").glob("*.qeval"))


# --------------------------------------------------------------------------------------------------
# kld with a live candidate, matrix, demo
# --------------------------------------------------------------------------------------------------
def fake_gguf(path: Path, size: int = 4096) -> Path:
    path.write_bytes(b"GGUF" + bytes(size - 4))
    return path


def test_kld_live_with_save_refuses_before_loading_the_model(tmp_path, free_space):
    """The model is never opened (it is not a real GGUF): the check comes first."""
    pair = make_pair(tmp_path / "runs")
    h = pair.ref.header
    needed = store_bytes(h.n_chunks, h.n_ctx, h.n_chunks * h.n_scored, h.n_vocab)
    free_space(100)
    res = run_cli("kld", "--ref", "REF", "--cand", fake_gguf(tmp_path / "cand.gguf"), "--save", "C",
                  "--runs-dir", pair.directory)
    assert_cli_error(res, f"kld C live against REF needs ~{budget.size_text(needed)} ({needed:,} bytes)",
                     "100 bytes (100 bytes) are free", "--chunks")
    assert not (pair.directory / "C.qeval").exists()


@pytest.mark.parametrize("keep_logits", [False, True])
def test_matrix_counts_the_reference_and_every_pair(models, tmp_path, free_space, keep_logits):
    """Reference Q8_0 to capture, Q2_K and the control live with their results, and with their stores only under
    --keep-logits, 2 windows of 512."""
    free_space(10_000_000)
    rows = 2 * 255
    needed = reference_bytes(2, 512, rows) + 2 * (64_000 + rows * 8 * 12)
    if keep_logits:  # a live pair's store is the logits code of its rows
        needed += 2 * store_bytes(2, 512, rows, 262_144)
    res = run_cli("matrix", "--ref", f"Q8_0={models['Q8_0']}", "-m", f"Q2_K={models['Q2_K']}", "--chunks", 2,
                  "--runs-dir", tmp_path / "runs", *(["--keep-logits"] if keep_logits else []))
    assert_cli_error(res, f"matrix: reference Q8_0 + 2 pairs needs ~{budget.size_text(needed)} ({needed:,} bytes)",
                     "(10,000,000 bytes) are free", "--chunks")
    assert "qeval: matrix: reference Q8_0 + 2 pairs: 2 chunks, writes ~" in res.stderr


def test_demo_refuses_a_models_disk_too_small(tmp_path, free_space):
    free_space(1000)
    res = run_cli("demo", "--models-dir", tmp_path / "models", "--runs-dir", tmp_path / "runs")
    assert_cli_error(res, "the demo's Gemma-3-270M GGUFs needs ~1.3 GB (1,265,104,320 bytes)", "1,000 bytes")
    assert not (tmp_path / "models").exists()


# --------------------------------------------------------------------------------------------------
# a GGUF where a reference store belongs
# --------------------------------------------------------------------------------------------------
def test_kld_with_a_gguf_reference_names_the_capture_command(tmp_path):
    ref = fake_gguf(tmp_path / "Qwen3.5-35B-A3B-Q8_0.gguf")
    res = run_cli("kld", "--ref", ref, "--cand", "B-Q4_K_M.gguf", "--chunks", 20, "-ngl", 99,
                  "--runs-dir", tmp_path / "runs")
    msg = assert_cli_error(res, "is a GGUF model, not a store",
                           f"`qeval capture {ref} --label Qwen3.5-35B-A3B-Q8_0 --chunks 20 -ngl 99`",
                           "`qeval kld --ref Qwen3.5-35B-A3B-Q8_0 --cand B-Q4_K_M.gguf --chunks 20 -ngl 99`")
    assert len(msg.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()  # nothing captured, nothing written


def test_a_hub_reference_is_refused_without_a_download(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # where huggingface_hub keeps it, once imported: its repository is listed (a published reference is pulled)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    res = run_cli("kld", "--ref", "hf:USER/MODEL-GGUF:Q8_0", "--cand", "x.gguf", "--runs-dir", tmp_path)
    assert_cli_error(res, "`qeval capture hf:USER/MODEL-GGUF:Q8_0 --label Q8_0`", "`qeval kld --ref Q8_0 --cand x.gguf`")


def test_other_commands_say_a_gguf_is_not_a_store(tmp_path):
    model = fake_gguf(tmp_path / "m.gguf")
    for command in (("ppl", model), ("info", model)):
        assert_cli_error(run_cli(*command), "is a GGUF model, not a store", f"qeval capture {model} --label")


def test_matrix_with_its_reference_done_counts_only_the_pairs_that_run(models, tmp_path, free_space):
    """A second run reuses the reference and every finished pair: only a pair whose result is gone runs again, and
    only it is counted, without a store (n_ctx 64: 31 scored tokens a window)."""
    args = ("matrix", "--ref", f"R={models['Q8_0']}", "-m", f"Q4={models['Q4_0']}", "-c", 64, "--chunks", 2,
            "--runs-dir", tmp_path)
    assert run_cli(*args).returncode == 0
    assert not (tmp_path / "Q4.qeval").exists()  # the matrix keeps no candidate logits
    for leftover in (tmp_path / "results").glob("Q4.vs.R.*"):
        leftover.unlink()
    free_space(1000)
    needed = 64_000 + 2 * 31 * 8 * 12
    res = run_cli(*args)
    assert_cli_error(res, f"matrix: 1 of 2 pairs to run needs ~{budget.size_text(needed)} ({needed:,} bytes)")
    assert "qeval: matrix: 1 of 2 pairs to run: 2 chunks, writes ~" in res.stderr


def test_a_split_models_size_counts_every_shard(tmp_path):
    for i, size in ((1, 10), (2, 20)):
        (tmp_path / f"M[x]-Q4_K_M-0000{i}-of-00002.gguf").write_bytes(bytes(size))
    (tmp_path / "other-00001-of-00002.gguf").write_bytes(bytes(99))
    assert budget.model_bytes(tmp_path / "M[x]-Q4_K_M-00001-of-00002.gguf") == 30
    assert budget.model_bytes(tmp_path / "other-00001-of-00002.gguf") == 99


def test_a_hidden_store_is_counted_as_its_rows_and_its_head_once():
    """The hidden form: ~1 KB per scored token of q8_0 rows at d_model 640 and their records, plus the head once, not
    ~130 KB per token; Gemma-3-270M Q8_0 stores measured 178,769,465 bytes (format 5: 255 tokens, head 178,257,920)
    and 199,223,565 (format 6, with the replay records: 80 windows, 20,400 tokens; docs/why-logits.md)."""
    head = {"form": "hidden", "type": "Q8_0", "n_embd": 640, "bytes": 178_257_920}
    hidden = budget.Run("H", 1, 512, 255, 262_144, live=False, keeps_store=True, head=head)
    assert 178_769_465 <= hidden.bytes <= 1.01 * 178_769_465
    logits = budget.Run("L", 1, 80 * 512, 20_400, 262_144, live=False, keeps_store=True)
    many = budget.Run("H", 1, 80 * 512, 20_400, 262_144, live=False, keeps_store=True, head=head)
    assert 199_223_565 <= many.bytes <= 1.01 * 199_223_565
    assert many.bytes - head["bytes"] < logits.bytes / 100
    # auto, the default, is counted as it writes where its replay holds: the hidden form
    auto = budget.Run("A", 1, 80 * 512, 20_400, 262_144, live=False, keeps_store=True, head={**head, "form": "auto"})
    assert auto.bytes == many.bytes
    # and takes longer: the head replayed per row, measured 26.9 ms more per row than the logits form at this width
    assert auto.seconds - logits.seconds == pytest.approx(20_400 * (33.9 - 6.5) / 1020, rel=1e-9)
