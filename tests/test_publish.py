"""Published references (qeval.storage.reference_pack, qeval.orchestrate.publish): `qeval publish` uploads a store,
its manifest, results and a card through huggingface_hub to the local Hub-like server of tests/fake_hub.py (the
upload calls huggingface_hub makes, answered and stored there), and `--ref hf:USER/REPO:LABEL` pulls it into a fresh
huggingface_hub cache, checks it, and compares against it. Nothing here reaches the internet."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_cli_error, make_pair, make_tokens, perturb, run_cli, synth_logits, write_store
from fake_hub import fake_hub, upload_hub  # noqa: F401 - fake_hub is a fixture
from test_leaderboard import _model

from qeval.errors import QevalError
from qeval.storage import reference_pack
from qeval.storage.reference_pack import build_manifest, manifest_bytes, read_manifest
from qeval.storage.store import StoreReader

REPO = "org/refs"


@pytest.fixture
def hub(fake_hub, monkeypatch):  # noqa: F811 - the fixture of tests/fake_hub.py
    upload_hub(monkeypatch)
    return fake_hub


def fresh_cache(monkeypatch, folder: Path) -> None:
    """huggingface_hub's cache moved to an empty folder: a machine that never pulled anything."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    reference_pack._verified.clear()


def publish(store, *extra) -> dict:
    res = run_cli("publish", store, f"hf:{REPO}", "--json", *extra)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def kld_json(ref, cand, runs) -> dict:
    res = run_cli("kld", "--ref", ref, "--cand", cand, "--runs-dir", runs, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def published_manifest(hub, label: str = "REF") -> dict:
    return json.loads(hub.repos[REPO][f"{label}.reference.json"])


def republish_manifest(hub, manifest: dict, label: str = "REF") -> None:
    """The manifest on the server replaced by hand (what a tampered or broken repository serves)."""
    hub.repos[REPO][f"{label}.reference.json"] = manifest_bytes(manifest)


# --- the manifest ------------------------------------------------------------------------------------------------
def test_a_manifest_holds_no_local_path_user_name_or_home(tmp_path, monkeypatch):
    home = tmp_path / "home" / "alicequeval"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("USER", "alicequeval")
    monkeypatch.setattr("getpass.getuser", lambda: "alicequeval")
    pair = make_pair(home / "qeval-runs")
    corpus = {"name": "notes.txt", "source": str(home / "corpora" / "notes.txt"), "sha256": "ab" * 32}
    capture = {"cpu": "Test CPU", "numerics": {"build": {"llama_cpp_python": "0.3", "system_info": "CPU : AVX2 = 1"},
                                                "env": {"GGML_CACHE": f"{home}/cache"}, "gpu_layers": 0},
               "note": "made by alicequeval"}
    store = write_store(home / "qeval-runs" / "PRIV.qeval", pair.ref.tokens, pair.ref.logits, 2000, label="PRIV",
                        corpus=corpus, capture=capture)
    manifest = build_manifest(store.path, "CPU", [("PRIV.qeval", store.path, "store")])
    text = manifest_bytes(manifest).decode()
    assert "alicequeval" not in text and str(home) not in text and str(tmp_path) not in text
    assert manifest["corpus"]["source"] == "notes.txt" and manifest["build"]["env"] == {"GGML_CACHE": "cache"}
    assert manifest["files"] == [{"path": "PRIV.qeval", "sha256": hashlib.sha256(store.path.read_bytes()).hexdigest(),
                                  "bytes": store.path.stat().st_size, "role": "store"}]
    assert manifest["identity"]["tokens_sha256"] == store.header.tokens_sha256
    assert manifest["bounds"]["error"]["recorded"] is True and manifest["bounds"]["error"]["tokens"] > 0
    assert read_manifest(text.encode(), "m").store.sha256 == manifest["files"][0]["sha256"]


FLOOR_ROW = {"kind": "decode", "backend": "CPU", "build": {}, "path": "REF.qeval", "chunks": 3, "scored_tokens": 24,
             "kld_mean": 0.002, "kld_se": None, "same_top1": 0.96, "same_top1_se": 0.01}  # names the store: refused


def good_manifest(tmp_path) -> dict:
    pair = make_pair(tmp_path / "runs")
    return build_manifest(pair.ref.path, "CPU", [("REF.qeval", pair.ref.path, "store")])


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(version=2), "manifest version 2 is not one this qeval reads"),
    (lambda m: m.update(format="other"), "is not a qeval reference manifest"),
    (lambda m: m.pop("identity"), "lacks its field 'identity'"),
    (lambda m: m.update(sizes=[]), "field 'sizes' is not a JSON dict"),
    (lambda m: m["files"][0].update(sha256="ABC"), "is not 64 lowercase hex digits"),
    (lambda m: m["files"][0].update(path="../../etc/passwd"), "is not a relative path inside the repository"),
    (lambda m: m["files"][0].update(bytes=-1), "is not a size"),
    (lambda m: m["files"][0].update(role="model"), "role 'model' is none of"),
    (lambda m: m.update(files=[]), "exactly one file of role \"store\""),
    (lambda m: m.update(floors={}), "field 'floors' is not a JSON list"),
    (lambda m: m.update(floors=[{"kind": "decode"}]), "numerics-floor row's field 'backend' is missing"),
    (lambda m: m.update(floors=[{**FLOOR_ROW, "kld_mean": "0.1"}]), "field 'kld_mean' is missing or not a JSON float"),
    (lambda m: m.update(floors=[FLOOR_ROW]), "is no result file the manifest lists"),
])
def test_a_manifest_is_read_trusting_nothing(tmp_path, change, message):
    manifest = good_manifest(tmp_path)
    change(manifest)
    with pytest.raises(QevalError, match=message):
        read_manifest(manifest_bytes(manifest), "REF.reference.json")
    with pytest.raises(QevalError, match="is not a JSON manifest"):
        read_manifest(b"\xff{", "REF.reference.json")


