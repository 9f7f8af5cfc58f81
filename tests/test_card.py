"""`qeval card` (qeval.present.card, card_provenance, card_merge): a model-card block from real saved results.

The results come from the real pipeline: synthetic stores (conftest.write_store) compared with
api.kld_report(..., save_result=True). Every expected number is read back from the saved result files, and the
table's cells are parsed back into numbers; merges are checked byte for byte.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import test_leaderboard
from conftest import assert_cli_error, make_tokens, perturb, run_cli, synth_logits, write_store
from synth_runs import make_runs

from qeval import api
from qeval.errors import QevalError
from qeval.present import card, card_merge, card_provenance, leaderboard

N_CHUNKS, N_CTX, N_VOCAB = 2, 1024, 64  # every position scored: two depth bands (0-512, 512-1024)
CORPUS = {"name": "card-corpus", "source": "tests", "sha256": "cd" * 32}
CAPTURE = {"n_batch": 128, "n_ubatch": 128, "bos_substituted": False, "n_gpu_layers": 0,
           "llama_cpp_python": "0.3.99", "qeval": "0.1.0", "created": "2025-01-02T03:04:05Z",
           "cpu": "Test CPU @ 1.00GHz", "llama_cpp_system_info": "CPU : SSE3 = 1 | AVX2 = 1",
           "numerics": {"build": {}, "env": {"GGML_CPU_DISABLE_FUSION": "1"}, "gpu_layers": 0}}
KV = {"type_k": "f16", "type_v": "f16", "flash_attn": "auto"}
# label, quant, size GiB, bpw, noise sigma (more noise -> higher KLD)
CANDIDATES = (("Q8_0", "Q8_0", 1.06, 8.5, 0.15), ("Q4_K_M", "Q4_K_M", 0.62, 4.9, 0.6), ("Q2_K", "Q2_K", 0.45, 2.9, 1.4))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _model(quant: str, size: float, bpw: float) -> dict:
    return {"file_name": f"m-{quant}.gguf", "quant": quant, "size_gib": size, "bits_per_weight": bpw,
            "fingerprint": (quant.lower().encode().hex() * 64)[:64]}


def build_results(runs: Path, candidates=CANDIDATES, seed: int = 0, ref_label: str = "REF",
                  corpus: dict = CORPUS) -> Path:
    """A BF16 reference store (with a capture block) and one store per candidate, compared and saved."""
    rng = np.random.default_rng(seed)
    tokens = make_tokens(rng, N_CHUNKS, N_CTX, N_VOCAB)
    ref = synth_logits(rng, tokens, N_VOCAB, scoring="all")
    runs.mkdir(parents=True, exist_ok=True)
    write_store(runs / f"{ref_label}.qeval", tokens, ref, N_VOCAB, label=ref_label, model=_model("BF16", 2.0, 16.0),
                kv=KV, corpus=corpus, capture=CAPTURE, scoring="all")
    for label, quant, size, bpw, sigma in candidates:
        logits = {c: perturb(rng, x, sigma) for c, x in ref.items()}
        write_store(runs / f"{label}.qeval", tokens, logits, N_VOCAB, label=label, model=_model(quant, size, bpw),
                    kv=KV, corpus=corpus, capture={"n_batch": 128, "n_ubatch": 128}, scoring="all")
        api.kld_report(ref_label, label, runs_dir=runs, threads=1, save_result=True)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return build_results(tmp_path_factory.mktemp("card") / "runs")


@pytest.fixture(scope="module")
def summaries(runs) -> dict[str, dict]:
    """label -> the saved comparison JSON, read without qeval."""
    out = {}
    for path in sorted((runs / "results").glob("*.vs.*.json")):
        s = json.loads(path.read_text())
        out[s["candidate"]["label"]] = s
    return out


@pytest.fixture(scope="module")
def written(runs, tmp_path_factory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("card-out") / "card"
    result, text = api.card_report([runs], out=out)
    return result, text, out


def _table(markdown: str) -> list[dict[str, str]]:
    """The markdown table's rows as heading -> cell."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    split = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines]
    head, _, *rows = split
    return [dict(zip(head, row)) for row in rows]


