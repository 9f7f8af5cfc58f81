"""What llama.cpp computed with: the KV rotation, the decode mode, the environment and the build are part of every
store's and result's identity (qeval.engine.numerics, qeval.identity), and the board's floor row."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import make_pair
from qeval import api, identity
from qeval.engine import numerics
from qeval.engine.engine import Engine, EngineSettings, planned_fields
from qeval.engine.modelinfo import model_facts
from qeval.errors import QevalError
from qeval.orchestrate import matrix
from qeval.present import results

GEMMA = {"file_name": "g.gguf", "kv_cache": {"k_head": 256, "v_head": 256}}
ODD = {"file_name": "odd.gguf", "kv_cache": {"k_head": 80, "v_head": 80}}


@pytest.mark.parametrize(("facts", "types", "mode", "env", "expected"), [
    (GEMMA, ("q4_0", "q4_0"), "auto", {}, {"k": True, "v": True}),
    (GEMMA, ("q8_0", "f16"), "auto", {}, {"k": True, "v": False}),
    (GEMMA, ("f16", "f16"), "auto", {}, {"k": False, "v": False}),
    (GEMMA, ("q4_0", "q4_0"), "off", {}, {"k": False, "v": False}),
    (GEMMA, ("q4_0", "q4_0"), "auto", {"LLAMA_ATTN_ROT_DISABLE": "1"}, {"k": False, "v": False}),
    (GEMMA, ("q4_0", "q4_0"), "auto", {"LLAMA_ATTN_ROT_DISABLE": "0"}, {"k": True, "v": True}),
    (GEMMA, ("q4_0", "q4_0"), "on", {"LLAMA_ATTN_ROT_DISABLE": "1"}, {"k": True, "v": True}),
    (ODD, ("q4_0", "q4_0"), "auto", {}, {"k": False, "v": False}),
    ({}, ("q4_0", "q4_0"), "auto", {}, {"k": False, "v": False}),  # no attention cache: nothing to rotate
])
def test_the_rotation_rule_is_llama_cpps(facts, types, mode, env, expected):
    assert numerics.rotation_rule(facts, *types, mode, environ=env) == expected


@pytest.mark.parametrize(("facts", "types", "message"), [
    (GEMMA, ("f16", "f16"), "rotates only a quantized KV cache, and this one is f16/f16"),
    (ODD, ("q8_0", "q8_0"), "multiple of 64; odd.gguf's K heads are 80"),
])
def test_rotation_on_where_llama_cpp_cannot_is_refused(facts, types, message):
    with pytest.raises(QevalError, match=message):
        numerics.rotation_rule(facts, *types, "on")
    with pytest.raises(QevalError, match="--kv-rotation must be one of auto, on, off"):
        numerics.rotation_rule(facts, *types, "yes")


def test_the_environment_recorded_leaves_out_logging_paths_and_the_rotation():
    env = {"GGML_CPU_DISABLE_FUSION": "1", "LLAMA_GRAPH_REUSE_DISABLE": "1", "GGML_CUDA_NEW_THING": "2",
           "GGML_SCHED_DEBUG": "1", "LLAMA_TRACE": "1", "LLAMA_CPP_LIB_PATH": "/x", "GGML_BACKEND_PATH": "/y",
           "LLAMA_ATTN_ROT_DISABLE": "1", "LLAMA_ARG_CTX_SIZE": "9", "CUDA_VISIBLE_DEVICES": "0", "HOME": "/root"}
    assert numerics.numerics_env(env) == {"GGML_CPU_DISABLE_FUSION": "1", "GGML_CUDA_NEW_THING": "2",
                                          "LLAMA_GRAPH_REUSE_DISABLE": "1"}


def test_offloaded_layers_count_what_llama_cpp_offloads():
    facts = {"block_count": 18}
    assert numerics.offloaded_layers(facts, 99, offloaded=False) == 0
    assert numerics.offloaded_layers(facts, 99, True) == numerics.offloaded_layers(facts, -1, True) == 19
    assert numerics.offloaded_layers(facts, 7, True) == 7


def test_a_store_from_before_numerics_were_recorded_reads_not_recorded(tmp_path):
    pair = make_pair(tmp_path, n_chunks=2)
    old = identity.producer(pair.ref.header)
    assert old["numerics"] == identity.NOT_RECORDED
    now = {**old, "numerics": {"build": {"llama_cpp_python": "0.3.36"}, "env": {}, "gpu_layers": 0}}
    assert identity.changes(old, now) == ['llama.cpp numerics: not recorded vs {"build": {"llama_cpp_python": '
                                          '"0.3.36"}, "env": {}, "gpu_layers": 0}']
    saved = {k: v for k, v in old.items() if k != "numerics"}  # a request saved by an older qeval
    assert identity.changes(saved, now)[0].startswith("llama.cpp numerics: not recorded vs")


def test_the_floor_is_the_reference_on_another_kernel_path():
    ref = {"model": {"fingerprint": "m"}, "kv": {"type_k": "f16", "type_v": "f16", "flash_attn": "auto"}, "n_batch": 128,
           "numerics": {"env": {}}}
    request = lambda cand: identity.ComparisonRequest(reference=ref, candidate=cand, chunks=2)  # noqa: E731
    generate = {**ref, "kv": {**ref["kv"], "decode": "generate"}, "n_batch": 64}
    no_fa = {**ref, "kv": {**ref["kv"], "flash_attn": "off"}}
    control = {**ref, "n_batch": 256}
    quantized = {**ref, "kv": {**ref["kv"], "type_k": "q8_0"}}
    other_env = {**generate, "numerics": {"env": {"GGML_CPU_DISABLE_FUSION": "1"}}}
    assert [identity.is_floor(request(c)) for c in (generate, no_fa, control, quantized, other_env)] == \
        [True, True, False, False, False]
    assert identity.is_control(request(control)) and not identity.is_control(request(generate))


def test_floor_kinds_and_kv_specs(tmp_path):
    def plan(kv: str, floor: str = "auto") -> matrix.MatrixPlan:
        pairs = tuple((matrix.pair_label("Q", k), "q.gguf", k) for k in kv.split(","))
        return matrix.plan_matrix(matrix.MatrixRequest(ref_label="R", ref_path="r.gguf", pairs=pairs,
                                                       directory=tmp_path, chunks=2, n_ctx=64, floor=floor))

    auto = plan("q4_0,q4_0:norot")
    assert [p.label for p in auto.pairs] == ["Q+kv-q4_0", "Q+kv-q4_0-norot", matrix.FLOOR]
    assert [p.settings.kv_rotation for p in auto.pairs[:2]] == ["auto", "off"]
    floor = auto.pairs[-1].settings
    assert (floor.type_k, floor.decode, floor.flash_attn) == ("f16", "generate", auto.reference.settings.flash_attn)
    assert [p.label for p in plan("f16").pairs] == ["Q"]  # no quantized cache: no floor
    fa = plan("f16", "flash-attn").pairs[-1].settings
    assert (fa.decode, fa.flash_attn) == ("prompt", "off")
    with pytest.raises(QevalError, match="suffix after ':' must be one of rot, norot"):
        plan("q4_0:sideways")
    with pytest.raises(QevalError, match="--floor must be one of auto, decode, flash-attn, none"):
        plan("q4_0", "maybe")


def test_generate_decodes_the_prompt_then_one_token_per_call(models):
    """GENERATE: the unscored half as one prompt (pieces of -b), then every scored position alone; its rows are the
    same positions' as prompt batches compute (a small KLD: another kernel path, not another position)."""
    windows = np.random.default_rng(3).integers(100, 20000, size=(2, 64)).astype(np.int32)
    rows, calls = {}, {}
    for mode in ("prompt", "generate"):
        with Engine(models["Q8_0"], 64, EngineSettings(n_threads=2, n_batch=16, decode=mode)) as engine:
            sizes = []
            decode = engine.decode
            engine.decode = lambda: (sizes.append(int(engine._batch.n_tokens)), decode())[1]
            got = [(r.window, int(r.positions[0]), r.logits.copy()) for call in engine.iter_calls(windows) for r in call]
            rows[mode], calls[mode] = np.concatenate([x for *_, x in sorted(got, key=lambda t: t[:2])]), sizes
    assert calls["prompt"] == [16] * 8
    assert calls["generate"] == ([16, 16] + [1] * 32) * 2  # positions 0-31 as a prompt, 32..63 one at a time
    assert rows["generate"].shape == rows["prompt"].shape == (2 * 31, 262144)
    logp, logq = (x - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) - x.max(1, keepdims=True)
                  for x in (rows["prompt"].astype(np.float64), rows["generate"].astype(np.float64)))
    kld = (np.exp(logp) * (logp - logq)).sum(1)
    print(f"generate vs prompt, f16 KV: mean KLD {kld.mean():.6f}, max {kld.max():.6f}")
    assert kld.mean() < 0.05 and (rows["prompt"].argmax(1) == rows["generate"].argmax(1)).mean() > 0.8


