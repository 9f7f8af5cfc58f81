"""Boards decided early in the matrix (issue 25, item 2: `qeval matrix --early`): pairs visit the chunks in a seeded
random order, in rounds, and stop once qeval.compare.early's rule says their place on the board is known; a later
full run extends them from their checkpoints.

On replayed logits (tests/replay_backend.py: no llama.cpp, seconds): 'models' are the reference plus Gaussian noise
of a chosen size, so how far apart their mean KLDs lie is chosen too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_cli_error, run_cli
from test_matrix_checkpoint import (  # noqa: F401 - decoded and planned_as_replayed are fixtures
    REPLAY,
    assert_same_result,
    decoded,
    planned_as_replayed,
    replayed_models,
)

from qeval.compare import early
from qeval.identity import ComparisonRequest
from qeval.orchestrate import matrix, sweep
from qeval.present import board, results
from qeval.storage import checkpoint

V, N_CTX, N = 200, 64, 32  # 31 scored tokens a chunk (--score half), 32 chunks
# noise sizes: mean KLDs about an order of magnitude apart; CLOSE's a few % above A's
NOISE = {"A": 0.3, "B": 1.0, "C": 3.0, "CLOSE": 0.306}
MIN = early.MIN_CHUNKS  # the 8


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    return replayed_models(tmp_path_factory.mktemp("models"), 5, N, N_CTX, V, NOISE)


def request(replayed, directory: Path, labels=("A", "B", "C"), **kw) -> matrix.MatrixRequest:
    models, corpus = replayed
    return matrix.MatrixRequest(ref_label="R", ref_path=models["R"], pairs=tuple((x, models[x], "f16") for x in labels),
                                directory=directory, n_ctx=N_CTX,
                                corpus=str(corpus), engine=REPLAY, **kw)


def run(replayed, directory: Path, labels=("A", "B", "C"), **kw) -> tuple[dict, str]:
    return sweep.run_matrix(request(replayed, directory, labels, **kw), progress=False)


def decided(seed: int = 0) -> early.EarlySettings:
    """--early with the issue's rule: at least 8 chunks, ±5 % or neighbours 3 SE apart."""
    return matrix.early_settings(seed=seed)


def rows_of(result: dict) -> dict[str, dict]:
    return {r["label"]: r for r in result["rows"]}


def ranked(result: dict) -> list[str]:
    return [r["label"] for r in sorted(result["rows"], key=lambda r: r["kld_mean"])]


def saved(directory: Path, label: str) -> results.Result:
    return results.load_result(directory / "results" / f"{label}.vs.R.json")


@pytest.fixture(scope="module")
def full(replayed, tmp_path_factory):
    """The full board (every chunk, in order) of A, B, C and CLOSE."""
    d = tmp_path_factory.mktemp("full")
    result, _ = run(replayed, d, ("A", "B", "C", "CLOSE"))
    return d, result


def test_the_chunk_order_is_recorded_and_reproducible_by_seed(replayed, tmp_path):
    got = {}
    for name, seed in (("first", 7), ("again", 7), ("other", 8)):
        result, _ = run(replayed, tmp_path / name, early=decided(seed))
        got[name] = result["early"]["order"]
        for label, row in rows_of(result).items():
            res = saved(tmp_path / name, label)
            held = res.summary.comparison_request().early
            assert held["order"] == got[name] and held["seed"] == seed and held["visited"] == row["chunks"]
            # the result's per-token columns are the first `visited` chunks of that order, in that order
            visited = [int(c) for c in dict.fromkeys(res.per_token["chunk"].tolist())]
            assert visited == got[name][:row["chunks"]]
    assert got["first"] == got["again"] == early.chunk_order(N, 7).tolist()
    assert sorted(got["first"]) == list(range(N)) and got["other"] != got["first"]