def _value_se(cell: str) -> tuple[float, float]:
    value, se = cell.split(" ± ")
    return float(value), float(se)


# --------------------------------------------------------------------------------------------------
# the table, the sidecar, the plot
# --------------------------------------------------------------------------------------------------
def test_table_numbers_are_the_results(written, summaries):
    _, text, out = written
    rows = _table((out / card.MARKDOWN).read_text())
    assert [r["label"] for r in rows] == sorted(summaries, key=lambda k: summaries[k]["metrics"]["kld_mean"]["value"])
    for r in rows:
        s = summaries[r["label"]]
        m, cand = s["metrics"], s["candidate"]["model"]
        assert r["file"] == cand["file_name"] and r["KV"] == "f16/f16"
        assert float(r["size GiB"]) == pytest.approx(cand["size_gib"], abs=5e-4)
        assert float(r["BPW"]) == pytest.approx(cand["bits_per_weight"], abs=5e-3)
        for heading, key, half_unit in (("mean KLD ± SE", "kld_mean", 5e-7), ("same top-1 % ± SE", "same_top1_pct", 5e-3),
                                        ("PPL ± SE", "ppl", 5e-5)):
            value, se = _value_se(r[heading])
            assert value == pytest.approx(m[key]["value"], abs=half_unit), heading
            assert se == pytest.approx(m[key]["se"], abs=half_unit), heading
        assert float(r["99.9% KLD"]) == pytest.approx(m["kld_999"]["value"], abs=5e-5)
        for band in s["by_depth"]:
            value, se = _value_se(r[f"mean KLD, positions {band['lo']}-{band['hi']} ± SE"])
            assert value == pytest.approx(band["kld"]["mean"], abs=5e-7)
            assert se == pytest.approx(band["kld"]["se"], abs=5e-7)
    assert [r["Pareto"] for r in rows] == ["✓"] * len(rows)  # smaller is always worse here
    assert text.startswith(card_merge.BEGIN) and str(out / card.MARKDOWN) in text


def test_two_depth_bands_are_columns(written, summaries):
    _, _, out = written
    assert all(len(s["by_depth"]) == 2 for s in summaries.values())
    head = (out / card.MARKDOWN).read_text().split("\n| label ")[1].split("\n")[0]
    assert "mean KLD, positions 0-512 ± SE" in head and "mean KLD, positions 512-1024 ± SE" in head


def test_sidecar_holds_the_rows_and_provenance(written, summaries, runs):
    result, _, out = written
    sidecar = json.loads((out / card.SIDECAR).read_text())
    assert {k: v for k, v in result.items() if k not in ("paths", "merge")} == sidecar
    for row in sidecar["rows"]:
        s = summaries[row["label"]]
        for key in card.CARD_METRICS:
            assert row[key] == s["metrics"][key]["value"]
        assert row["kld_mean_se"] == s["metrics"]["kld_mean"]["se"]
        assert row["by_depth"] == {f"{b['lo']}-{b['hi']}": {"kld_mean": b["kld"]["mean"], "kld_mean_se": b["kld"]["se"]}
                                   for b in s["by_depth"]}
        assert Path(row["result"]).parent == runs / "results"
    p = sidecar["provenance"]
    assert p["corpus"] == CORPUS and p["reference"]["fingerprint"] == _model("BF16", 2, 16)["fingerprint"]
    assert p["reference"]["model_file"] == "m-BF16.gguf" and p["reference"]["kv"] == KV
    assert (p["n_ctx"], p["chunks"], p["scoring"]) == (N_CTX, N_CHUNKS, "all")
    assert p["scored_tokens"] == N_CHUNKS * (N_CTX - 1)
    assert p["batch"] == {"n_batch": 128, "n_ubatch": 128} and p["reference_capture"] == CAPTURE
    assert p["candidate_settings"] == {label: {"flash_attn": "auto", "n_batch": 128, "n_ubatch": 128}
                                       for label in summaries}
    assert (p["cpu"], p["gpu"], p["llama_cpp_build"]) == (CAPTURE["cpu"], None, CAPTURE["llama_cpp_system_info"])


