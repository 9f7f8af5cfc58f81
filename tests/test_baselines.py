"""baselines/: every file validates, quotes its source verbatim, and bad files are refused clearly."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from conftest import REPO, assert_cli_error, run_cli
from synth_runs import make_runs

from qeval import api
from qeval.compare import metric_registry
from qeval.errors import QevalError
from qeval.orchestrate import baselines
from qeval.present import results
from qeval.storage.baselines import BASELINES_ENV, available, load_baseline, validate
from qeval.storage.runs import RESULTS_SUBDIR

FILES = sorted((REPO / "baselines").glob("*.json"))
# the articles the numbers come from: shared/ beside the checkout (as CI lays it out)
SOURCES = [REPO.parent / "shared" / "seeds", REPO.parent / "shared" / "reference"]


def test_shipped_baselines_load():
    assert len(FILES) >= 3
    assert {p.stem for p in available()} >= {p.stem for p in FILES}
    for path in FILES:
        b = load_baseline(path, metric_registry)
        assert b.entries and b.source["title"]
        for e in b.entries:
            assert e.quote or _measured_by_qeval(e), f"{path.name}: {e.id} quotes no source line"
            assert e.model


@pytest.mark.slow
def test_baselines_and_conversations_ship_in_a_wheel_install(tmp_path):
    """`pip install .` (not editable) copies the package out of the checkout: the baselines go with it."""
    import os
    import subprocess
    import sys

    target = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                            str(REPO)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(target)}
    env.pop(BASELINES_ENV, None)
    where = subprocess.run([sys.executable, "-c", "import qeval; print(qeval.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True)
    assert Path(where.stdout.strip()).is_relative_to(target)  # the installed copy, not the checkout
    shown = subprocess.run([sys.executable, "-m", "qeval", "baseline", "show"], cwd=tmp_path, env=env,
                           capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert all(path.stem in shown.stdout for path in FILES)
    # the shipped conversation suite and its template are package data too
    checked = subprocess.run([sys.executable, "-m", "qeval", "template", "conversations/gemma3-tokenizer_config.json",
                              "conversations/gemma3-chat-template.jinja"], cwd=target / "qeval" / "corpora", env=env,
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert "renderings of conversations" in checked.stdout


def _measured_by_qeval(entry) -> bool:
    """qeval's own results (baselines/qeval-*.json) come from a run, not from a quoted article."""
    return str(entry.settings.get("tool", "")).startswith("qeval")


def _numbers_in(text: str) -> set[float]:
    return {float(m) for m in re.findall(r"\d+\.\d+|\d+", text)}


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_every_number_is_in_its_quoted_source(path):
    b = load_baseline(path, metric_registry)
    if all(_measured_by_qeval(e) for e in b.entries):
        pytest.skip("qeval's own measurements: nothing to quote")
    for e in b.entries:
        quoted = " ".join(e.quote)
        for key, mv in e.metrics.items():
            assert abs(mv.value) in _numbers_in(quoted), f"{e.id}: {key} {mv.value} is not in its quote"
    src = next((d / b.source["file"] for d in SOURCES if (d / b.source["file"]).is_file()), None)
    if src is None:
        pytest.skip(f"source {b.source['file']} is not on this machine")
    text = " ".join(src.read_text(encoding="utf-8").split())
    for e in b.entries:
        for q in e.quote:
            assert " ".join(q.split()) in text, f"{e.id}: quote not in {src.name}: {q!r}"


def test_published_anchor_numbers():
    readme = load_baseline("llama-3-8b-llamacpp-readme", metric_registry)
    q4 = readme.entry("llama3-8b.q4_K_M")
    assert (q4.metrics["kld_mean"].value, q4.metrics["same_top1_pct"].value) == (0.031273, 91.901)
    assert q4.settings["n_ctx"] == 512 and q4.settings["corpus"] == "wikitext-2"
    follow = load_baseline("qwen3.5-35b-a3b-rtx5080-followup", metric_registry)
    e2 = follow.entry("e2.UD-Q4_K_XL")
    assert (e2.metrics["kld_mean"].value, e2.metrics["kld_max"].value, e2.metrics["same_top1_pct"].value) == \
        (0.1087, 1.2175, 86.2)
    assert e2.settings == {**follow.settings, "n_ctx": 512, "chunks": 80}
    assert follow.entry("e1.Q4_K_M.kv-q4_0").metrics["ppl"].value == 6.0422


GOOD = {"schema": "qeval-baseline/1", "title": "t", "source": {"title": "s"}, "model": "m",
        "entries": [{"id": "e", "candidate": {"quant": "Q4_K_M"}, "reference": {"quant": "Q8_0"},
                     "metrics": {"kld_mean": {"value": 0.03, "se": 0.001}, "ppl": 6.1}}]}


def broken(path: str, value):
    doc = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    d = doc
    for p in parents:
        d = d[int(p)] if isinstance(d, list) else d[p]
    if value is KeyError:
        del d[last]
    else:
        d[int(last) if isinstance(d, list) else last] = value
    return doc


