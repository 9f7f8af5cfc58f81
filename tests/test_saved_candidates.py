"""A candidate label the runs directory knows only by its saved result (what a matrix or the demo leaves: results,
no candidate logits): `kld`, `compare` and `check` reuse the result, cut it to fewer chunks, or extend it by running
the GGUF it recorded; every command the docs give for "afterwards" works on such a directory.

Real Gemma-3-270M runs at 128-token windows: a matrix over 2 chunks, its reference then grown to 3.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_cli_error, run_cli

from qeval import api
from qeval.orchestrate import measured
from qeval.storage.store import StoreReader

ROOT = Path(__file__).resolve().parents[1]
N_CTX, REF_CHUNKS, MATRIX_CHUNKS = 128, 3, 2


@pytest.fixture(scope="module")
def matrix_runs(models, tmp_path_factory):
    """A runs directory as a user has it after `qeval matrix` (or the demo): the reference store Q8_0, and results
    for Q4_K_M, Q4_0 and the control, no candidate store. Q4_0 runs from a copy of its GGUF, removed afterwards."""
    home = tmp_path_factory.mktemp("matrix")
    runs = home / "qeval-runs"
    moved = home / "gone" / "gemma-3-270m-Q4_0.gguf"
    moved.parent.mkdir()
    shutil.copy(models["Q4_0"], moved)
    api.matrix_report(f"Q8_0={models['Q8_0']}", [f"Q4_K_M={models['Q4_K_M']}", f"Q4_0={moved}"], ["f16"],
                      chunks=MATRIX_CHUNKS, n_ctx=N_CTX, runs_dir=runs, control=True, progress=False)
    moved.unlink()
    return home


@pytest.fixture(scope="module")
def grown_runs(matrix_runs, models, tmp_path_factory):
    """The matrix's runs directory after its reference grew to 3 chunks (`qeval capture --chunks 3` of the same
    capture: its 2 chunks kept byte for byte, one more run); the results still hold 2."""
    home = tmp_path_factory.mktemp("grown")
    shutil.copytree(matrix_runs / "qeval-runs", home / "qeval-runs")
    before = (home / "qeval-runs" / "Q8_0.qeval").read_bytes()
    _, text = api.capture_store(str(models["Q8_0"]), "Q8_0", runs_dir=home / "qeval-runs", n_ctx=N_CTX,
                                chunks=REF_CHUNKS)
    assert "3 chunks (1 captured now)" in text
    with StoreReader(home / "qeval-runs" / "Q8_0.qeval") as grown, StoreReader(matrix_runs / "qeval-runs" /
                                                                                "Q8_0.qeval") as old:
        assert grown.header.n_chunks == REF_CHUNKS
        for c in range(MATRIX_CHUNKS):
            assert grown.raw_record(grown.chunk_pieces[c][0][1]) == old.raw_record(old.chunk_pieces[c][0][1])
    assert len(before) < (home / "qeval-runs" / "Q8_0.qeval").stat().st_size
    return home


def _result(runs: Path, label: str) -> dict:
    return json.loads((runs / "results" / f"{label}.vs.Q8_0.json").read_text())


def test_a_label_known_by_its_result_is_that_result_reused(matrix_runs):
    runs = matrix_runs / "qeval-runs"
    assert not (runs / "Q4_K_M.qeval").exists()
    res = run_cli("kld", "--ref", "Q8_0", "--cand", "Q4_K_M", "--chunks", MATRIX_CHUNKS, "--json", cwd=matrix_runs)
    assert res.returncode == 0, res.stderr
    got, saved = json.loads(res.stdout), _result(runs, "Q4_K_M")
    assert "reused its saved result" in got["obtained"][0] and "nothing run" in got["obtained"][0]
    assert got["kld"] == saved["kld"] and got["perplexity"] == saved["perplexity"]
    text = run_cli("kld", "--ref", "Q8_0", "--cand", "Q4_K_M", cwd=matrix_runs)
    assert text.returncode == 0 and text.stdout.startswith("Q4_K_M: ")  # the text says where its figures come from


def test_fewer_chunks_cut_the_saved_result(matrix_runs):
    res = measured.measure("Q8_0", "Q4_K_M", chunks=1, runs_dir=matrix_runs / "qeval-runs")
    per_token = np.load(matrix_runs / "qeval-runs" / "results" / "Q4_K_M.vs.Q8_0.npz")
    first = per_token["chunk"] == 0
    assert res.summary.chunks == 1 and "first 1 of 2 chunks" in res.note
    np.testing.assert_array_equal(res.per_token["kld"], per_token["kld"][first])


def test_more_chunks_than_saved_run_the_rest_live_to_an_uninterrupted_runs_numbers(grown_runs, models):
    """The reference holds 3 chunks, the result 2: the third runs live from the GGUF the result recorded, and the
    whole equals one live run over the 3 chunks, token for token."""
    runs = grown_runs / "qeval-runs"
    extended = api.measure("Q8_0", "Q4_K_M", runs_dir=runs)
    assert "2 chunks reused" in extended.note and "1 run live" in extended.note
    fresh = api.measure("Q8_0", str(models["Q4_K_M"]), runs_dir=runs)
    assert fresh.note == "" and fresh.summary.chunks == extended.summary.chunks == REF_CHUNKS
    for column, values in fresh.per_token.items():
        np.testing.assert_array_equal(extended.per_token[column], values, err_msg=column)
    assert (runs / "results" / "Q4_K_M.vs.Q8_0.json").is_file() and _result(runs, "Q4_K_M")["chunks"] == MATRIX_CHUNKS


def test_more_chunks_than_the_reference_holds_say_how_to_get_them(matrix_runs):
    res = run_cli("kld", "--ref", "Q8_0", "--cand", "Q4_K_M", "--chunks", 80, cwd=matrix_runs)
    assert_cli_error(res, "--chunks 80 asks for more than the reference Q8_0 holds (2 chunks", "qeval capture",
                     "it keeps the 2 chunks and adds the rest", "--chunks 2 or fewer")
    assert "--force" not in res.stderr  # it would capture the 2 chunks again instead of growing the store


def test_a_result_whose_gguf_is_gone_says_what_is_missing(grown_runs):
    ok = run_cli("kld", "--ref", "Q8_0", "--cand", "Q4_0", "--chunks", MATRIX_CHUNKS, cwd=grown_runs)
    assert ok.returncode == 0 and "reused its saved result" in ok.stdout  # what it holds needs no model
    res = run_cli("kld", "--ref", "Q8_0", "--cand", "Q4_0", cwd=grown_runs)
    assert_cli_error(res, "known only by its saved result", "lacks 1 of the 3 chunks", "gemma-3-270m-Q4_0.gguf is gone",
                     "qeval kld --ref Q8_0 --cand PATH/TO/gemma-3-270m-Q4_0.gguf", "--chunks 2 or fewer")


def test_flags_that_compute_another_candidate_are_refused(matrix_runs):
    res = run_cli("kld", "--ref", "Q8_0", "--cand", "Q4_K_M", "-ctk", "q8_0", "-fa", "on", cwd=matrix_runs)
    assert_cli_error(res, "stands for the candidate its result", "type_k: f16 vs q8_0", "-ctk q8_0")
    assert "-fa on" in res.stderr
    save = run_cli("kld", "--ref", "Q8_0", "--cand", "Q4_K_M", "--save", "x", cwd=matrix_runs)
    assert_cli_error(save, "--save keeps a live GGUF candidate's store")


def test_an_unknown_label_lists_what_the_runs_directory_knows_by_kind(matrix_runs):
    for command in (("kld", "--ref", "Q8_0", "--cand", "Q4_K_N"), ("compare", "--ref", "Q8_0", "--cand", "Q4_K_N",
                                                                   "--cand", "Q4_0")):
        res = run_cli(*command, cwd=matrix_runs)
        assert_cli_error(res, "'Q4_K_N' is neither a file nor a label", "stores: Q8_0",
                         "results against Q8_0: Q4_0, Q4_K_M, control", "--save-result")


def test_a_saved_result_is_never_shown_for_another_reference(matrix_runs, models, tmp_path):
    """The same label's result against a reference captured otherwise (other windows) does not answer: the model
    runs live over every chunk, and the text says why."""
    runs = tmp_path / "qeval-runs"
    (runs / "results").mkdir(parents=True)
    for suffix in ("json", "npz"):
        shutil.copy(matrix_runs / "qeval-runs" / "results" / f"Q4_K_M.vs.Q8_0.{suffix}", runs / "results")
    api.capture_store(str(models["Q8_0"]), "Q8_0", runs_dir=runs, n_ctx=N_CTX, chunks=MATRIX_CHUNKS,
                      corpus="bierce-devils-dictionary")
    res = api.measure("Q8_0", "Q4_K_M", runs_dir=runs)
    assert "does not answer" in res.note and "another reference (token ids" in res.note
    assert "every chunk run live" in res.note and res.summary.chunks == MATRIX_CHUNKS


# Commands the docs give for a runs directory a demo or a matrix left (labels Q8_0, Q4_K_M, Q4_0, control), each
# checked to stand in its file as written: they run here with the matrix's chunk count for their --chunks.
AFTERWARDS = [
    ("docs/demo.md", "qeval kld --ref Q8_0 --cand Q4_K_M --chunks 80"),
    ("docs/usage.md", "qeval kld --ref Q8_0 --cand Q4_K_M --chunks 20 --json --per-token q4km.csv"),
    ("docs/usage.md", "qeval ppl Q8_0"),
    ("docs/usage.md", "qeval info Q8_0"),
    ("docs/leaderboards.md", 'qeval leaderboard qeval-runs --out leaderboard/ --title "Gemma-3-270M quants"'),
    ("docs/leaderboards.md", "qeval compare --ref Q8_0 --cand Q4_K_M --cand Q4_0"),
    ("docs/leaderboards.md", "qeval check --ref Q8_0 --cand Q4_K_M --max-kld 0.05 --min-top1 90 --json"),
    ("docs/leaderboards.md", "qeval check --ref Q8_0 --cand Q4_K_M --max-kld 0.05 --control control"),
    ("README.md", "qeval card qeval-runs --out eval/ --merge README.md"),
]


@pytest.mark.parametrize("doc,command", AFTERWARDS, ids=[c for _, c in AFTERWARDS])
def test_every_documented_afterwards_command_works_on_a_matrix_runs_directory(matrix_runs, doc, command, tmp_path):
    assert command in (ROOT / doc).read_text(), f"{doc} no longer says `{command}`: update AFTERWARDS"
    home = tmp_path / "home"
    shutil.copytree(matrix_runs / "qeval-runs", home / "qeval-runs")
    (home / "README.md").write_text("# model\n")
    argv = shlex.split(re.sub(r"--chunks \d+", f"--chunks {MATRIX_CHUNKS}", command))[1:]
    res = run_cli(*argv, cwd=home)
    # a gate's verdict, no error: failed (exit 1) or undecided (exit 3: the interval straddles a limit)
    said = {1: ("FAILED: ", '"verdict": "failed"'), 3: ("UNDECIDED: ", '"verdict": "undecided"')}
    gate_verdict = argv[0] == "check" and any(w in res.stdout for w in said.get(res.returncode, ()))
    assert res.returncode == 0 or gate_verdict, f"`{command}` failed:\n{res.stdout}\n{res.stderr}"
    assert "qeval: error" not in res.stderr and "Traceback" not in res.stderr


def test_flips_say_what_a_label_known_by_its_kld_result_lacks(matrix_runs):
    res = run_cli("flips", "--ref", "Q8_0", "--cand", "Q4_K_M", cwd=matrix_runs)
    assert_cli_error(res, "'Q8_0' is neither a task store", "Q8_0 has a logits store", "qeval tasks capture -m "
                     "gemma-3-270m-Q8_0.gguf --task TASKFILE --label Q8_0")
    cand = run_cli("flips", "--ref", "Q4_K_M", "--cand", "Q4_K_M", cwd=matrix_runs)
    assert_cli_error(cand, "Q4_K_M has a KLD result against Q8_0", "gemma-3-270m-Q4_K_M.gguf --task TASKFILE")
