"""Boards across uploaders and machines (qeval.storage.results_dataset, qeval.orchestrate.contributions,
qeval.present.contributed_board): `qeval publish-results` uploads saved results to a Hub dataset through
huggingface_hub, to the local Hub-like server of tests/fake_hub.py (the upload calls too), and `qeval board` builds
one leaderboard from several contributors' results. Every result comes from the real pipeline (synthetic stores
compared and saved: tests/test_leaderboard.py's build_results); nothing here reaches the internet or runs a model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import assert_cli_error, run_cli
from deployment_records import machine, memory_entry, record_json, speed_entry, write_record
from fake_hub import fake_hub, upload_hub  # noqa: F401 - fake_hub is a fixture
from test_leaderboard import _model, build_results

from qeval.errors import QevalError
from qeval.orchestrate import contributions
from qeval.storage import results_dataset

DATASET = "org/results"
KEY = f"datasets/{DATASET}"  # the fake hub's key of the dataset repository
HERE = machine()  # the machine the board is built on, and contributor A's
GPU = machine("Intel Xeon 8480+", backend="CUDA", cores=16,
              gpus=({"name": "NVIDIA H100 80GB HBM3", "driver": "580.65", "memory_bytes": 80 << 30},))
A = (("Q8_0", "m-Q8_0.gguf", "Q8_0", 1.06, 8.5, "f16", 0.15), ("Q4_0", "m-Q4_0.gguf", "Q4_0", 0.60, 4.5, "f16", 0.6))
B = (("Q2_K", "m-Q2_K.gguf", "Q2_K", 0.45, 2.9, "f16", 1.6),)


@pytest.fixture
def hub(fake_hub, monkeypatch):  # noqa: F811 - the fixture of tests/fake_hub.py
    upload_hub(monkeypatch)
    monkeypatch.setattr(contributions, "this_machine", lambda: HERE["id"])
    return fake_hub


@pytest.fixture(scope="module")
def contributors(tmp_path_factory) -> dict[str, Path]:
    """Three runs directories: A and B measured against one reference (the same seed: the same store), B's row with
    a speed and memory record on the GPU machine; C against another reference under the same label."""
    root = tmp_path_factory.mktemp("contributors")
    runs = {"A": build_results(root / "a", candidates=A, seed=3), "B": build_results(root / "b", candidates=B, seed=3),
            "C": build_results(root / "c", candidates=B, seed=4)}
    write_record(runs["B"], record_json("Q2_K", _model("x", "Q2_K", 0, 0)["fingerprint"], "f16", GPU,
                                        [memory_entry(4096, {"model": 461, "kv": 64, "compute": 300})],
                                        [speed_entry("tg", 128, 0, 180.0)]))
    return runs


def contribute(monkeypatch, runs: Path, on: dict = HERE) -> dict:
    monkeypatch.setattr(contributions, "upload_machine", lambda: on)
    res = run_cli("publish-results", runs, f"hf:{DATASET}", "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def board(tmp_path, *extra) -> tuple[dict, str]:
    out = tmp_path / "board"
    res = run_cli("board", f"hf:{DATASET}", "--out", out, *extra)
    assert res.returncode == 0, res.stderr
    return json.loads((out / "leaderboard.json").read_text()), (out / "leaderboard.md").read_text()


def saved(runs: Path, label: str) -> dict:
    return json.loads((runs / "results" / f"{label}.vs.REF.json").read_text())


# --- publishing --------------------------------------------------------------------------------------------------
def test_results_go_up_at_their_identitys_paths_with_a_manifest_of_their_sha256(hub, contributors, monkeypatch):
    out = contribute(monkeypatch, contributors["A"])
    assert [c.partition("/lfs-upload/")[0] for c in hub.calls] == [
        "POST /api/repos/create", f"POST /api/datasets/{DATASET}/preupload/main",
        f"POST /{KEY}.git/info/lfs/objects/batch", "PUT ", "PUT ", f"POST /api/datasets/{DATASET}/commit/main"]
    files = hub.repos[KEY]
    reference = results_dataset.reference_id(saved(contributors["A"], "Q8_0"))
    expected = {path for label, *_ in A
                for path in results_dataset.result_paths(reference, results_dataset.result_id(
                    saved(contributors["A"], label)))}
    assert set(files) == expected | {out["contribution"]}
    manifest = results_dataset.read_contribution(files[out["contribution"]], out["contribution"], "m")
    assert manifest.machine == HERE and {r.candidate["label"] for r in manifest.results} == {"Q8_0", "Q4_0"}
    listed = {f.path: f.sha256 for r in manifest.results for f in (r.file, r.per_token)}
    assert listed == {p: hashlib.sha256(files[p]).hexdigest() for p in expected}
    q8 = next(r for r in manifest.results if r.candidate["label"] == "Q8_0")
    assert q8.metrics["kld_mean"]["value"] == saved(contributors["A"], "Q8_0")["kld"]["mean"]
    assert q8.reference_label == "REF" and q8.ran_on == {"backend": "not recorded"}
    # nothing private: the summaries name their stores by file name only
    assert not any(str(contributors["A"].parent) in data.decode("latin-1") for data in files.values())
    # the same measurement uploads to the same names
    contribute(monkeypatch, contributors["A"])
    assert set(hub.repos[KEY]) == set(files)


def test_upload_refuses_a_private_path_in_what_identifies_a_result(hub, contributors, monkeypatch, tmp_path):
    summary = saved(contributors["A"], "Q8_0")
    summary["request"]["candidate"]["numerics"] = {"env": {"GGML_CACHE": str(Path.home() / "ggml-cache")}}
    private = tmp_path / "results" / "Q8_0.vs.REF.json"
    private.parent.mkdir()
    private.write_text(json.dumps(summary))
    monkeypatch.setattr(contributions, "upload_machine", lambda: HERE)
    res = run_cli("publish-results", private, f"hf:{DATASET}")
    assert_cli_error(res, "request.candidate.numerics.env.GGML_CACHE", "would make public", "relative")
    assert_cli_error(run_cli("publish-results", private, "org/results"), "hf:USER/DATASET")
    assert hub.calls == []  # refused before any request


# --- the board ---------------------------------------------------------------------------------------------------
def test_two_contributors_results_make_one_board_the_other_machines_row_marked(hub, contributors, monkeypatch,
                                                                               tmp_path):
    contribute(monkeypatch, contributors["A"])
    contribute(monkeypatch, contributors["B"], on=GPU)
    data, text = board(tmp_path, "--ref", "REF")
    klds = {label: saved(contributors[who], label)["kld"]["mean"] for who, rows in (("A", A), ("B", B))
            for label, *_ in rows}
    rows = {r["label"]: r for r in data["rows"] if not r["reference"]}
    assert {label: r["kld_mean"] for label, r in rows.items()} == klds
    marks = {label: o["mark"] for label, o in data["sources"]["rows"].items()}
    assert marks == {"Q8_0": "", "Q4_0": "", "Q2_K": "[1]"}
    assert data["sources"]["rows"]["Q2_K"]["machine"] == GPU["id"][:12]
    assert "| Q2_K [1] |" in text and "| Q8_0 |" in text
    assert "[1] measured on another machine or backend: Intel Xeon 8480+ (16 cores), NVIDIA H100" in text
    # speed and memory stay with their machine: the GPU's figures in a table of their own
    assert f"**Measured on another machine, {GPU['id'][:12]}:**" in text
    assert data["deployment"]["records"]["Q2_K"].keys() == {GPU["id"][:12]}
    assert data["sources"]["apart"] == [] and data["sources"]["refused"] == []
    page = (tmp_path / "board" / "leaderboard.html").read_text()
    assert ">Q2_K [1]<" in page and '<pre id="sources">' in page and "[1] measured on another machine" in page


def test_the_board_machine_is_asked_for_and_its_figures_fill_the_columns(hub, contributors, monkeypatch, tmp_path):
    contribute(monkeypatch, contributors["A"])
    contribute(monkeypatch, contributors["B"], on=GPU)
    data, text = board(tmp_path, "--machine", GPU["id"][:6])
    assert {label: o["mark"] for label, o in data["sources"]["rows"].items()} == {"Q8_0": "[1]", "Q4_0": "[1]",
                                                                                  "Q2_K": ""}
    assert data["deployment"]["machine"] == GPU["id"][:12] and "| Q2_K | Q2_K |" in text
    assert "[1] measured on another machine or backend: AMD EPYC 9B14 (2 cores)" in text


def test_results_of_two_references_are_never_merged(hub, contributors, monkeypatch, tmp_path):
    contribute(monkeypatch, contributors["A"])
    contribute(monkeypatch, contributors["C"])
    # a result against a reference of another tokenizer (its request says so)
    other = saved(contributors["A"], "Q8_0")
    other["request"]["reference"]["tokenizer_sha256"] = "cd" * 32
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "Q8_0.vs.REF.json").write_text(json.dumps({**other, "per_token_file": None}))
    contribute(monkeypatch, tmp_path / "d")
    res = run_cli("board", f"hf:{DATASET}", "--out", tmp_path / "board", "--ref", "REF")
    assert_cli_error(res, "results of 3 references labelled REF", "--ref")
    reference = results_dataset.reference_id(saved(contributors["A"], "Q8_0"))
    data, text = board(tmp_path, "--ref", reference[:10])
    assert sorted(r["label"] for r in data["rows"]) == ["Q4_0", "Q8_0"]
    apart = sorted(data["sources"]["apart"], key=lambda a: "tokenizer" in a["why"])
    assert [a["result"].startswith(f"hf:{DATASET}/results/") and "another reference" in a["why"] for a in apart] \
        == [True, True]
    assert "token ids sha256" in apart[0]["why"] and f"tokenizer:  vs {'cd' * 6}" in apart[1]["why"]
    assert "**Not on this board (2):**" in text


def test_a_tampered_or_partial_file_is_refused_by_name_and_the_board_built_from_the_rest(hub, contributors,
                                                                                        monkeypatch, tmp_path):
    q8 = next(e for e in contribute(monkeypatch, contributors["A"])["results"] if e["candidate"]["label"] == "Q8_0")
    q2 = contribute(monkeypatch, contributors["B"], on=GPU)["results"][0]
    files = hub.repos[KEY]
    files[q8["file"]] = files[q8["file"]].replace(b'"mean": 0.', b'"mean": 1.', 1)  # changed after upload
    files[q2["per_token"]] = files[q2["per_token"]][:100]  # cut short
    data, text = board(tmp_path)
    assert [r["label"] for r in data["rows"]] == ["Q4_0"]  # Q2_K refused: its speed record is no row's
    refused = {r["file"]: r["why"] for r in data["sources"]["refused"]}
    assert refused.keys() == {f"hf:{DATASET}/{q8['file']}", f"hf:{DATASET}/{q2['file']}"}
    assert "tampered with" in refused[f"hf:{DATASET}/{q8['file']}"]
    assert q2["per_token"] in refused[f"hf:{DATASET}/{q2['file']}"]
    assert "cut short (partial)" in refused[f"hf:{DATASET}/{q2['file']}"]
    assert "**Refused (2):**" in text and q8["file"] in text


def test_a_contribution_whose_manifest_does_not_read_is_refused_by_name(hub, contributors, monkeypatch, tmp_path):
    contribute(monkeypatch, contributors["A"])
    partial = contribute(monkeypatch, contributors["B"], on=GPU)["contribution"]
    hub.repos[KEY][partial] = hub.repos[KEY][partial][:200]
    data, _ = board(tmp_path)
    assert sorted(r["label"] for r in data["rows"]) == ["Q4_0", "Q8_0"]
    (refused,) = data["sources"]["refused"]
    assert refused["file"] == f"hf:{DATASET}/{partial}" and "partial or damaged" in refused["why"]


def test_what_a_board_cannot_be_built_from(hub, tmp_path):
    assert_cli_error(run_cli("board", "hf:org/none", "--out", tmp_path), "no dataset repository")
    hub.repos[KEY] = {"README.md": b"# nothing\n"}
    assert_cli_error(run_cli("board", f"hf:{DATASET}", "--out", tmp_path), "holds no qeval results",
                     "qeval publish-results")


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(version=2), "version 2 is not one this qeval reads"),
    (lambda m: m["machine"].update(cores=64), "machine id does not match"),
    (lambda m: m["results"][0].update(reference="0" * 64), "not the one its reference names"),
    (lambda m: m["results"][0].update(file="elsewhere.json"), "is not a listed file of role 'result'"),
    (lambda m: m["files"][0].update(role="store"), "role 'store' is none of"),
])
def test_a_contribution_manifest_is_read_trusting_nothing(hub, contributors, monkeypatch, change, message):
    name = contribute(monkeypatch, contributors["A"])["contribution"]
    manifest = json.loads(hub.repos[KEY][name])
    change(manifest)
    with pytest.raises(QevalError, match=message):
        results_dataset.read_contribution(json.dumps(manifest).encode(), name, "m")