@pytest.mark.parametrize("path,value,fragment", [
    ("schema", "qeval-baseline/9", "'schema' must be"),
    ("source", KeyError, "'source'"),
    ("source.title", "", "source.title"),
    ("entries", [], "non-empty list"),
    ("entries.0.metrics.kld_mean.value", "0.03", "kld_mean'.value must be a finite number"),
    ("entries.0.metrics.kld_mean.se", -1, ".se must be a non-negative"),
    ("entries.0.metrics.kld_avg", 1.0, "metric 'kld_avg' is unknown"),
    ("entries.0.reference", None, "'reference' is required"),
    ("entries.0.id", "bad id", "must be a name"),
    ("entries.0.settings", {"n_ctx": "512"}, "n_ctx must be an integer"),
    ("entries.0.candidate", {"kv": "f16"}, "needs a 'quant' or a 'label'"),
    ("entries.0.colour", "red", "unknown field(s) 'colour'"),
    ("model", KeyError, "'model' is required"),
])
def test_malformed_baselines_are_refused(path, value, fragment):
    validate(GOOD, metric_registry)
    with pytest.raises(QevalError) as exc:
        validate(broken(path, value), metric_registry, "x.json")
    assert fragment in str(exc.value) and str(exc.value).startswith("x.json:")


def test_duplicate_ids_and_bad_json(tmp_path):
    doc = copy.deepcopy(GOOD)
    doc["entries"].append(copy.deepcopy(doc["entries"][0]))
    with pytest.raises(QevalError, match="used twice"):
        validate(doc, metric_registry)
    p = tmp_path / "b.json"
    p.write_text("{not json")
    with pytest.raises(QevalError, match="not valid JSON"):
        load_baseline(p, metric_registry)
    with pytest.raises(QevalError, match="neither a file nor a known baseline"):
        load_baseline("no-such-baseline", metric_registry)


@pytest.fixture(scope="module")
def result_path(tmp_path_factory):
    runs = make_runs(tmp_path_factory.mktemp("base") / "runs")
    api.kld_report("REF", "B", runs_dir=runs, threads=1, save_result=True)
    return runs / RESULTS_SUBDIR / "B.vs.REF.json"


def test_result_converts_to_a_valid_baseline(result_path, tmp_path):
    summary = results.load_result(result_path).summary
    doc = baselines.baseline_from_result(summary, title="mine")
    out = tmp_path / "mine.json"
    out.write_text(json.dumps(doc))
    b = load_baseline(out, metric_registry)
    (e,) = b.entries
    assert e.id == "B" and e.candidate["label"] == "B" and e.reference["label"] == "REF"
    assert e.settings["n_ctx"] == summary.reference.n_ctx and e.settings["chunks"] == summary.chunks
    assert set(e.metrics) == set(metric_registry.METRICS)
    assert e.metrics["kld_mean"].value == summary.to_json()["kld"]["mean"] and e.metrics["kld_mean"].se == summary.to_json()["kld"]["se"]
    assert e.metrics["same_top1_pct"].value == pytest.approx(100 * summary.to_json()["same_top1"]["fraction"])
    assert e.metrics["kld_999"].value == summary.to_json()["kld"]["ladder"]["99.9%"] and e.metrics["kld_999"].se is None
    assert e.metrics["ppl_ratio"].se == summary.to_json()["perplexity"]["ratio_se"]
    assert baselines.pick_entry(b, summary.candidate, summary.reference) is e


def test_cli_baseline_show(result_path, tmp_path):
    listing = run_cli("baseline", "show")
    assert listing.returncode == 0 and "qwen3.5-35b-a3b-rtx5080-followup" in listing.stdout
    res = run_cli("baseline", "show", "qwen3.5-35b-a3b-rtx5080-followup")
    assert res.returncode == 0, res.stderr
    assert "| e2.UD-Q4_K_XL | Qwen3.5-35B-A3B | UD-Q4_K_XL | Q8_0 | kld_mean | 0.1087 | nats | ctx 512, 80 chunks" in res.stdout
    side = run_cli("baseline", "show", "llama-3-8b-llamacpp-readme", "--run", result_path, "--entry", "llama3-8b.q4_K_M",
                   "--json")
    assert side.returncode == 0, side.stderr
    out = json.loads(side.stdout)
    assert out["run"]["matched_entries"] == ["llama3-8b.q4_K_M"] and "kld_mean" in out["run"]["metrics"]
    text = run_cli("baseline", "show", "llama-3-8b-llamacpp-readme", "--run", result_path, "--entry", "llama3-8b.q4_K_M")
    row = next(line for line in text.stdout.splitlines() if line.startswith("| llama3-8b.q4_K_M") and "kld_mean" in line)
    assert row.count("±") == 2  # baseline and run side by side
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(broken("entries.0.metrics.kld_mean.value", "x")))
    assert_cli_error(run_cli("baseline", "show", bad), "bad.json", "kld_mean")
    assert_cli_error(run_cli("baseline", "show", "nope"), "neither a file nor a known baseline")