def test_provenance_list_says_what_is_recorded_and_what_is_not(written, summaries):
    _, _, out = written
    block = (out / card.MARKDOWN).read_text()
    ref_ppl = next(iter(summaries.values()))["metrics"]["ppl_ref"]
    value, se = _value_se(re.search(r"\*\*Reference PPL:\*\* (.*)", block).group(1))
    assert value == pytest.approx(ref_ppl["value"], abs=5e-5) and se == pytest.approx(ref_ppl["se"], abs=5e-5)
    assert "**Quant settings:** flash_attn auto, n_batch 128, n_ubatch 128 (every quant;" in block
    assert "`" + CORPUS["sha256"] + "`" in block and "`" + _model("BF16", 2, 16)["fingerprint"] + "`" in block
    assert "n_ctx 1024, 2 chunks, 2,046 scored tokens (scoring `all`" in block
    assert "KV f16/f16, flash_attn auto, n_batch 128, n_ubatch 128, BOS substituted no" in block
    assert ("CPU only (n_gpu_layers 0), llama-cpp-python 0.3.99, CPU Test CPU @ 1.00GHz, llama.cpp build: CPU : "
            "SSE3 = 1 | AVX2 = 1, llama.cpp environment: GGML_CPU_DISABLE_FUSION=1, reference captured "
            "2025-01-02T03:04:05Z") in block
    assert "GPU model and llama.cpp commit not recorded" in block
    older = card_provenance._hardware_text({"n_gpu_layers": 0, "llama_cpp_python": "0.3.16"})  # captured before
    assert "CPU not recorded, llama.cpp build: not recorded, llama.cpp environment: not recorded" in older
    assert "![Mean KLD against model size, Pareto front marked](kld_vs_size.png)" in block


def test_the_plot_is_a_png_beside_the_block(written):
    result, _, out = written
    png = out / card.PLOT_FILE
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000
    assert result["paths"][card.PLOT_FILE] == str(png)