# --- publish -----------------------------------------------------------------------------------------------------
def test_publish_makes_the_calls_huggingface_hub_makes_and_the_repo_holds_every_file(hub, tmp_path):
    pair = make_pair(tmp_path / "runs")
    card = tmp_path / "card.md"
    card.write_text("# REF\n\nA reference.\n")
    assert run_cli("kld", "--ref", pair.ref.path, "--cand", pair.cand.path, "--runs-dir", pair.directory,
                   "--save-result").returncode == 0
    out = publish(pair.ref.path, "--results", pair.directory, "--card", card)
    store = pair.ref.path.read_bytes()
    assert [c.partition("/lfs-upload/")[0] for c in hub.calls] == [
        "POST /api/repos/create", f"POST /api/models/{REPO}/preupload/main", f"POST /{REPO}.git/info/lfs/objects/batch",
        "PUT ", "PUT ", f"POST /api/models/{REPO}/commit/main"]  # the store and the per-token file by git LFS
    assert sorted(hub.repos[REPO]) == ["README.md", "REF.qeval", "REF.reference.json", "results/REF/CAND.vs.REF.json",
                                       "results/REF/CAND.vs.REF.npz"]
    assert hub.repos[REPO]["REF.qeval"] == store and hub.repos[REPO]["README.md"] == card.read_bytes()
    assert (hashlib.sha256(store).hexdigest(), len(store)) in hub.puts  # the store went through git LFS
    assert out["reference"] == f"hf:{REPO}:REF" and out["commit"] == hub.commits[REPO]
    assert out["manifest_bytes"] == len(hub.repos[REPO]["REF.reference.json"])
    manifest = read_manifest(hub.repos[REPO]["REF.reference.json"], "m")
    assert {f.path: f.sha256 for f in manifest.files} == \
        {p: hashlib.sha256(d).hexdigest() for p, d in hub.repos[REPO].items() if p != "REF.reference.json"}
    assert str(tmp_path) not in hub.repos[REPO]["results/REF/CAND.vs.REF.json"].decode()  # results made public too


