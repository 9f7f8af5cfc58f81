"""Long windows with Gemma-3-270M: which positions are scored is a choice llama.cpp is asked for, windows of
more than 256 scored rows are written and read in pieces, and a live candidate saves the same pieces."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qeval import api
from qeval.engine.engine import EngineSettings
from qeval.errors import QevalError
from qeval.storage.store import PIECE_ROWS, StoreReader

N_CTX = 1024  # "all" scores 1,023 rows: four pieces per window
FA_OFF = EngineSettings(flash_attn="off")  # CPU flash attention depends on how tokens are batched


@pytest.fixture
def runs(tmp_path):
    return tmp_path / "runs"


def test_sparse_scoring_asks_llama_cpp_for_those_rows_only(models, runs):
    api.capture_store(str(models["Q8_0"]), "all", runs_dir=runs, n_ctx=N_CTX, chunks=1, scoring="all",
                      settings=FA_OFF)
    api.capture_store(str(models["Q8_0"]), "every7", runs_dir=runs, n_ctx=N_CTX, chunks=1, scoring="every:7",
                      settings=FA_OFF)
    with StoreReader(runs / "all.qeval") as full, StoreReader(runs / "every7.qeval") as sparse:
        assert full.header.scoring == "all" and sparse.header.scoring == "every:7"
        assert sparse.header.positions.tolist() == list(range(6, N_CTX - 1, 7))
        assert len(full.chunk_pieces[0]) == -(-(N_CTX - 1) // PIECE_ROWS)
        rows = sparse.header.positions  # row r of "all" is position r
        whole, part = full.read_chunk(0), sparse.read_chunk(0)
        np.testing.assert_allclose(part.logprob_target, whole.logprob_target[rows], atol=1e-4)
        assert (part.top_ids[:, 0] == whole.top_ids[rows, 0]).mean() > 0.99
        # the control: rows one position off are another distribution entirely
        assert np.abs(part.logprob_target - whole.logprob_target[rows - 1]).max() > 0.5


def test_live_candidate_in_pieces_equals_its_saved_store(models, runs):
    api.capture_store(str(models["Q8_0"]), "ref", runs_dir=runs, n_ctx=N_CTX, chunks=1, scoring="all")
    live, _ = api.kld_report("ref", str(models["Q4_K_M"]), runs_dir=runs, save="q4", bands="256,512")
    stored, text = api.kld_report("ref", "q4", runs_dir=runs, bands="256,512")
    with StoreReader(runs / "q4.qeval", verify_chunks=True) as saved:
        assert saved.header.scoring == "all" and all(len(p) == 4 for p in saved.chunk_pieces.values())
    assert live["kld"]["mean"] == stored["kld"]["mean"] > 0
    assert [b["n"] for b in live["by_depth"]] == [256, 256, 511]
    # not saved: uncoded rows against a reference read piece by piece, the same figures within the code's floor
    uncoded, _ = api.kld_report("ref", str(models["Q4_K_M"]), runs_dir=runs, bands="256,512")
    assert uncoded["scored_tokens"] == stored["scored_tokens"] == N_CTX - 1
    assert uncoded["kld"]["mean"] == pytest.approx(stored["kld"]["mean"], abs=2e-6)
    assert uncoded["same_top1"] == stored["same_top1"]
    # (one window: a band within one 256-position block has no cluster-robust SE, NaN on both sides)
    assert json.dumps(live["by_depth"]) == json.dumps(stored["by_depth"])
    assert "By depth" in text


def test_beyond_the_trained_context_is_refused(models, runs):
    with pytest.raises(QevalError, match="beyond .* trained context of 32768 tokens.*--rope-scaling"):
        api.capture_store(str(models["Q8_0"]), "long", runs_dir=runs, n_ctx=65536, chunks=1)


def test_matrix_runs_every_model_with_the_rope_scaling_asked_for(tmp_path):
    from qeval.orchestrate import matrix

    plan = matrix.plan_matrix(matrix.MatrixRequest(ref_label="R", ref_path="r.gguf", pairs=(("C", "c.gguf", "q4_0"),),
                                                   directory=tmp_path, n_ctx=65536,
                                                   engine=EngineSettings(n_threads=1, rope_scaling="yarn",
                                                                         rope_scale=2.0)))
    for settings in (plan.reference.settings, plan.pairs[0].settings):
        assert (settings.rope_scaling, settings.rope_scale, settings.n_threads) == ("yarn", 2.0, 1)
    assert (plan.pairs[0].settings.type_k, plan.pairs[0].settings.flash_attn) == ("q4_0", "on")
    with pytest.raises(QevalError, match="--rope-scale needs --rope-scaling"):
        matrix.plan_matrix(matrix.MatrixRequest(ref_label="R", ref_path="r.gguf", pairs=(("C", "c.gguf", "f16"),),
                                                directory=tmp_path, n_ctx=512,
                                                engine=EngineSettings(rope_scale=2.0)))


def test_matrix_beyond_the_trained_context_is_refused(models, runs):
    with pytest.raises(QevalError, match="beyond .* trained context of 32768 tokens.*--rope-scaling"):
        api.matrix_report(f"R={models['Q8_0']}", [f"C={models['Q4_K_M']}"], ["f16"], n_ctx=65536, chunks=1,
                          runs_dir=runs, progress=False)
    assert not (runs / "R.qeval").exists()
