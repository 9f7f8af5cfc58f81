"""hf:USER/REPO[:QUANT] models (qeval.inputs.hub), against a local server that answers as the Hugging Face Hub
does for the calls huggingface_hub makes (tests/fake_hub.py): the repo listing and file downloads, a cut one resumed.
Nothing here reaches the internet; the real Hub is not tested."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_cli_error, make_pair, run_cli
from fake_hub import CUT, RELEASE, endpoint, fake_hub, offline, repo_of  # noqa: F401 - fake_hub is a fixture

from qeval.errors import QevalError
from qeval.inputs import hub
from qeval.orchestrate.matrix import parse_model_arg

# --- which file: the rule, without a server ------------------------------------------------------------------
def pick(names, tag: str = "") -> list[str]:
    return hub.pick_model_files(list(names), hub.HubSpec("org/r", tag), "org/r")


def test_a_tag_matches_as_a_whole_word_case_insensitively():
    assert pick(RELEASE, "Q4_K_M") == ["model-Q4_K_M.gguf"]
    assert pick(RELEASE, "q4_k_m") == ["model-Q4_K_M.gguf"]
    assert pick(RELEASE, "Q4_K") == ["model-Q4_K.gguf"]  # not Q4_K_M: a tag ends at '.' or '-'
    assert pick(RELEASE, "IQ4_XS") == ["model-IQ4_XS.gguf"]
    with pytest.raises(QevalError, match="no model file in org/r matches 'Q4_XS'"):
        pick(RELEASE, "Q4_XS")  # it must start a word too: no IQ4_XS


def test_a_split_set_is_picked_by_its_first_shard_and_comes_whole():
    assert pick(RELEASE, "Q8_0") == ["Q8_0/model-Q8_0-00001-of-00002.gguf", "Q8_0/model-Q8_0-00002-of-00002.gguf"]
    with pytest.raises(QevalError, match="holds 1 of the 2 shards of Q8_0/model-Q8_0"):
        pick([n for n in RELEASE if not n.endswith("00002-of-00002.gguf")], "Q8_0")


def test_projectors_and_importance_matrices_are_never_models():
    assert pick(["mmproj-model-Q8_0.gguf", "model-Q8_0.imatrix.gguf", "model-Q8_0.gguf"], "Q8_0") == \
        ["model-Q8_0.gguf"]
    with pytest.raises(QevalError, match="holds no GGUF model file"):
        pick(["mmproj-F16.gguf", "imatrix.gguf", "model.imatrix", "README.md"])


def test_without_a_tag_llama_cpp_default_q4_k_m_then_q8_0_then_the_first_file():
    assert pick(RELEASE) == ["model-Q4_K_M.gguf"]
    assert pick(["b-Q5_K_M.gguf", "b-Q8_0.gguf"]) == ["b-Q8_0.gguf"]
    assert pick(["b-Q6_K.gguf", "a-Q5_K_M-00002-of-00002.gguf", "a-Q5_K_M-00001-of-00002.gguf"]) == \
        ["a-Q5_K_M-00001-of-00002.gguf", "a-Q5_K_M-00002-of-00002.gguf"]


def test_several_matches_are_listed_and_a_path_picks_one():
    names = ["model-Q4_K_M.gguf", "model-v2-Q4_K_M.gguf"]
    with pytest.raises(QevalError, match=r"Q4_K_M matches 2 model files in org/r: model-Q4_K_M.gguf, "
                                         r"model-v2-Q4_K_M.gguf; give more of the name"):
        pick(names, "Q4_K_M")
    with pytest.raises(QevalError, match="Q4_K_M matches 2"):
        pick(names)  # the default tag too: no silent choice
    assert pick(names, "v2-Q4_K_M") == ["model-v2-Q4_K_M.gguf"]
    assert pick(names, "model-Q4_K_M.gguf") == ["model-Q4_K_M.gguf"]


def test_no_match_lists_the_quant_tags_there_are():
    with pytest.raises(QevalError) as err:
        pick(RELEASE, "Q5_K_M")
    assert str(err.value) == ("no model file in org/r matches 'Q5_K_M'; its quant tags: "
                              "F16, IQ4_XS, Q4_K, Q4_K_M, Q8_0")


@pytest.mark.parametrize("spec", ["hf:", "hf:org", "hf:/repo", "hf:org/", "hf:a/b/c", "hf:a/b/c:Q8_0"])
def test_a_malformed_spec_says_what_is_expected(spec):
    with pytest.raises(QevalError, match="expected hf:USER/REPO or hf:USER/REPO:QUANT"):
        hub.resolve_model(spec)


def test_other_specs_pass_unchanged():
    assert hub.resolve_model("models/x-Q4_K_M.gguf") == "models/x-Q4_K_M.gguf"
    assert not hub.is_hub_spec("Q8_0") and hub.is_hub_spec("hf:org/r")


# --- download through huggingface_hub, from the local server ------------------------------------------------
def test_a_tag_downloads_its_file_into_the_hub_cache(fake_hub, tmp_path, capsys):
    path = Path(hub.resolve_model("hf:org/release:Q4_K_M"))
    assert path.read_bytes() == RELEASE["model-Q4_K_M.gguf"]
    assert path.name == "model-Q4_K_M.gguf" and (tmp_path / "hf-cache") in path.parents
    assert "hf:org/release:Q4_K_M is org/release/model-Q4_K_M.gguf" in capsys.readouterr().err
    assert fake_hub.gets == [("model-Q4_K_M.gguf", None)]


def test_the_default_pick_is_said(fake_hub, capsys):
    assert Path(hub.resolve_model("hf:org/release")).name == "model-Q4_K_M.gguf"
    assert "hf:org/release is org/release/model-Q4_K_M.gguf (no QUANT: Q4_K_M, else Q8_0" in capsys.readouterr().err


def test_a_split_model_downloads_every_shard_and_returns_the_first(fake_hub):
    path = Path(hub.resolve_model("hf:org/release:Q8_0"))
    assert path.name == "model-Q8_0-00001-of-00002.gguf"
    second = path.with_name("model-Q8_0-00002-of-00002.gguf")  # beside it, where llama.cpp looks
    assert second.read_bytes() == RELEASE["Q8_0/model-Q8_0-00002-of-00002.gguf"]
    assert sorted(name for name, _ in fake_hub.gets) == ["Q8_0/model-Q8_0-00001-of-00002.gguf",
                                                         "Q8_0/model-Q8_0-00002-of-00002.gguf"]


def test_a_cut_download_resumes_with_a_range_request(fake_hub, monkeypatch):
    # huggingface_hub writes what it got chunk by chunk (10 MB ones): smaller chunks so that a cut download of
    # these small files has some on disk, for the retry to ask only for the rest
    monkeypatch.setattr("huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE", 256)
    fake_hub.cut.add("model-F16.gguf")
    path = Path(hub.resolve_model("hf:org/release:F16"))
    assert path.read_bytes() == RELEASE["model-F16.gguf"]
    assert fake_hub.gets == [("model-F16.gguf", None), ("model-F16.gguf", f"bytes={CUT}-")]


def test_offline_a_cached_model_is_found_without_a_request(fake_hub, httpserver, monkeypatch):
    downloaded = hub.resolve_model("hf:org/release:Q8_0")
    requests = len(httpserver.log)
    offline(monkeypatch)
    assert hub.resolve_model("hf:org/release:Q8_0") == downloaded
    assert len(httpserver.log) == requests


def test_offline_a_model_not_cached_is_an_error(fake_hub, monkeypatch):
    offline(monkeypatch)
    with pytest.raises(QevalError, match="HF_HUB_OFFLINE is set and nothing of org/release is in the cache"):
        hub.resolve_model("hf:org/release:Q4_K_M")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    hub.resolve_model("hf:org/release:Q4_K_M")
    offline(monkeypatch)
    with pytest.raises(QevalError, match=r"no model file in the cached files of org/release \(HF_HUB_OFFLINE is "
                                         r"set\) matches 'Q8_0'; its quant tags: Q4_K_M"):
        hub.resolve_model("hf:org/release:Q8_0")


def test_a_missing_repo(fake_hub):
    with pytest.raises(QevalError, match=r"^no model repository http://\S+/org/nothing \(a private one needs HF_TOKEN"):
        hub.resolve_model("hf:org/nothing:Q4_K_M")


@pytest.mark.parametrize("status", [401, 403])
def test_a_gated_repo_says_accept_the_terms_and_set_hf_token(fake_hub, status):
    fake_hub.repos["org/gated"] = repo_of("g-Q4_K_M.gguf")
    fake_hub.refused["org/gated"] = (status, "GatedRepo")
    with pytest.raises(QevalError, match=r"/org/gated is gated: accept its terms there, and set HF_TOKEN"):
        hub.resolve_model("hf:org/gated:Q4_K_M")


def test_a_download_refused_otherwise_says_set_hf_token(fake_hub):
    fake_hub.repos["org/private"] = repo_of("p-Q4_K_M.gguf")
    fake_hub.refused["org/private"] = (403, None)
    with pytest.raises(QevalError, match=r"/org/private refused access \(HTTP 403\): set HF_TOKEN"):
        hub.resolve_model("hf:org/private:Q4_K_M")


def test_no_network_says_hf_hub_offline_uses_the_cache(fake_hub, monkeypatch):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the with ends: nothing listens there
    endpoint(monkeypatch, f"http://127.0.0.1:{port}")
    with pytest.raises(QevalError, match=r"cannot reach the Hub at http://127.0.0.1:\d+ \(ConnectError\).*"
                                         r"set HF_HUB_OFFLINE=1 to use only models already in the cache"):
        hub.resolve_model("hf:org/release:Q4_K_M")


# --- where a model enters -----------------------------------------------------------------------------------
def test_matrix_model_arguments_take_hf_specs(fake_hub):
    label, path = parse_model_arg("hf:org/release:Q4_K_M")
    assert label == "Q4_K_M" and Path(path).name == "model-Q4_K_M.gguf"
    assert parse_model_arg("mine=hf:org/release:Q4_K_M") == ("mine", path)
    fake_hub.repos["org/plain"] = repo_of("plain-Q5_K_M-00001-of-00002.gguf", "plain-Q5_K_M-00002-of-00002.gguf")
    assert parse_model_arg("hf:org/plain")[0] == "plain-Q5_K_M"
    assert parse_model_arg("hf:org/release:Q8_0/model-Q8_0-00001-of-00002.gguf")[0] == "model-Q8_0"


def test_the_hub_settings_are_read_from_the_environment(fake_hub, httpserver, tmp_path):
    """A fresh process given HF_ENDPOINT and HF_HUB_CACHE downloads from there into there; then given
    HF_HUB_OFFLINE=1 too, it finds the file in that cache without a request: qeval overrides none of them."""
    env = {**os.environ, "HF_ENDPOINT": httpserver.url_for("").rstrip("/"),
           "HF_HUB_CACHE": str(tmp_path / "env-cache"), "PYTHONPATH": str(Path(hub.__file__).parents[2])}
    resolve = [sys.executable, "-c", "from qeval.inputs.hub import resolve_model as r; print(r('hf:org/release:F16'))"]
    path = subprocess.run(resolve, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(path).read_bytes() == RELEASE["model-F16.gguf"] and (tmp_path / "env-cache") in Path(path).parents
    requests = len(httpserver.log)
    offline_run = subprocess.run(resolve, env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                                 check=True)
    assert offline_run.stdout.strip() == path and len(httpserver.log) == requests


def test_kld_with_an_hf_candidate_that_is_no_model_is_one_error_line(fake_hub, tmp_path):
    pair = make_pair(tmp_path / "runs")
    res = run_cli("kld", "--ref", pair.ref.path, "--cand", "hf:org/release:Q4_K_M", "--runs-dir", pair.directory)
    assert res.returncode == 2
    assert_cli_error(res, "model-Q4_K_M.gguf")
    assert res.stderr.count("qeval: error:") == 1


# --------------------------------------------------------------------------------------------------
# whole repositories (matrix --repo, -m hf:USER/REPO:*)
# --------------------------------------------------------------------------------------------------
def test_a_whole_repo_is_every_model_once_labelled_by_uploader(fake_hub):
    from qeval.orchestrate.matrix import expand_models

    fake_hub.repos["other/release"] = repo_of("x-Q4_K_M.gguf", "x-UD-Q4_K_M.gguf", "mmproj-x-F16.gguf")
    args = expand_models(["mine=local.gguf"], ["hf:org/release", "hf:other/release:*"])
    assert args[0] == "mine=local.gguf"
    assert sorted(args[1:]) == sorted([
        "org.F16=hf:org/release:model-F16.gguf", "org.IQ4_XS=hf:org/release:model-IQ4_XS.gguf",
        "org.Q4_K=hf:org/release:model-Q4_K.gguf", "org.Q4_K_M=hf:org/release:model-Q4_K_M.gguf",
        "org.Q8_0=hf:org/release:Q8_0/model-Q8_0-00001-of-00002.gguf",
        # one uploader's two files with one tag keep their whole names
        "other.x-Q4_K_M=hf:other/release:x-Q4_K_M.gguf", "other.x-UD-Q4_K_M=hf:other/release:x-UD-Q4_K_M.gguf"])
    assert fake_hub.gets == []  # listing only: nothing is downloaded before the matrix runs a model
    label, path = parse_model_arg(next(a for a in args if a.startswith("org.Q8_0=")))
    assert label == "org.Q8_0" and path.endswith("model-Q8_0-00001-of-00002.gguf")
    assert {name for name, _ in fake_hub.gets} == {"Q8_0/model-Q8_0-00001-of-00002.gguf",
                                                   "Q8_0/model-Q8_0-00002-of-00002.gguf"}


def test_include_and_exclude_filter_a_repo(fake_hub):
    from qeval.orchestrate.matrix import expand_models

    kept = expand_models([], ["hf:org/release"], include=("*Q4_K*", "*Q8_0*"), exclude=("*Q4_K.gguf",))
    assert [a.partition("=")[0] for a in kept] == ["org.Q8_0", "org.Q4_K_M"]
    with pytest.raises(QevalError, match=r"no model file of org/release is left .*model-F16.gguf"):
        expand_models([], ["hf:org/release"], include=("*Q2_K*",))
    with pytest.raises(QevalError, match="filter whole repositories"):
        expand_models(["a.gguf"], [], include=("*Q4*",))
    with pytest.raises(QevalError, match="without a QUANT"):
        expand_models([], ["hf:org/release:Q4_K_M"])


def test_matrix_without_candidates_or_with_a_bad_repo_is_one_message(fake_hub, tmp_path):
    assert_cli_error(run_cli("matrix", "--ref", tmp_path / "ref.gguf", "--runs-dir", tmp_path), "-m MODEL")
    assert_cli_error(run_cli("matrix", "--ref", tmp_path / "ref.gguf", "--repo", "hf:org/missing",
                             "--runs-dir", tmp_path), "org/missing")


# --------------------------------------------------------------------------------------------------
# the uploader's path, end to end: a release on the (local) Hub -> matrix -> a card merged into its README
# --------------------------------------------------------------------------------------------------
SAMPLE_CARD = "---\nlicense: gemma\ntags:\n- gguf\n---\n\n# gemma-3-270m GGUF\n\nQuants of Gemma-3-270M.\n"


def test_the_uploaders_path_from_a_hub_repo_to_a_merged_card(fake_hub, models, tmp_path):
    """Real Gemma-3-270M GGUFs served as a Hub repository: the reference and every other quant of the repo are
    downloaded through huggingface_hub, measured with a control row, and the card lands in the repo's README
    between its markers, every other byte kept; a second merge changes nothing."""
    quants = ("Q8_0", "Q4_K_M", "Q2_K")
    fake_hub.repos["demo/gemma-3-270m-GGUF"] = {"README.md": SAMPLE_CARD.encode(),
                                                **{models[q].name: models[q].read_bytes() for q in quants}}
    runs = tmp_path / "runs"
    res = run_cli("matrix", "--ref", "hf:demo/gemma-3-270m-GGUF:Q8_0", "--repo", "hf:demo/gemma-3-270m-GGUF",
                  "-c", "256", "--chunks", "2", "--json", "--runs-dir", runs)
    assert res.returncode == 0, res.stderr
    by_label = {r["candidate"]["label"]: r for r in json.loads(res.stdout)["results"]}
    assert set(by_label) == {"demo.Q4_K_M", "demo.Q2_K", "control"}  # the reference's own file is no pair
    assert by_label["control"]["kld"]["mean"] < by_label["demo.Q4_K_M"]["kld"]["mean"] < \
        by_label["demo.Q2_K"]["kld"]["mean"]
    readme = tmp_path / "README.md"
    readme.write_text(SAMPLE_CARD)
    res = run_cli("card", runs, "--out", tmp_path / "card", "--merge", readme)
    assert res.returncode == 0, res.stderr
    merged = readme.read_text()
    before, _, rest = merged.partition("<!-- qeval-card:begin -->")
    block, _, after = rest.partition("<!-- qeval-card:end -->")
    assert before.rstrip("\n") == SAMPLE_CARD.rstrip("\n") and after.strip() == ""
    assert "| demo.Q4_K_M |" in block and "| control |" in block and models["Q8_0"].name in block
    assert run_cli("card", runs, "--out", tmp_path / "card", "--merge", readme).returncode == 0
    assert readme.read_text() == merged