def test_a_moved_runs_directory_still_finds_the_reference_store(runs, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(runs, moved)
    (tmp_path / "gone").mkdir()
    shutil.copytree(runs / "results", tmp_path / "gone" / "results")  # results whose stores are nowhere
    assert card.build([moved]).provenance["reference_capture"] == CAPTURE  # the recorded path still exists
    (runs / "REF.qeval").rename(runs / "REF.hidden")
    try:
        assert card.build([moved]).provenance["reference_capture"] == CAPTURE  # found beside moved/results
        lone = card.build([tmp_path / "gone"])
        assert lone.provenance["reference_capture"] is None
        assert "the reference store is not readable here" in lone.markdown()
    finally:
        (runs / "REF.hidden").rename(runs / "REF.qeval")


# --------------------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------------------
def test_results_over_another_corpus_are_refused(runs, tmp_path):
    """Same tokens and reference, another corpus name and hash: leaderboard.build takes them, a card does not."""
    other = build_results(tmp_path / "other-corpus", CANDIDATES[:1], corpus={**CORPUS, "name": "elsewhere"})
    mixed = [runs / "results" / "Q2_K.vs.REF.json", other / "results" / "Q8_0.vs.REF.json"]
    assert len(leaderboard.build(mixed).rows) == 2
    with pytest.raises(QevalError, match="different corpora .*corpus name: elsewhere vs card-corpus") as info:
        card.build(mixed)
    assert all(str(path) in str(info.value) for path in mixed)


def test_cli_refuses_another_reference(runs, tmp_path):
    other = build_results(tmp_path / "other-ref", CANDIDATES[:1], ref_label="REF2")
    res = run_cli("card", runs, other, "--out", tmp_path / "c")
    assert res.returncode == 2
    assert_cli_error(res, "different references or token sets", "REF2")
    assert not (tmp_path / "c").exists()


def test_cli_refuses_other_tokens(runs, tmp_path):
    other = build_results(tmp_path / "other-tokens", CANDIDATES[:1], seed=1)
    res = run_cli("card", runs, other / "results" / "Q8_0.vs.REF.json", "--out", tmp_path / "c")
    assert_cli_error(res, "different references or token sets", "token ids sha256")


def test_cli_refuses_other_chunk_counts(tmp_path):
    mk = make_runs(tmp_path / "runs")
    for cand in ("A", "SHORT"):  # SHORT holds fewer chunks: its comparison covers only those
        api.kld_report("REF", cand, runs_dir=mk, threads=1, save_result=True)
    assert_cli_error(run_cli("card", mk, "--out", tmp_path / "c"), "chunks: 12 vs 8")


def test_cli_refuses_a_missing_run(tmp_path):
    res = run_cli("card", tmp_path / "nowhere.json", "--out", tmp_path / "c")
    assert res.returncode == 2
    assert_cli_error(res, "neither a result file nor a directory")


# --------------------------------------------------------------------------------------------------
# --merge
# --------------------------------------------------------------------------------------------------
FRONT = b"---\r\nlicense: apache-2.0\r\ntags: [gguf]\r\n---\r\n"
BODY = "## Card\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"


def _merge(path: Path, body: str = BODY) -> str:
    return card_merge.prepare(path, body).apply()


def test_merge_replaces_only_between_the_markers(tmp_path):
    before = FRONT + b"# Model\r\n\r\n" + card_merge.BEGIN.encode() + b"\r\nold block\r\n"
    after = card_merge.END.encode() + b"\r\n\r\nLicense text, no newline at the end"
    readme = tmp_path / "README.md"
    readme.write_bytes(before + after)
    assert _merge(readme) == card_merge.REPLACED
    new = readme.read_bytes()
    assert new.startswith(before.replace(b"old block\r\n", b"")) and new.endswith(after)
    inside = new[len(before) - len(b"old block\r\n"):-len(after)]
    assert inside == BODY.replace("\n", "\r\n").encode()  # the block takes the file's CRLF endings
    assert _merge(readme) == card_merge.UNCHANGED and readme.read_bytes() == new


@pytest.mark.parametrize(("original", "gap"), [(b"", b""), (b"# Model\n", b"\n"), (b"# Model", b"\n\n"),
                                             (b"# Model\n\n", b""), (FRONT, b"\r\n"),
                                             (FRONT.rstrip(b"\r\n"), b"\r\n\r\n")],
                         ids=["empty", "newline", "no-newline", "blank-line", "front-matter", "front-no-newline"])
def test_merge_appends_after_every_byte_and_twice_is_once(tmp_path, original, gap):
    readme = tmp_path / "README.md"
    readme.write_bytes(original)
    assert _merge(readme) == card_merge.APPENDED
    once = readme.read_bytes()
    newline = "\r\n" if b"\r\n" in original else "\n"
    block = f"{card_merge.BEGIN}\n{BODY}{card_merge.END}\n".replace("\n", newline).encode()
    assert once == original + gap + block  # after a blank line, every byte of the file before it
    assert _merge(readme) == card_merge.UNCHANGED and readme.read_bytes() == once
    assert _merge(readme, BODY + "more\n") == card_merge.REPLACED
    assert readme.read_bytes().startswith(original + gap + card_merge.BEGIN.encode())


def test_a_quoted_marker_is_not_a_marker(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"Run `qeval card --merge` to fill `{card_merge.BEGIN}` … `{card_merge.END}`.\n")
    assert _merge(readme) == card_merge.APPENDED


@pytest.mark.parametrize("markers", [[card_merge.BEGIN], [card_merge.END], [card_merge.END, card_merge.BEGIN],
                                     [card_merge.BEGIN, card_merge.END] * 2],
                         ids=["begin-only", "end-only", "end-first", "two-blocks"])
def test_broken_markers_are_refused_and_nothing_is_written(runs, tmp_path, markers):
    readme = tmp_path / "README.md"
    original = ("# Model\n" + "".join(f"{m}\nx\n" for m in markers)).encode()
    readme.write_bytes(original)
    res = run_cli("card", runs, "--out", tmp_path / "c", "--merge", readme)
    assert res.returncode == 2
    assert_cli_error(res, str(readme), "a card block is one begin line, then one end line")
    assert len(res.stderr.strip().splitlines()) == 1
    assert readme.read_bytes() == original and not (tmp_path / "c").exists()


def test_cli_refuses_a_missing_merge_file(runs, tmp_path):
    res = run_cli("card", runs, "--out", tmp_path / "c", "--merge", tmp_path / "README.md")
    assert res.returncode == 2
    assert_cli_error(res, "no such file")
    assert not (tmp_path / "README.md").exists()


def test_cli_merges_into_a_model_card_with_links_relative_to_it(runs, tmp_path):
    readme = tmp_path / "repo" / "README.md"
    readme.parent.mkdir()
    readme.write_bytes(FRONT + b"\r\n# Model\r\n")
    out = tmp_path / "repo" / "eval"
    res = run_cli("card", runs, "--out", out, "--merge", readme, "--title", "Quants of m", "--json")
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    assert result["merge"] == {"file": str(readme), "action": card_merge.APPENDED}
    text = readme.read_bytes().decode()
    assert text.startswith(FRONT.decode()) and "## Quants of m\r\n" in text
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert links == ["eval/kld_vs_size.png", "eval/card.json"]
    assert all((readme.parent / link).is_file() for link in links)
    again = run_cli("card", runs, "--out", out, "--merge", readme, "--title", "Quants of m")
    assert again.returncode == 0 and f"{readme}: card block unchanged" in again.stdout
    assert readme.read_bytes().decode() == text


def test_a_flips_column_per_task_set_beside_the_results(tmp_path):
    """Task stores beside the results (as tests/test_leaderboard.py writes them) give a flips column."""
    runs = test_leaderboard.build_results(tmp_path / "runs", candidates=test_leaderboard.CANDIDATES[:2], seed=5)
    base = -np.random.default_rng(1).uniform(0.5, 3.0, (test_leaderboard.N_TASKS, 4))
    golds = [int(np.argmax(b)) for b in base]
    answers = test_leaderboard._answers
    for label, scores in {"REF": base, "Q8_0": answers(2, 0.05, base), "Q4_0": answers(3, 0.3, base)}.items():
        request = json.loads((runs / "results" / f"{'Q8_0' if label == 'REF' else label}.vs.REF.json").read_text())
        test_leaderboard._write_task_store(runs, label, request["request"]["reference" if label == "REF" else "candidate"], scores,
                          golds)
    c = card.build([runs])
    board_rows = {r["label"]: r for r in leaderboard.build([runs]).records()}
    table = {r["label"]: r for r in _table(c.markdown())}
    for row in c.to_json()["rows"]:
        flips = row["flips"]["toy-hs"]
        assert flips["flips_pct"] == board_rows[row["label"]]["flips_pct@toy-hs"] > 0
        cell = table[row["label"]]["flips % (toy-hs), McNemar p"]
        assert cell.startswith(f"{flips['flips_pct']:.2f} ({flips['correct_to_wrong']}↓ {flips['wrong_to_correct']}↑")


def test_a_card_shows_the_control_and_each_quants_excess_over_it(tmp_path):
    from test_control import CONTROL, TWIN  # noqa: PLC0415

    candidates = (*test_leaderboard.CANDIDATES, CONTROL, TWIN)
    runs = test_leaderboard.build_results(tmp_path / "runs", candidates=candidates)
    api.card_report([runs], out=tmp_path / "card")
    block = (tmp_path / "card" / "card.md").read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in block.splitlines() if line.startswith("| ")}
    assert "KLD over control" in rows["label"] and "| control |" in rows["ctl"]
    assert "(noise)" in rows["Q8_X"] and "(noise)" not in rows["Q2_K"]
    sidecar = {r["label"]: r for r in json.loads((tmp_path / "card" / "card.json").read_text())["rows"]}
    saved = {s["candidate"]["label"]: s["metrics"]["kld_mean"]["value"]
             for s in map(json.loads, map(Path.read_text, (runs / "results").glob("*.json")))}
    assert sidecar["ctl"]["control"] and sidecar["ctl"]["kld_excess"] is None
    assert sidecar["Q2_K"]["kld_excess"] == pytest.approx(saved["Q2_K"] - saved["ctl"], rel=1e-12)