def test_an_interrupted_publish_resumes_without_sending_the_store_again(hub, tmp_path):
    pair = make_pair(tmp_path / "runs")
    hub.failing_commits = 1
    res = run_cli("publish", pair.ref.path, f"hf:{REPO}")
    assert_cli_error(res, "HTTP 500")
    assert "REF.qeval" not in hub.repos[REPO] and len(hub.puts) == 1  # uploaded, never committed
    publish(pair.ref.path)
    assert len(hub.puts) == 1  # the Hub held the store's LFS object: not sent again
    assert hub.repos[REPO]["REF.qeval"] == pair.ref.path.read_bytes()


def test_publish_refuses_what_it_cannot_publish(hub, tmp_path):
    pair = make_pair(tmp_path / "runs")
    assert_cli_error(run_cli("publish", pair.ref.path, "org/refs"), "hf:USER/REPO")
    assert_cli_error(run_cli("publish", pair.ref.path, f"hf:{REPO}:OTHER"), "published under its own label")
    assert_cli_error(run_cli("publish", pair.ref.path, f"hf:{REPO}", "--results", tmp_path), "no result")
    partial = write_store(tmp_path / "P.qeval", pair.ref.tokens, pair.ref.logits, 2000, label="P", finish=False)
    assert_cli_error(run_cli("publish", partial.path, f"hf:{REPO}"), "incomplete capture")
    # the store goes up byte for byte: a header naming a local file would make the path public
    local = write_store(tmp_path / "L.qeval", pair.ref.tokens, pair.ref.logits, 2000, label="L",
                        corpus={"name": "wiki", "source": str(Path.home() / "data" / "wiki.txt")})
    assert_cli_error(run_cli("publish", local.path, f"hf:{REPO}"), "header.corpus.source", "would make public",
                     "relative")
    assert hub.calls == []  # refused before any request


# --- pull: score without the original ----------------------------------------------------------------------------
def test_a_published_reference_pulled_into_a_fresh_cache_compares_as_the_local_store(hub, tmp_path, monkeypatch):
    pair = make_pair(tmp_path / "runs")
    publish(pair.ref.path)
    fresh_cache(monkeypatch, tmp_path / "fresh-cache")
    pulled = reference_pack.pull(f"hf:{REPO}:REF")
    assert pulled.read_bytes() == pair.ref.path.read_bytes() and (tmp_path / "fresh-cache") in pulled.parents
    local, remote = (kld_json(ref, pair.cand.path, pair.directory) for ref in (pair.ref.path, f"hf:{REPO}:REF"))
    assert remote["kld"] == local["kld"] and remote["metrics"] == local["metrics"]
    assert set(remote["ran_where"]) == {"reference", "candidate", "floor"} and "ran_where" not in local
    assert reference_pack.pull(f"hf:{REPO}") == pulled  # the repo's only reference
    info = run_cli("info", f"hf:{REPO}:REF")
    assert info.returncode == 0 and "label      : REF" in info.stdout