@pytest.mark.parametrize(("types", "mode"), [(("q4_0", "q4_0"), "auto"), (("q4_0", "q4_0"), "off"),
                                             (("q8_0", "f16"), "on"), (("f16", "f16"), "auto")])
def test_llama_cpp_reports_the_rotation_planning_predicts(models, types, mode):
    type_k, type_v = types
    settings = EngineSettings(type_k=type_k, type_v=type_v, flash_attn="on", n_threads=2, kv_rotation=mode)
    planned = planned_fields(model_facts(models["Q8_0"]), settings, 64)
    with Engine(models["Q8_0"], 64, settings) as engine:
        assert engine.settings.kv_block(engine.kv_rotation) == planned["kv"]
        assert engine.numerics == planned["numerics"]


def _matrix(models, runs, kv="q4_0", kv_rotation="auto", **kw) -> tuple[dict, str]:
    return api.matrix_report(f"R={models['Q8_0']}", [f"Q8={models['Q8_0']}"], kv.split(","), chunks=2, n_ctx=64,
                             runs_dir=runs, engine=EngineSettings(n_threads=2, kv_rotation=kv_rotation),
                             progress=False, **kw)


def test_a_matrix_under_another_rotation_recomputes_never_reuses(models, tmp_path, monkeypatch):
    """The issue's stale number: a matrix run again under LLAMA_ATTN_ROT_DISABLE=1 reused the saved result."""
    monkeypatch.delenv("LLAMA_ATTN_ROT_DISABLE", raising=False)
    first, _ = _matrix(models, tmp_path)
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    second, text = _matrix(models, tmp_path)
    assert "Q8+kv-q4_0: recomputed" in text and "candidate KV rotation k: True vs False" in text
    kld = lambda result: {r["label"]: r["kld_mean"] for r in result["rows"]}  # noqa: E731
    assert kld(second)["Q8+kv-q4_0"] != kld(first)["Q8+kv-q4_0"]
    assert [r["kv"] for r in second["rows"] if r["label"] == "Q8+kv-q4_0"] == ["q4_0/q4_0 norot"]
    # `on` overrides the environment: the request of the first run again, whose numbers it gives again
    third, text = _matrix(models, tmp_path, kv_rotation="on")
    assert "Q8+kv-q4_0: recomputed" in text and kld(third)["Q8+kv-q4_0"] == kld(first)["Q8+kv-q4_0"]
    # both on one board
    both, _ = _matrix(models, tmp_path, kv="q4_0:rot,q4_0:norot", control=False)
    assert kld(both)["Q8+kv-q4_0-rot"] == kld(first)["Q8+kv-q4_0"]
    assert kld(both)["Q8+kv-q4_0-norot"] == kld(second)["Q8+kv-q4_0"]


