"""Every result knows what it measured: nothing on disk stands for a request it does not answer.

Stores: a finished or interrupted store of another capture is refused (naming what differs) or, when
asked, replaced without losing the old one before the new one is complete. Results: `matrix` recomputes a
pair whose saved result answers another request, and says so; `check`, `compare` and leaderboards refuse
results measured against another reference or with other formulas. Store-level and result-level cases
use synthetic stores (tests/conftest.py); the capture, `kld --save` and `matrix` cases run Gemma-3-270M
at n_ctx 32 over one chunk.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import build_chunk, make_header, make_tokens, perturb, synth_logits, write_store

from qeval import api, cli, identity
from qeval.compare import sampler
from qeval.errors import MismatchError, QevalError
from qeval.orchestrate import gate, paired
from qeval.present import leaderboard
from qeval.storage.codec import SqrtLogCode
from qeval.storage.store import StoreComplete, StoreConflict, StoreReader, StoreWriter, replacement_path

V, CTX, N = 300, 16, 4


def model(name: str) -> dict:
    return {"file_name": f"{name}.gguf", "fingerprint": (name.encode().hex() * 64)[:64]}


def run_cli_in_process(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2 and "Traceback" not in err
    assert err.startswith("qeval: error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


# --------------------------------------------------------------------------------------------------
# the request and its key
# --------------------------------------------------------------------------------------------------
def test_request_key_changes_with_every_field_and_only_with_them():
    ref = {"model": {"fingerprint": "ab" * 32}, "kv": {"type_k": "f16"}, "n_ctx": 512, "tokens_sha256": "cd" * 32}
    cand = {"model": {"fingerprint": "ef" * 32}, "kv": {"type_k": "f16", "type_v": "f16"}, "n_batch": 128}
    base = identity.ComparisonRequest(reference=ref, candidate=cand, chunks=80)
    assert base.metrics_version == identity.METRICS_VERSION
    reordered = identity.ComparisonRequest(reference=dict(reversed(ref.items())),
                                           candidate=dict(reversed(cand.items())), chunks=80)
    assert reordered.key == base.key
    variants = [identity.ComparisonRequest(reference={**ref, "n_ctx": 256}, candidate=cand, chunks=80),
                identity.ComparisonRequest(reference=ref, candidate={**cand, "kv": {"type_k": "q8_0", "type_v": "f16"}},
                                           chunks=80),
                identity.ComparisonRequest(reference=ref, candidate={**cand, "n_batch": 2048}, chunks=80),
                identity.ComparisonRequest(reference=ref, candidate=cand, chunks=20),
                identity.ComparisonRequest(reference=ref, candidate=cand, chunks=80,
                                           metrics_version=identity.METRICS_VERSION + 1)]
    assert len({base.key, *(v.key for v in variants)}) == 1 + len(variants)
    assert variants[1].changes_from(base) == ["candidate KV type_k: f16 vs q8_0"]
    assert identity.ComparisonRequest.from_summary({"request": base.to_json()}) == base
    assert identity.ComparisonRequest.from_summary({}) is None


def test_a_reference_read_uncoded_is_compared_with_its_own_metrics_version():
    """A format-6 hidden reference is read uncoded against stored candidates too (metrics.row_plane_sums), which
    moved its figures only: its requests carry UNCODED_REFERENCE_VERSION, every other reference's METRICS_VERSION,
    and a result against it saved at METRICS_VERSION is refused as computed with other formulas."""
    from qeval.present.results import require_current

    logits = {"model": {"fingerprint": "ab" * 32}, "codec": {"name": "sqrt-log"}}
    hidden = {**logits, "codec": {"name": "sqrt-log", "head": {"form": "hidden", "read_uncoded": True}}}
    format_5 = {**logits, "codec": {"name": "sqrt-log", "head": {"form": "hidden"}}}
    cand = {"model": {"fingerprint": "ef" * 32}}
    versions = [identity.ComparisonRequest(reference=r, candidate=cand, chunks=8).metrics_version
                for r in (logits, hidden, format_5)]
    assert versions == [identity.METRICS_VERSION, identity.UNCODED_REFERENCE_VERSION, identity.METRICS_VERSION]
    assert identity.UNCODED_REFERENCE_VERSION != identity.METRICS_VERSION
    old = identity.ComparisonRequest(reference=hidden, candidate=cand, chunks=8,
                                     metrics_version=identity.METRICS_VERSION)

    class Saved:  # what require_current reads of a saved result
        origin, label, ref_label = "C.vs.R.json", "C", "R"
        summary = type("S", (), {"qeval_version": "0.1.0", "comparison_request": lambda self: old})()

    with pytest.raises(QevalError, match=f"this qeval computes version {identity.UNCODED_REFERENCE_VERSION}"):
        require_current(Saved())


def test_samplers_are_part_of_the_request_as_a_set_of_settings():
    ref, cand = {"model": {"fingerprint": "ab" * 32}, "n_ctx": 512}, {"model": {"fingerprint": "ef" * 32}}
    base = identity.ComparisonRequest(reference=ref, candidate=cand, chunks=80)
    # asking for no sampler is the request of a result saved before samplers were part of requests
    assert base.key == identity.digest({"reference": ref, "candidate": cand, "chunks": 80,
                                        "metrics_version": identity.METRICS_VERSION})
    assert "samplers" not in base.to_json()
    both = identity.ComparisonRequest(reference=ref, candidate=cand, chunks=80, samplers=tuple(sampler.settings_names(
        ["qwen3.5-thinking", "greedy"])))
    # the same samplers in another order, named by their settings: the same request
    same = identity.ComparisonRequest(reference=ref, candidate=cand, chunks=80, samplers=tuple(sampler.settings_names(
        ["temp=0", "top_p=0.95,top_k=20,temp=0.6"])))
    one = identity.ComparisonRequest(reference=ref, candidate=cand, chunks=80,
                                     samplers=tuple(sampler.settings_names(["greedy"])))
    assert both.key == same.key and len({base.key, both.key, one.key}) == 3
    assert identity.ComparisonRequest.from_summary({"request": both.to_json()}) == both
    assert both.changes_from(base) == ["samplers: none vs {temp=0,top_k=0,top_p=1,min_p=0; "
                                       "temp=0.6,top_k=20,top_p=0.95,min_p=0}"]
    assert one.changes_from(both) == ["samplers: {temp=0,top_k=0,top_p=1,min_p=0; temp=0.6,top_k=20,top_p=0.95,"
                                      "min_p=0} vs {temp=0,top_k=0,top_p=1,min_p=0}"]


# --------------------------------------------------------------------------------------------------
# stores: reuse, resume, refuse, replace
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def inputs():
    rng = np.random.default_rng(3)
    tokens = make_tokens(rng, N, CTX, V)
    return tokens, synth_logits(rng, tokens, V)


def test_finished_store_of_another_model_is_refused_then_replaced_atomically(tmp_path, inputs):
    tokens, logits = inputs
    code = SqrtLogCode()
    path = tmp_path / "Q8_0.qeval"
    write_store(path, tokens, logits, V, label="Q8_0", model=model("A"))
    before = path.read_bytes()
    wanted = make_header(tokens, V, code, "Q8_0", model=model("B"))
    with pytest.raises(StoreConflict, match=r"already holds a different capture \(model differs: stored A\.gguf "
                                            r"\(41414141.*, requested B\.gguf \(42424242.*--force"):
        StoreWriter.open(path, wanted, tokens, code.lut())
    assert path.read_bytes() == before

    # replaced: written beside the old store, which stays whole until the new one is complete
    with StoreWriter.open(path, wanted, tokens, code.lut(), replace=True) as w:
        assert w.path == replacement_path(path) and w.done_chunks == set()
        w.write_chunk(build_chunk(0, logits[0], tokens[0, CTX // 2 + 1:], code))
    assert path.read_bytes() == before  # interrupted: nothing lost
    with StoreWriter.open(path, wanted, tokens, code.lut(), replace=True) as w:
        assert w.done_chunks == {0}  # the interrupted replacement is resumed
        for c in range(1, N):
            w.write_chunk(build_chunk(c, logits[c], tokens[c, CTX // 2 + 1:], code))
        w.finish()
        assert w.path == path
    assert not replacement_path(path).exists()
    with StoreReader(path, verify_chunks=True) as r:
        assert r.complete and r.header.model == model("B")
    with pytest.raises(StoreComplete):  # and now it is what is asked for
        StoreWriter.open(path, wanted, tokens, code.lut())


def test_a_store_without_an_error_record_is_another_form(tmp_path, inputs):
    """A store's form (its code and whether it records its error at capture) is part of its identity: a complete
    older store of the capture still stands for it (it reads; its bounds read "not recorded"; --force replaces it),
    an incomplete one is not resumed in the other form (refused, naming the difference), and a comparison against one
    form never stands for a comparison against the other."""
    tokens, logits = inputs
    path = tmp_path / "Q8_0.qeval"
    old = write_store(path, tokens, logits, V, code=SqrtLogCode(error=None), label="Q8_0", model=model("A"))
    wanted = make_header(tokens, V, SqrtLogCode(), "Q8_0", model=model("A"))
    with pytest.raises(StoreComplete) as done:
        StoreWriter.open(path, wanted, tokens, SqrtLogCode().lut())
    assert done.value.older_form
    torn = write_store(tmp_path / "T.qeval", tokens, logits, V, code=SqrtLogCode(error=None), label="Q8_0",
                       model=model("A"), finish=False)
    with pytest.raises(StoreConflict, match=r"codec error: none vs \{.*band_width.*\} \(stored vs requested\)"):
        StoreWriter.open(torn.path, wanted, tokens, SqrtLogCode().lut())
    assert identity.form(old.header) == SqrtLogCode(error=None).params()
    assert identity.form(wanted) == SqrtLogCode().form() != SqrtLogCode().params()
    new = write_store(tmp_path / "NEW.qeval", tokens, logits, V, label="Q8_0", model=model("A"))
    cand = write_store(tmp_path / "C.qeval", tokens, {c: perturb(np.random.default_rng(c), x, 0.3)
                                                       for c, x in logits.items()}, V, label="C", model=model("B"))
    with StoreReader(old.path) as a, StoreReader(new.path) as b, StoreReader(cand.path) as c:
        assert identity.comparison_request(a, c, N).key != identity.comparison_request(b, c, N).key


def test_interrupted_store_of_another_capture_is_refused_not_resumed(tmp_path, inputs):
    tokens, logits = inputs
    code = SqrtLogCode()
    path = tmp_path / "cand.qeval"
    q8 = {"type_k": "q8_0", "type_v": "q8_0", "flash_attn": "on"}
    write_store(path, tokens, logits, V, finish=False, order=[0], model=model("A"), kv=q8)
    before = path.read_bytes()
    wanted = make_header(tokens, V, code, model=model("A"), kv={"type_k": "f16", "type_v": "f16", "flash_attn": "auto"})
    with pytest.raises(StoreConflict, match=r"KV type_k: q8_0 vs f16; KV type_v: q8_0 vs f16 \(stored vs requested\)"):
        StoreWriter.open(path, wanted, tokens, code.lut())
    assert path.read_bytes() == before
    fewer = make_header(tokens[:2], V, code, model=model("A"), kv=q8)
    with pytest.raises(StoreConflict, match="n_chunks differs: stored 4, requested 2"):
        StoreWriter.open(path, fewer, tokens[:2], code.lut())


def test_finished_store_answers_for_fewer_chunks_of_the_same_windows_only(tmp_path, inputs):
    tokens, logits = inputs
    code = SqrtLogCode()
    path = tmp_path / "ref.qeval"
    write_store(path, tokens, logits, V, model=model("A"))
    with pytest.raises(StoreComplete):  # a capture of 2 chunks of the same corpus: held already
        StoreWriter.open(path, make_header(tokens[:2], V, code, model=model("A")), tokens[:2], code.lut())
    other = make_tokens(np.random.default_rng(9), 2, CTX, V)
    with pytest.raises(StoreConflict, match=r"token windows differ: it holds chunks 0:4 of 4"):
        StoreWriter.open(path, make_header(other, V, code, model=model("A")), other, code.lut())
    more = np.concatenate([tokens, other])
    with StoreWriter.open(path, make_header(more, V, code, model=model("A")), more, code.lut()) as grower:
        assert grower.done_chunks == {0, 1, 2, 3}  # the same capture over more windows grows (tests/test_store.py)
    with pytest.raises(StoreConflict, match=r"chunks 0:6 of 6 .* were asked for"):  # another model's does not
        StoreWriter.open(path, make_header(more, V, code, model=model("B")), more, code.lut())


# --------------------------------------------------------------------------------------------------
# saved results: check, compare, leaderboard
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    """REF (model A) and candidates C1, C2 over 4 chunks, compared and saved; returns (runs, tokens, logits)."""
    rng = np.random.default_rng(11)
    runs = tmp_path / "runs"
    runs.mkdir()
    tokens = make_tokens(rng, N, CTX, V)
    ref = synth_logits(rng, tokens, V)
    write_store(runs / "REF.qeval", tokens, ref, V, label="REF", model=model("A"))
    for label, sigma in (("C1", 0.3), ("C2", 0.9)):
        write_store(runs / f"{label}.qeval", tokens, {c: perturb(rng, x, sigma) for c, x in ref.items()}, V,
                    label=label, model=model(label))
        api.kld_report("REF", label, runs_dir=runs, threads=1, save_result=True)
    return runs, tokens, ref


def result_file(runs: Path, label: str) -> str:
    return str(runs / "results" / f"{label}.vs.REF.json")


def test_saved_result_records_its_request_and_versions(saved):
    runs, tokens, _ = saved
    summary = json.loads(Path(result_file(runs, "C1")).read_text())
    request = identity.ComparisonRequest.from_summary(summary)
    assert summary["request"]["key"] == request.key and summary["qeval_version"]
    assert request.metrics_version == identity.METRICS_VERSION and request.chunks == N
    assert request.reference["tokens_sha256"] == identity.tokens_sha256(tokens)
    assert request.reference["model"] == {"fingerprint": model("A")["fingerprint"]}
    assert request.candidate["model"] == {"fingerprint": model("C1")["fingerprint"]}


def test_results_against_a_replaced_reference_are_refused(saved, capsys):
    runs, tokens, ref = saved
    (runs / "REF.qeval").unlink()
    write_store(runs / "REF.qeval", tokens, ref, V, label="REF", model=model("Z"))  # same label, another model
    with pytest.raises(MismatchError, match=r"measured against reference 'REF' .*not 'REF': reference model "
                                            r"fingerprint: 414141414141… vs 5a5a5a5a5a5a…"):
        gate.check_report("REF", result_file(runs, "C1"), max_kld=10.0, runs_dir=runs)
    with pytest.raises(MismatchError, match=r"candidate A .*reference model fingerprint"):
        paired.paired_report("REF", result_file(runs, "C1"), result_file(runs, "C2"), runs_dir=runs)
    code, _, err = run_cli_in_process(capsys, "check", "--ref", "REF", "--cand", result_file(runs, "C1"),
                                      "--max-kld", "10", "--runs-dir", runs)
    assert_one_line_error(code, err, "reference model fingerprint")


def test_results_over_other_tokens_are_refused(saved):
    runs, _, ref = saved
    other = make_tokens(np.random.default_rng(12), N, CTX, V)
    (runs / "REF.qeval").unlink()
    write_store(runs / "REF.qeval", other, ref, V, label="REF", model=model("A"))
    with pytest.raises(MismatchError, match="reference token ids sha256"):
        gate.check_report("REF", result_file(runs, "C2"), max_kld=10.0, runs_dir=runs)


def stale(path: str, edit) -> str:
    summary = json.loads(Path(path).read_text())
    edit(summary)
    Path(path).write_text(json.dumps(summary))
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda s: s["request"].update(metrics_version=0), "computed with metrics version 0"),
    (lambda s: s.pop("request"), "saved by an older qeval that did not record what it measured"),
], ids=["older-metrics-version", "no-request"])
def test_stale_results_are_refused_by_check_compare_and_leaderboard(saved, capsys, edit, message):
    runs, _, _ = saved
    old = stale(result_file(runs, "C1"), edit)
    with pytest.raises(QevalError, match=message):
        gate.check_report("REF", old, max_kld=10.0, runs_dir=runs)
    with pytest.raises(QevalError, match=f"candidate A .*{message}"):
        paired.paired_report("REF", old, result_file(runs, "C2"), runs_dir=runs)
    with pytest.raises(QevalError, match=message):
        leaderboard.build([runs])
    code, _, err = run_cli_in_process(capsys, "leaderboard", runs, "--out", runs / "board")
    assert_one_line_error(code, err, message, "recompute it (qeval kld --ref REF --cand C1 --save-result")
    assert not (runs / "board").exists()


def test_leaderboard_refuses_results_of_one_label_against_two_reference_models(saved, tmp_path):
    runs, tokens, ref = saved
    other = tmp_path / "other"
    other.mkdir()
    write_store(other / "REF.qeval", tokens, ref, V, label="REF", model=model("Z"))
    shutil.copy(runs / "C2.qeval", other / "C2.qeval")
    (runs / "results" / "C2.vs.REF.json").unlink()
    api.kld_report("REF", "C2", runs_dir=other, threads=1, save_result=True)
    with pytest.raises(QevalError, match=r"different references or token sets \(reference model fingerprint"):
        leaderboard.build([runs, other])


# --------------------------------------------------------------------------------------------------
# real captures: Gemma-3-270M, n_ctx 32, one chunk
# --------------------------------------------------------------------------------------------------
REAL_CTX = 32


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory) -> Path:
    """A Q8_0 reference store, captured once (copied into each test's runs directory)."""
    runs = tmp_path_factory.mktemp("reference")
    api.capture_store(str(models["Q8_0"]), "R", runs_dir=runs, n_ctx=REAL_CTX, chunks=1)
    return runs / "R.qeval"


@pytest.fixture
def runs(reference, tmp_path) -> Path:
    d = tmp_path / "runs"
    d.mkdir()
    shutil.copy(reference, d / "R.qeval")
    return d


def test_capture_under_a_label_of_another_model_is_refused_or_replaced(models, runs, capsys):
    again, text = api.capture_store(str(models["Q8_0"]), "R", runs_dir=runs, n_ctx=REAL_CTX, chunks=1)
    assert again["status"] == "already complete" and "nothing to do" in text  # the same capture: reused
    before = (runs / "R.qeval").read_bytes()
    code, _, err = run_cli_in_process(capsys, "capture", models["Q4_0"], "--label", "R", "-c", REAL_CTX,
                                      "--chunks", 1, "--runs-dir", runs)
    assert_one_line_error(code, err, "R.qeval already holds a different capture (model differs: stored "
                          "gemma-3-270m-Q8_0.gguf (", "requested gemma-3-270m-Q4_0.gguf (", "--force")
    assert (runs / "R.qeval").read_bytes() == before
    replaced, _ = api.capture_store(str(models["Q4_0"]), "R", runs_dir=runs, n_ctx=REAL_CTX, chunks=1, force=True)
    assert replaced["status"] == "complete" and replaced["chunks_written"] == 1
    with StoreReader(runs / "R.qeval", verify_chunks=True) as store:
        assert store.complete and store.header.model["file_name"] == "gemma-3-270m-Q4_0.gguf"
    assert not replacement_path(runs / "R.qeval").exists()


def test_kld_save_under_a_label_of_another_model_is_refused_or_replaced(models, runs):
    first, _ = api.kld_report("R", str(models["Q4_0"]), runs_dir=runs, save="S")
    with pytest.raises(StoreConflict, match=r"S\.qeval already holds a different capture \(model differs: stored "
                                            r"gemma-3-270m-Q4_0\.gguf"):
        api.kld_report("R", str(models["Q2_K"]), runs_dir=runs, save="S")
    second, _ = api.kld_report("R", str(models["Q2_K"]), runs_dir=runs, save="S", force=True)
    stored, _ = api.kld_report("R", "S", runs_dir=runs)
    assert stored["candidate"]["model"]["file_name"] == "gemma-3-270m-Q2_K.gguf"
    assert stored["kld"] == second["kld"] != first["kld"]


def test_matrix_recomputes_a_pair_whose_label_now_names_another_model(models, runs):
    def matrix(quant: str) -> tuple[dict, str]:  # its candidates' stores kept: they are reused too
        return api.matrix_report(f"R={models['Q8_0']}", [f"Q4={models[quant]}"], ["f16"], chunks=1, n_ctx=REAL_CTX,
                                 runs_dir=runs, progress=False, keep_logits=True)

    def saved_summary() -> dict:
        return json.loads((runs / "results" / "Q4.vs.R.json").read_text())

    first, _ = matrix("Q4_0")
    second, text = matrix("Q2_K")
    assert "Q4: recomputed: its saved result answers another request (candidate model fingerprint:" in text
    assert "done earlier" not in text
    assert saved_summary()["candidate"]["model"]["file_name"] == "gemma-3-270m-Q2_K.gguf"
    assert second["results"][0]["kld"] != first["results"][0]["kld"]
    with StoreReader(runs / "Q4.qeval") as store:
        assert store.complete and store.header.model["file_name"] == "gemma-3-270m-Q2_K.gguf"

    third, text = matrix("Q2_K")  # the request is what was computed: reused
    assert "Q4: done earlier, skipped" in text and third["results"][0]["kld"] == second["results"][0]["kld"]

    stale(str(runs / "results" / "Q4.vs.R.json"), lambda s: s["request"].update(metrics_version=0))
    fourth, text = matrix("Q2_K")  # other formulas: recomputed, from the stored candidate
    with StoreReader(runs / "R.qeval") as reference:  # the default form's reference is read uncoded: its version
        version = identity.metrics_version_of(identity.reference_identity(reference, 1))
    assert version == identity.UNCODED_REFERENCE_VERSION
    assert f"Q4: recomputed: its saved result answers another request (metrics version: 0 vs {version}" in text
    assert saved_summary()["candidate"]["path"] == str(runs / "Q4.qeval")
    assert fourth["results"][0]["kld"] == second["results"][0]["kld"]


def test_matrix_recomputes_a_pair_saved_without_the_samplers_asked_for(models, runs):
    def matrix(*samplers) -> tuple[dict, str]:  # its candidate's store kept: it is reused too
        return api.matrix_report(f"R={models['Q8_0']}", [f"Q4={models['Q4_0']}"], ["f16"], chunks=1, n_ctx=REAL_CTX,
                                 runs_dir=runs, progress=False, samplers=samplers, keep_logits=True)

    plain, _ = matrix()
    result, text = matrix("qwen3.5-thinking", "greedy")
    assert ("Q4: recomputed: its saved result answers another request (samplers: none vs {temp=0,top_k=0,top_p=1,"
            "min_p=0; temp=0.6,top_k=20,top_p=0.95,min_p=0}, saved vs now)") in text
    saved = json.loads((runs / "results" / "Q4.vs.R.json").read_text())
    assert saved["candidate"]["path"] == str(runs / "Q4.qeval")  # from its stored candidate, no model run
    assert list(saved["samplers"]) == ["qwen3.5-thinking", "greedy"]
    # samplers read the (hidden) reference coded, through the portable replay: the same KLD within its error
    assert result["results"][0]["kld"]["mean"] == pytest.approx(plain["results"][0]["kld"]["mean"], rel=1e-5)
    row = result["rows"][0]
    for name in ("qwen3.5-thinking", "greedy"):
        assert row[f"tvd_pct@{name}"] == saved["metrics"][f"tvd_pct@{name}"]["value"]
        assert f"mean TVD % @{name} ± SE" in text
    _, text = matrix("greedy", "qwen3.5-thinking")  # the same set: reused
    assert "Q4: done earlier, skipped" in text