def test_a_cut_download_of_the_store_resumes(hub, tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE", 256)
    pair = make_pair(tmp_path / "runs")
    publish(pair.ref.path)
    fresh_cache(monkeypatch, tmp_path / "fresh-cache")
    hub.cut.add("REF.qeval")
    assert reference_pack.pull(f"hf:{REPO}:REF").read_bytes() == pair.ref.path.read_bytes()
    assert [g for g in hub.gets if g[0] == "REF.qeval"] == [("REF.qeval", None), ("REF.qeval", "bytes=1024-")]


def test_a_corrupted_store_is_refused(hub, tmp_path, monkeypatch):
    pair = make_pair(tmp_path / "runs")
    publish(pair.ref.path)
    fresh_cache(monkeypatch, tmp_path / "fresh-cache")
    data = bytearray(hub.repos[REPO]["REF.qeval"])
    data[len(data) // 2] ^= 0xFF
    hub.repos[REPO]["REF.qeval"] = bytes(data)
    res = run_cli("kld", "--ref", f"hf:{REPO}:REF", "--cand", pair.cand.path, "--runs-dir", pair.directory)
    assert_cli_error(res, "REF.qeval", "sha256", "damaged or not the file published", "to download it again")


def test_a_wrong_sha256_in_the_manifest_is_refused(hub, tmp_path, monkeypatch):
    pair = make_pair(tmp_path / "runs")
    publish(pair.ref.path)
    fresh_cache(monkeypatch, tmp_path / "fresh-cache")
    manifest = published_manifest(hub)
    manifest["files"][0]["sha256"] = "0" * 64
    republish_manifest(hub, manifest)
    with pytest.raises(QevalError, match=f"its manifest says .* sha256 {'0' * 64}"):
        reference_pack.pull(f"hf:{REPO}:REF")


def test_a_store_whose_own_checksums_fail_is_refused_though_the_manifest_matches_it(hub, tmp_path, monkeypatch):
    pair = make_pair(tmp_path / "runs")
    publish(pair.ref.path)
    fresh_cache(monkeypatch, tmp_path / "fresh-cache")
    data = bytearray(hub.repos[REPO]["REF.qeval"])
    data[len(data) // 2] ^= 0xFF  # inside a chunk record: its XXH3 no longer matches
    hub.repos[REPO]["REF.qeval"] = bytes(data)
    manifest = published_manifest(hub)
    manifest["files"][0]["sha256"] = hashlib.sha256(data).hexdigest()
    republish_manifest(hub, manifest)
    with pytest.raises(QevalError, match="the store does not read back"):
        reference_pack.pull(f"hf:{REPO}:REF")


def test_a_manifest_that_names_another_capture_is_refused(hub, tmp_path, monkeypatch):
    pair = make_pair(tmp_path / "runs")
    publish(pair.ref.path)
    fresh_cache(monkeypatch, tmp_path / "fresh-cache")
    manifest = published_manifest(hub)
    manifest["identity"]["tokens_sha256"] = "1" * 64
    republish_manifest(hub, manifest)
    with pytest.raises(QevalError, match="not the capture its manifest names"):
        reference_pack.pull(f"hf:{REPO}:REF")


def test_a_reference_of_another_tokenizer_is_refused(hub, tmp_path):
    pair = make_pair(tmp_path / "runs")
    other = write_store(tmp_path / "runs" / "OTHER.qeval", pair.ref.tokens, pair.ref.logits, 2000, label="OTHER",
                        tokenizer_sha256="ab" * 32)
    publish(other.path)
    cand = write_store(tmp_path / "runs" / "C2.qeval", pair.cand.tokens, pair.cand.logits, 2000, label="C2",
                       tokenizer_sha256="cd" * 32)
    res = run_cli("kld", "--ref", f"hf:{REPO}:OTHER", "--cand", cand.path, "--runs-dir", pair.directory)
    assert_cli_error(res, "tokenizers differ")


def test_which_reference_of_a_repo_and_a_gguf_repo_is_no_reference(hub, tmp_path):
    pair = make_pair(tmp_path / "runs")
    publish(pair.ref.path)
    publish(pair.cand.path)
    runs = pair.directory
    assert_cli_error(run_cli("kld", "--ref", f"hf:{REPO}", "--cand", pair.cand.path, "--runs-dir", runs),
                     "holds 2 references (CAND, REF): name one")
    assert_cli_error(run_cli("info", f"hf:{REPO}:Q8_0"), "holds no reference 'Q8_0'; its references: CAND, REF")
    # a repository of GGUFs is a model to capture, as before
    assert_cli_error(run_cli("kld", "--ref", "hf:org/release:Q8_0", "--cand", pair.cand.path, "--runs-dir", runs),
                     "is a GGUF model, not a store", "`qeval capture hf:org/release:Q8_0 --label Q8_0`")
    assert_cli_error(run_cli("info", "hf:org/release"), "holds no published qeval reference")


@pytest.mark.slow
def test_a_real_reference_published_then_pulled_scores_a_live_quant_as_the_local_store(hub, models, tmp_path,
                                                                                        monkeypatch):
    """Gemma-3-270M's Q8_0 captured here (its pieces lean), published (certified first), then pulled onto a 'machine'
    with an empty cache and no Q8_0 model: the live Q4_K_M's figures against it are the lean local store's to every
    digit."""
    runs = tmp_path / "runs"
    res = run_cli("capture", models["Q8_0"], "--label", "Q8_0", "-c", "128", "--chunks", "3", "--runs-dir", runs)
    assert res.returncode == 0, res.stderr
    with StoreReader(runs / "Q8_0.qeval") as store:
        assert store.lean_pieces() == 3
    kld = ("kld", "--cand", models["Q4_K_M"], "--runs-dir")
    res = run_cli(*kld, runs, "--ref", runs / "Q8_0.qeval")
    assert res.returncode == 0, res.stderr
    local = res.stdout
    published = publish(runs / "Q8_0.qeval")
    assert published["published"]["backend"] == "CPU" and published["certified_lean_pieces"] == 3
    with StoreReader(runs / "Q8_0.qeval") as store:
        assert store.lean_pieces() == 0  # what went up reads on any machine
    fresh_cache(monkeypatch, tmp_path / "fresh-cache")
    res = run_cli(*kld, tmp_path / "elsewhere", "--ref", f"hf:{REPO}:Q8_0")  # a runs directory that holds nothing
    assert res.returncode == 0, res.stderr
    remote = res.stdout
    remote_lines = remote.splitlines()
    where = [i for i, line in enumerate(remote_lines) if line.startswith("ran where")]
    assert len(where) == 1 and "reference CPU" in remote_lines[where[0]] and "the same build" in remote_lines[where[0] + 1]
    # every line but the reference's path (the hub cache's, the runs directory's) the same, to every digit
    assert remote_lines[0].startswith("reference : Q8_0") and "fresh-cache" in remote_lines[0]
    assert remote_lines[1:where[0]] == local.splitlines()[1:] and any("Mean    KLD" in line for line in remote_lines)
    assert not list((tmp_path / "fresh-cache").rglob("*.gguf"))  # the reference model was never fetched


# --- the numerics floor published with the reference --------------------------------------------------------------
def numerics(system_info: str) -> dict:
    """A store's capture block: where its logits were computed."""
    return {"cpu": "Test CPU", "numerics": {"build": {"llama_cpp_python": "0.3.36", "system_info": system_info},
                                            "env": {}, "gpu_layers": 0}}


ON_CPU, ON_CUDA = "CPU : AVX2 = 1 | ", "CPU : AVX2 = 1 | CUDA : ARCHS = 890 | "
REF_KV = {"type_k": "f16", "type_v": "f16", "flash_attn": "auto"}


def runs_with_floor(runs: Path, floor_kv: dict | None) -> Path:
    """REF (Q8_0 weights, f16 KV, on CPU), the floor (REF's model and build, `floor_kv` its kernel path; None: no
    floor) compared with it and saved, and a Q4_K_M candidate store on CPU (CAND) and on CUDA (CAND-GPU)."""
    rng = np.random.default_rng(3)
    tokens = make_tokens(rng, 3, 16, 2000)
    ref = synth_logits(rng, tokens, 2000)
    q8, q4 = _model("m-Q8_0.gguf", "Q8_0", 1.0, 8.5), _model("m-Q4_K_M.gguf", "Q4_K_M", 0.6, 4.9)
    runs.mkdir(parents=True)
    stores = [("REF", q8, REF_KV, ON_CPU, 0), ("CAND", q4, REF_KV, ON_CPU, 0.5), ("CAND-GPU", q4, REF_KV, ON_CUDA, 0.5)]
    stores += [("floor", q8, {**REF_KV, **floor_kv}, ON_CPU, 0.05)] if floor_kv else []
    for label, model, kv, system_info, sigma in stores:
        logits = {c: perturb(rng, x, sigma) for c, x in ref.items()} if sigma else ref
        write_store(runs / f"{label}.qeval", tokens, logits, 2000, label=label, model=model, kv=kv,
                    capture=numerics(system_info))
    if floor_kv:
        assert run_cli("kld", "--ref", "REF", "--cand", "floor", "--runs-dir", runs, "--save-result").returncode == 0
    return runs


@pytest.mark.parametrize("floor_kv, kind", [({"decode": "generate"}, "decode"), ({"flash_attn": "off"}, "flash-attn")])
def test_the_manifest_lists_the_floor_row_with_where_it_ran_and_its_saved_figures(hub, tmp_path, floor_kv, kind):
    runs = runs_with_floor(tmp_path / "runs", floor_kv)
    out = publish(runs / "REF.qeval", "--results", runs)
    text = run_cli("publish", runs / "REF.qeval", f"hf:{REPO}", "--results", runs).stdout  # published again: the same
    assert f"numerics floor listed: {kind} on CPU (results/REF/floor.vs.REF.json)" in text
    saved = json.loads((runs / "results" / "floor.vs.REF.json").read_text())
    manifest = read_manifest(hub.repos[REPO]["REF.reference.json"], "m")
    assert manifest.floors == out["published"]["floors"] == [{
        "kind": kind, "backend": "CPU", "path": "results/REF/floor.vs.REF.json",
        "build": {"llama_cpp_python": "0.3.36", "system_info": ON_CPU, "cpu": None, "gpu_layers": 0, "env": {}},
        "chunks": 3, "scored_tokens": saved["scored_tokens"], "kld_mean": saved["kld"]["mean"],
        "kld_se": saved["kld"]["se"], "same_top1": saved["same_top1"]["fraction"],
        "same_top1_se": saved["same_top1"]["se"]}]
    listed = {f.path: f.sha256 for f in manifest.files}
    assert listed["results/REF/floor.vs.REF.json"] == \
        hashlib.sha256(hub.repos[REPO]["results/REF/floor.vs.REF.json"]).hexdigest()
    assert str(tmp_path) not in hub.repos[REPO]["REF.reference.json"].decode()


def pulled_where(runs: Path, cand: str) -> tuple[dict, str]:
    """kld's `ran_where` and text for the candidate store `cand` against the published REF."""
    res = run_cli("kld", "--ref", f"hf:{REPO}:REF", "--cand", runs / f"{cand}.qeval", "--runs-dir", runs)
    assert res.returncode == 0, res.stderr
    return kld_json(f"hf:{REPO}:REF", runs / f"{cand}.qeval", runs)["ran_where"], res.stdout


def test_a_pull_on_the_floors_backend_shows_it_and_another_backend_is_told_none_applies(hub, tmp_path, monkeypatch):
    runs = runs_with_floor(tmp_path / "runs", {"decode": "generate"})
    publish(runs / "REF.qeval", "--results", runs)
    fresh_cache(monkeypatch, tmp_path / "fresh-cache")
    row = published_manifest(hub)["floors"][0]
    where, text = pulled_where(runs, "CAND")
    assert where["candidate"]["backend"] == "CPU" and where["floor"] == {"backend": "CPU", "rows": [row],
                                                                         "published": ["CPU"]}
    assert f"numerics floor on CPU (decode): KLD {row['kld_mean']:.6f} ± {row['kld_se']:.6f}, same top-1 " \
           f"{100 * row['same_top1']:.2f} ± {100 * row['same_top1_se']:.2f} % (3 chunks; " \
           "results/REF/floor.vs.REF.json)" in text
    where, text = pulled_where(runs, "CAND-GPU")
    assert where["floor"] == {"backend": "CUDA", "rows": [], "published": ["CPU"]}
    assert "no numerics-floor row was published for backend CUDA: the reference publishes one for CPU only" in text
    assert "numerics floor on" not in text


def test_a_reference_published_without_a_floor_says_none_was(hub, tmp_path, monkeypatch):
    runs = runs_with_floor(tmp_path / "runs", None)
    assert run_cli("kld", "--ref", "REF", "--cand", "CAND", "--runs-dir", runs, "--save-result").returncode == 0
    publish(runs / "REF.qeval", "--results", runs)  # a result, but no floor among the results
    assert published_manifest(hub)["floors"] == []
    fresh_cache(monkeypatch, tmp_path / "fresh-cache")
    where, text = pulled_where(runs, "CAND")
    assert where["floor"] == {"backend": "CPU", "rows": [], "published": []}
    assert "no numerics-floor row was published for backend CPU: the reference was published without one" in text


def test_a_manifest_published_before_floors_reads_as_none(tmp_path):
    manifest = good_manifest(tmp_path)
    assert manifest.pop("floors") == []
    assert read_manifest(manifest_bytes(manifest), "m").floors == []