def test_a_separated_board_stops_at_the_minimum_with_the_full_order(replayed, full, tmp_path, decoded):
    full_dir, full_result = full
    result, text = run(replayed, tmp_path, early=decided())
    assert {k: v for k, v in decoded.items() if k != "R"} == {"A": MIN, "B": MIN, "C": MIN}  # forward passes
    rows = rows_of(result)
    assert {r["stopped"] for r in rows.values()} == {early.SETTLED}
    assert ranked(result) == [x for x in ranked(full_result) if x in rows]
    for label, row in rows.items():
        assert row["chunks"] == MIN and row["scored_tokens"] == MIN * (N_CTX // 2 - 1)
        est = _estimate(tmp_path, label)
        full_mean = rows_of(full_result)[label]["kld_mean"]
        assert abs(est.mean - row["kld_mean"]) < 1e-12 * row["kld_mean"]  # the board's mean is the sample's
        assert abs(est.mean - full_mean) < 4 * est.se  # and the full one lies within a few chunk-level SEs
    assert "tokens (chunks)" in text and f"{MIN * (N_CTX // 2 - 1):,} ({MIN})" in text and "settled" in text
    assert f"{3 * MIN} of {3 * N} pair-chunks held" in text


def test_an_early_matrix_announces_its_range(replayed, tmp_path, capsys):
    """Before the first window: the pairs' range from the minimum to every chunk, not the full run's alone."""
    sweep.run_matrix(request(replayed, tmp_path, early=decided()), progress=True)
    said = capsys.readouterr().err
    assert f"decided early: each pair {MIN} to {N} chunks ({3 * MIN} to {3 * N} pair-chunks)" in said
    assert "(every pair at its minimum) to " in said


def _estimate(directory: Path, label: str) -> early.Estimate:
    """The chunk-level estimate of a saved early result, computed from its per-token KLD here."""
    res = saved(directory, label)
    _, sums, tokens = early.chunk_sums(res.per_token)
    return early.ratio_estimate(sums, tokens, N)


def test_close_neighbours_run_longer_and_never_guess(replayed, full, tmp_path, decoded):
    full_dir, full_result = full
    result, _ = run(replayed, tmp_path, ("A", "B", "C", "CLOSE"), early=decided())
    rows = rows_of(result)
    assert rows["B"]["chunks"] == rows["C"]["chunks"] == MIN  # clear of everyone: settled at the minimum
    for label in ("A", "CLOSE"):
        assert rows[label]["chunks"] > MIN and decoded[label] == rows[label]["chunks"]
    full_order = ranked(full_result)
    if ranked(result) != full_order:  # the two may only swap as a declared tie, never as a settled order
        assert {rows["A"]["stopped"], rows["CLOSE"]["stopped"]} <= {early.PRECISION}
    else:
        assert all(rows[x]["stopped"] in (early.SETTLED, early.PRECISION, early.ALL_CHUNKS) for x in ("A", "CLOSE"))


def test_a_full_run_extends_an_early_one(replayed, full, tmp_path, decoded):
    full_dir, _ = full
    labels = ("A", "B", "C", "CLOSE")
    first, _ = run(replayed, tmp_path, labels, early=decided())
    held = {label: row["chunks"] for label, row in rows_of(first).items()}
    assert all(checkpoint.chunks_in(tmp_path / "results" / f"{x}.vs.R{checkpoint.SUFFIX}") == held[x]
               for x in labels if held[x] < N)
    decoded.clear()
    result, text = run(replayed, tmp_path, labels)
    assert {k: v for k, v in decoded.items() if k != "R"} == {x: N - held[x] for x in labels if held[x] < N}
    for x in labels:
        if held[x] < N:
            assert f"{x}: decided early on {held[x]} of {N} chunks: runs on over every chunk" in text
        assert_same_result(full_dir, tmp_path, x)  # bit for bit the uninterrupted full run's
        assert saved(tmp_path, x).summary.comparison_request().early is None
    assert "early" not in result and all("stopped" not in r for r in result["rows"])


def test_early_results_are_labelled_and_never_taken_for_full_ones(replayed, full, tmp_path, decoded):
    full_dir, _ = full
    first, text = run(replayed, tmp_path, early=decided())
    early_request = saved(tmp_path, "A").summary.comparison_request()
    full_request = saved(full_dir, "A").summary.comparison_request()
    assert early_request.early is not None and full_request.early is None and early_request.key != full_request.key
    assert early_request.chunks == full_request.chunks == N  # a sample of the whole corpus, and says so
    on_disk = json.loads((tmp_path / "results" / "A.vs.R.json").read_text())
    assert on_disk["chunks"] == MIN and on_disk["request"]["early"]["visited"] == MIN
    assert ComparisonRequest.from_summary(on_disk).early == early_request.early
    assert board_note_in(text)
    # a leaderboard of the saved results says which rows were decided early, and on how many tokens
    board = run_cli("leaderboard", tmp_path, "--out", tmp_path / "board")
    assert board.returncode == 0, board.stderr
    rows = [line for line in board.stdout.splitlines() if line.startswith(("| A ", "| B ", "| C "))]
    assert len(rows) == 3 and all(f"| {MIN * (N_CTX // 2 - 1):,} ({MIN}) | decided early |" in r for r in rows), rows
    # the same --early again: read back from the checkpoints, nothing decoded, the same board
    decoded.clear()
    again, _ = run(replayed, tmp_path, early=decided())
    assert {k: v for k, v in decoded.items() if k != "R"} == {}
    assert again["rows"] == first["rows"]


def board_note_in(text: str) -> bool:
    return "Decided early (--early)" in text and "Early: seed 0, at least 8 chunks, ±5% at 95%" in text


def test_a_full_result_stands_on_an_early_board(replayed, full, tmp_path, decoded):
    """A pair whose full result is saved is not run again by --early: its row holds every chunk."""
    run(replayed, tmp_path, ("A",))
    decoded.clear()
    result, _ = run(replayed, tmp_path, early=decided())
    assert "A" not in decoded and rows_of(result)["A"]["stopped"] == early.ALL_CHUNKS
    assert rows_of(result)["A"]["chunks"] == N


@pytest.mark.parametrize("args, message", [
    (["--early", "--early-min-chunks", "1"], "--early-min-chunks must be at least 2"),
    (["--early", "--early-precision", "0"], "--early-precision is a share of the mean KLD"),
    (["--early", "--early-precision", "5"], "--early-precision is a share of the mean KLD"),
    (["--early", "--early-confidence", "95"], "--early-confidence must lie in (0, 1)"),
    (["--early", "--early-sigmas", "-1"], "--early-sigmas must be > 0"),
    (["--early", "--early-seed", "-2"], "--early-seed must be >= 0"),
    (["--early-precision", "0.05"], "need --early"),
    (["--early", "--keep-logits"], "--early and --keep-logits do not go together"),
    (["--early", "--executor", "ray"], "--early runs here"),
])
def test_bad_early_options_get_one_clear_message(replayed, tmp_path, monkeypatch, args, message):
    models, _ = replayed
    monkeypatch.setattr("qeval.api.ray_executor", lambda **kw: "ray")  # no Ray started: the refusal comes first
    res = run_cli("matrix", "--ref", f"R={models['R']}", "-m", f"A={models['A']}", "--runs-dir", tmp_path / "runs",
                  "-c", N_CTX, *args)
    assert_cli_error(res, message)
    assert not (tmp_path / "runs" / "R.qeval").exists()  # refused before any work


@pytest.mark.parametrize("args, message", [(["--early-seed", "3"], "need --early"),
                                           (["--early", "--early-min-chunks", "1"], "--early-min-chunks must be")])
def test_the_demo_takes_the_same_early_options(tmp_path, args, message):
    res = run_cli("demo", "--runs-dir", tmp_path / "runs", "--models-dir", tmp_path / "models", *args)
    assert_cli_error(res, message)
    assert not (tmp_path / "models").exists()  # refused before any model is assembled


def test_the_control_row_stops_at_the_minimum(replayed, tmp_path):
    """The control (the reference recomputed: the noise floor) is pinned first and on no front: nothing to settle."""
    result, text = run(replayed, tmp_path, ("A", "B"), early=decided(), control=True)
    rows = rows_of(result)
    assert rows["control"]["control"] and rows["control"]["chunks"] == MIN
    assert rows["control"]["stopped"] == early.SETTLED and "KLD over control" in text


def test_an_early_kv_row_is_paired_with_the_floor_on_the_chunks_it_holds():
    """A KV row decided early holds some chunks, in visit order; the floor ran them all: its cost over the floor is
    the t-interval over the chunks both hold, computed here in plain float64."""
    rng = np.random.default_rng(5)
    n_chunks, per_chunk = 6, 7
    chunk = np.repeat(np.arange(n_chunks), per_chunk)
    position = np.tile(np.arange(per_chunk), n_chunks)
    floor_kld = rng.gamma(2.0, 0.001, chunk.size)
    held = [4, 1, 3]  # the early row's visit order
    at = np.concatenate([np.flatnonzero(chunk == c) for c in held])
    row_kld = (floor_kld + rng.normal(0.002, 0.0005, chunk.size))[at]
    columns = {"floor": {"chunk": chunk, "position": position, "kld": floor_kld.astype(np.float32)},
               "q4_0": {"chunk": chunk[at], "position": position[at], "kld": row_kld.astype(np.float32)}}

    def row(label, **flags):
        return board.BoardRow(label=label, quant="Q8_0", kv="f16/f16", metrics={}, **flags)

    rows = [row("floor", floor=True), row("q4_0", kv_quant=True)]
    board.compare_with_floor(rows, lambda r: columns[r.label])
    d = [np.mean(row_kld[chunk[at] == c].astype(np.float32).astype(np.float64)
                 - floor_kld[chunk == c].astype(np.float32).astype(np.float64)) for c in sorted(held)]
    assert rows[1].kld_over_floor == pytest.approx(np.mean(d), rel=1e-12)
    assert rows[1].kld_over_floor_se == pytest.approx(np.std(d, ddof=1) / np.sqrt(len(d)), rel=1e-12)