def test_another_environment_of_llama_cpp_refuses_the_reference_store(models, tmp_path, monkeypatch):
    _matrix(models, tmp_path, kv="f16", control=False)
    monkeypatch.setenv("GGML_CPU_DISABLE_FUSION", "1")
    with pytest.raises(QevalError, match='llama.cpp numerics environment GGML_CPU_DISABLE_FUSION: none vs 1 .stored vs requested.'):
        _matrix(models, tmp_path, kv="f16", control=False)


def test_the_floor_row_and_each_kv_rows_paired_excess(models, tmp_path):
    result, text = _matrix(models, tmp_path, kv="q4_0", floor="auto")
    rows = {r["label"]: r for r in result["rows"]}
    floor, kv = rows[matrix.FLOOR], rows["Q8+kv-q4_0"]
    assert floor["floor"] is True and floor["kv"] == "f16/f16 gen" and kv["floor"] is False
    assert "KLD over floor" in text and "floor" in text
    per_token = {label: results.load_result(tmp_path / "results" / f"{label}.vs.R.json").per_token
                 for label in (matrix.FLOOR, "Q8+kv-q4_0")}
    a, b = per_token["Q8+kv-q4_0"], per_token[matrix.FLOOR]
    chunk_means = [np.mean(a["kld"][a["chunk"] == c].astype(np.float64) - b["kld"][b["chunk"] == c]) for c in (0, 1)]
    assert kv["kld_over_floor"] == pytest.approx(np.mean(chunk_means), rel=1e-9)
    assert kv["kld_over_floor_se"] == pytest.approx(np.std(chunk_means, ddof=1) / np.sqrt(2), rel=1e-9)
    print(f"floor {floor['kld_mean']:.6f}, q4_0 {kv['kld_mean']:.6f}, over floor {kv['kld_over_floor']:+.6f}")
    verdict = {"above": "(above)", "within": "(within)"}.get(kv["floor_verdict"],
                                                             f"undecided ({kv['floor_verdict_chunks']} chunks)")
    assert kv["floor_verdict_chunks"] == 2
    cell = f"{kv['kld_over_floor']:+.6f} ± {kv['kld_over_floor_se']:.6f} {verdict}"
    assert cell in text  # the SE unsigned, as every "value ± SE"
    saved = json.loads((tmp_path / "results" / f"{matrix.FLOOR}.vs.R.json").read_text())
    assert saved["request"]["candidate"]["kv"]["decode"] == "generate"
