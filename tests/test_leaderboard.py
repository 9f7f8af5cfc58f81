"""Leaderboards (qeval.present.leaderboard, `qeval leaderboard`, notebooks/leaderboard.ipynb) from real saved results.

The results come from the real pipeline: synthetic stores (conftest.write_store) compared with
api.kld_report(..., save_result=True). Every expected number is read back from those result files, never
recomputed by the code under test. The HTML page is rendered in headless Chromium when one is installed
(CI: `apt-get install -y chromium`).
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, assert_cli_error, make_tokens, perturb, run_cli, synth_logits, write_store

from qeval import api
from qeval.compare import metric_registry
from qeval.compare.metric_registry import MetricValue
from qeval.errors import QevalError
from qeval.present import leaderboard, plots
from qeval.present.board import BoardRow
from qeval.storage.scoring import half_span

N_CHUNKS, N_CTX, N_VOCAB = 6, 64, 512
CORPUS = {"name": "synthetic-corpus", "source": "tests", "sha256": "ab" * 32}
# label, model file, quant, size GiB, bpw, KV type, noise sigma (more noise -> higher KLD)
CANDIDATES = (("Q8_0", "m-Q8_0.gguf", "Q8_0", 1.06, 8.5, "f16", 0.15),
              ("Q4_0", "m-Q4_0.gguf", "Q4_0", 0.60, 4.5, "f16", 0.6),
              ("Q4_0+kv-q8_0", "m-Q4_0.gguf", "Q4_0", 0.60, 4.5, "q8_0", 0.9),
              ("Q2_K", "m-Q2_K.gguf", "Q2_K", 0.45, 2.9, "f16", 1.6))
FILES = ("leaderboard.md", "leaderboard.csv", "leaderboard.json", "leaderboard.html",
         *(f"{name}.{ext}" for name in plots.PLOTS for ext in ("png", "svg")))


KV_GEOMETRY = {"attention_layers": 2, "k_values_per_token": 1024, "v_values_per_token": 512}


def _model(file_name: str, quant: str, size: float, bpw: float) -> dict:
    return {"file_name": file_name, "quant": quant, "size_gib": size, "bits_per_weight": bpw,
            "fingerprint": (quant.lower().encode().hex() * 64)[:64], "kv_cache": KV_GEOMETRY}


def kv_block(kv: str | dict) -> dict:
    """A store's KV block from a candidate's KV: one type for K and V ("q8_0"), K/V apart ("q8_0/q4_0"), or the
    block itself (a dict: e.g. the floor's, the reference's types with flash attention flipped)."""
    if isinstance(kv, dict):
        return kv
    type_k, _, type_v = kv.partition("/")
    return {"type_k": type_k, "type_v": type_v or type_k}


def build_results(runs: Path, candidates=CANDIDATES, seed: int = 0, ref_label: str = "REF",
                  ref_quant: str = "BF16", n_ctx: int = N_CTX) -> Path:
    """A reference store and one store per candidate over windows of n_ctx tokens, compared and saved into
    runs/results."""
    rng = np.random.default_rng(seed)
    tokens = make_tokens(rng, N_CHUNKS, n_ctx, N_VOCAB)
    ref = synth_logits(rng, tokens, N_VOCAB)
    first, n = half_span(n_ctx)
    for c, x in ref.items():  # make the right next token likely, so PPL looks like a language model's
        x[np.arange(n), tokens[c, first + 1:first + 1 + n]] += rng.uniform(12.0, 24.0, size=n).astype(np.float32)
    runs.mkdir(parents=True, exist_ok=True)
    write_store(runs / f"{ref_label}.qeval", tokens, ref, N_VOCAB, label=ref_label,
                model=_model(f"m-{ref_quant}.gguf", ref_quant, 2.0, 16.0), kv={"type_k": "f16", "type_v": "f16"},
                corpus=CORPUS)
    for label, file_name, quant, size, bpw, kv, sigma in candidates:
        logits = {c: perturb(rng, x, sigma) for c, x in ref.items()}
        write_store(runs / f"{label}.qeval", tokens, logits, N_VOCAB, label=label,
                    model=_model(file_name, quant, size, bpw), kv=kv_block(kv), corpus=CORPUS)
        api.kld_report(ref_label, label, runs_dir=runs, threads=1, save_result=True)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return build_results(tmp_path_factory.mktemp("leaderboard") / "runs")


@pytest.fixture(scope="module")
def board(runs, tmp_path_factory) -> leaderboard.Leaderboard:
    return leaderboard.leaderboard([runs], out=tmp_path_factory.mktemp("board") / "out")


@pytest.fixture(scope="module")
def summaries(runs) -> dict[str, dict]:
    """label -> the saved comparison JSON, read independently of qeval.present.leaderboard."""
    out = {}
    for path in sorted((runs / "results").glob("*.vs.*.json")):
        s = json.loads(path.read_text())
        out[s["candidate"]["label"]] = s
    assert len(out) == len(CANDIDATES)
    return out


def _by_kld(summaries: dict[str, dict]) -> list[str]:
    return sorted(summaries, key=lambda label: summaries[label]["kld"]["mean"])


# --------------------------------------------------------------------------------------------------
# API, CSV, JSON, markdown
# --------------------------------------------------------------------------------------------------
def test_api_returns_rows_and_paths(board, summaries):
    assert [r.label for r in board.rows] == _by_kld(summaries)
    assert [r.rank for r in board.rows] == [1, 2, 3, 4]
    assert set(board.paths) == set(FILES)
    for name, path in board.paths.items():
        assert path.is_file() and path.stat().st_size > 200, name
        assert path.name == name
    for name in plots.PLOTS:
        assert board.paths[f"{name}.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "<svg" in board.paths[f"{name}.svg"].read_text()
    s = board.settings
    assert (s["n_ctx"], s["chunks"], s["scored_tokens"]) == (N_CTX, N_CHUNKS, N_CHUNKS * half_span(N_CTX)[1])
    assert s["corpus"]["name"] == CORPUS["name"] and s["reference"]["label"] == "REF"
    assert s["reference"]["model_file"] == "m-BF16.gguf"


def test_csv_matches_results(board, summaries):
    with open(board.paths["leaderboard.csv"], newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["label"] for r in rows] == _by_kld(summaries)
    for r in rows:
        s = summaries[r["label"]]
        assert float(r["kld_mean"]) == s["kld"]["mean"]
        assert float(r["kld_mean_se"]) == s["kld"]["se"]
        assert float(r["kld_999"]) == s["kld"]["ladder"]["99.9%"]
        assert float(r["kld_max"]) == s["kld"]["ladder"]["Maximum"]
        assert float(r["ppl"]) == s["perplexity"]["ppl_cand"]
        assert float(r["same_top1_pct"]) == pytest.approx(100 * s["same_top1"]["fraction"], rel=1e-15)
        assert float(r["delta_ppl_pct"]) == pytest.approx(100 * (s["perplexity"]["ratio"] - 1), rel=1e-12)
        assert float(r["size_gib"]) == s["candidate"]["model"]["size_gib"]
        assert r["type_k"] == s["candidate"]["kv"]["type_k"]
        assert Path(r["result"]).name == f"{r['label']}.vs.REF.json"


def test_json_matches_results(board, summaries):
    doc = json.loads(board.paths["leaderboard.json"].read_text())
    assert [r["label"] for r in doc["rows"]] == _by_kld(summaries)
    for r in doc["rows"]:
        s = summaries[r["label"]]
        assert r["kld_mean"] == s["kld"]["mean"]
        assert r["ppl"] == s["perplexity"]["ppl_cand"]
        assert r["same_top1_pct"] == pytest.approx(100 * s["same_top1"]["fraction"], rel=1e-15)
    assert doc["settings"]["n_ctx"] == N_CTX and doc["settings"]["chunks"] == N_CHUNKS
    assert doc["settings"]["tokens_sha256"] == next(iter(summaries.values()))["reference"]["tokens_sha256"]
    assert doc["pareto_front"] == board.pareto


def test_every_board_metric_is_a_csv_and_json_column(board, summaries):
    with open(board.paths["leaderboard.csv"], newline="") as fh:
        csv_rows = {r["label"]: r for r in csv.DictReader(fh)}
    json_rows = {r["label"]: r for r in json.loads(board.paths["leaderboard.json"].read_text())["rows"]}
    for m in metric_registry.METRICS.values():
        if not m.board:
            continue
        for label, s in summaries.items():
            held = s["metrics"][m.key]
            assert float(csv_rows[label][m.key]) == json_rows[label][m.key] == held["value"], m.key
            if m.has_se:
                assert float(csv_rows[label][m.se_key]) == json_rows[label][m.se_key] == held["se"], m.key


def test_markdown_has_one_row_per_result_sorted_by_kld(board, summaries):
    md = board.paths["leaderboard.md"].read_text()
    table = [line for line in md.splitlines() if line.startswith("| ")]
    header, body = table[0], table[1:]
    assert "mean KLD ± SE" in header and "PPL ± SE" in header and "same top-1 % ± SE" in header
    labels = [line.split("|")[1].strip() for line in body]
    assert labels == _by_kld(summaries)
    for line in body:
        s = summaries[line.split("|")[1].strip()]
        assert f"{s['kld']['mean']:.6f} ± {s['kld']['se']:.6f}" in line
        assert f"{s['perplexity']['ppl_cand']:.4f}" in line
    # the settings a reader needs, stated above the table
    scored = N_CHUNKS * half_span(N_CTX)[1]
    for fact in (CORPUS["name"], f"n_ctx {N_CTX}", f"{N_CHUNKS} chunks", f"{scored:,} scored tokens", "REF",
                 "m-BF16.gguf"):
        assert fact in md, fact


def test_a_tvd_column_per_sampler_every_result_holds(tmp_path):
    from synth_runs import make_runs  # noqa: PLC0415

    runs = make_runs(tmp_path / "runs")
    # A and B hold qwen3.5-thinking (B by its settings string); greedy and qwen3.5-instruct only one of them
    api.kld_report("REF", "A", runs_dir=runs, threads=1, save_result=True, samplers=["greedy", "qwen3.5-thinking"])
    api.kld_report("REF", "B", runs_dir=runs, threads=1, save_result=True,
                   samplers=["temp=0.6,top_k=20,top_p=0.95", "qwen3.5-instruct"])
    saved = {label: json.loads((runs / "results" / f"{label}.vs.REF.json").read_text()) for label in ("A", "B")}
    board = leaderboard.leaderboard([runs / "results"], out=tmp_path / "board")
    key, held = "tvd_pct@qwen3.5-thinking", {"A": "tvd_pct@qwen3.5-thinking",
                                              "B": "tvd_pct@temp=0.6,top_k=20,top_p=0.95,min_p=0"}
    assert board.samplers == ("qwen3.5-thinking",)
    assert board.settings["samplers"] == {"qwen3.5-thinking": {"temp": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0}}
    with open(board.paths["leaderboard.csv"], newline="") as fh:
        csv_rows = {r["label"]: r for r in csv.DictReader(fh)}
    doc = json.loads(board.paths["leaderboard.json"].read_text())
    i = doc["columns"].index(key)
    assert doc["columns"][i:i + 3] == [key, f"{key}_se", "kld_mean_bound"]
    json_rows = {r["label"]: r for r in doc["rows"]}
    md = board.paths["leaderboard.md"].read_text()
    table = [line for line in md.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert "mean TVD % @qwen3.5-thinking ± SE" in header and sum("TVD" in c for c in header) == 1
    page = board.paths["leaderboard.html"].read_text()
    assert "<th>mean TVD % @qwen3.5-thinking ± SE</th>" in page
    for label in ("A", "B"):
        m = saved[label]["metrics"][held[label]]
        assert float(csv_rows[label][key]) == json_rows[label][key] == m["value"]
        assert float(csv_rows[label][f"{key}_se"]) == json_rows[label][f"{key}_se"] == m["se"]
        line = next(line for line in table if line.startswith(f"| {label} |"))
        assert f"{m['value']:.3f} ± {m['se']:.3f}" in line
    for fact in ("Sampler qwen3.5-thinking:** temp 0.6, top_k 20, top_p 0.95", "mean TVD % @qwen3.5-thinking: mean "
                 "total variation distance"):
        assert fact in md, fact
    # a result without samplers: no sampler is held by all, so the table is the plain one
    api.kld_report("REF", "A_COPY", runs_dir=runs, threads=1, save_result=True)
    plain = leaderboard.build([runs / "results"])
    assert plain.samplers == () and "TVD" not in plain.markdown()
    assert plain.columns == leaderboard.Leaderboard([], [], {}, "").columns


def test_pareto_front_on_hand_made_points():
    sizes = [1.0, 2.0, 2.0, 3.0, 0.5, None, 4.0, 1.0]
    klds = [0.30, 0.10, 0.20, 0.10, 0.90, 0.001, 0.05, 0.30]
    # 0 and 7 are identical (both stay), 2 is beaten by 1 at the same size, 3 by 1 at the same KLD,
    # 5 has no size, 4 is smallest, 6 has the lowest KLD
    assert leaderboard.pareto_front(sizes, klds) == [True, True, False, False, True, False, True, True]
    assert leaderboard.pareto_front([], []) == []
    assert leaderboard.pareto_front([1.0, float("nan")], [0.1, 0.01]) == [True, False]


def test_pareto_fronts_of_the_synthetic_board(board):
    """Weight quants on file size; the KV-cache quant alone on its own front, by memory at the context."""
    assert board.pareto == ["Q2_K", "Q4_0", "Q8_0", "Q4_0+kv-q8_0"]
    rows = {r.label: r for r in board.rows}
    kv_bytes = N_CTX * (1024 + 512) * 34 / 32  # q8_0 keeps 32 values in 34 bytes
    assert rows["Q4_0+kv-q8_0"].memory_estimate_gib == round(0.60 + kv_bytes / 2**30, 4)
    assert rows["Q4_0"].memory_estimate_gib == round(0.60 + N_CTX * (1024 + 512) * 2 / 2**30, 4)
    assert [r.kv_quant for r in board.rows].count(True) == 1
    assert "✓ KV" in board.markdown()


def _row(label: str, size: float, memory: float, kld: float, kv_quant: bool) -> BoardRow:
    return BoardRow(label=label, quant="?", kv="?", size_gib=size, metrics={"kld_mean": MetricValue(kld, 0.0)},
                    kv_quant=kv_quant, memory_estimate_gib=memory)


def test_kv_cache_quants_never_compete_on_file_size():
    """A KV-cache quant of a big file with a low KLD would push the big file's weight quants off a single
    size front (the demo board once marked 'Q8_0 + KV q8_0' Pareto at the Q8_0 file's size)."""
    rows = [_row("Q8_0", 1.0, 1.5, 0.10, False), _row("Q4_0", 0.6, 1.1, 0.30, False),
            _row("Q8_0+kv-q8_0", 1.0, 1.25, 0.09, True), _row("Q8_0+kv-q4_0", 1.0, 1.12, 0.40, True),
            _row("Q4_0+kv-q8_0", 0.6, 0.85, 0.35, True), _row("Q4_0+kv-q4_0", 0.6, 0.9, 0.50, True)]
    leaderboard.mark_pareto_fronts(rows)
    assert {r.label: r.pareto for r in rows} == {"Q8_0": True, "Q4_0": True, "Q8_0+kv-q8_0": True,
                                                  "Q8_0+kv-q4_0": False, "Q4_0+kv-q8_0": True,
                                                  "Q4_0+kv-q4_0": False}


def test_same_file_twice_counts_once_but_a_second_result_for_a_label_is_refused(runs, tmp_path):
    one = runs / "results" / "Q8_0.vs.REF.json"
    assert len(leaderboard.build([runs, one]).rows) == len(CANDIDATES)
    other = tmp_path / "copy"
    other.mkdir()
    for suffix in (".json", ".npz"):
        shutil.copy(one.with_suffix(suffix), other / one.with_suffix(suffix).name)
    with pytest.raises(QevalError, match="two results for candidate 'Q8_0'"):
        leaderboard.build([runs, other])


# --------------------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def other_reference(tmp_path_factory) -> Path:
    """Same tokens (same seed), but a different reference model and label."""
    return build_results(tmp_path_factory.mktemp("other-ref") / "runs", CANDIDATES[:1], ref_label="REF2",
                         ref_quant="F16")


@pytest.fixture(scope="module")
def other_tokens(tmp_path_factory) -> Path:
    """Same reference label and model, but other token ids."""
    return build_results(tmp_path_factory.mktemp("other-tokens") / "runs", CANDIDATES[1:2], seed=1)


def test_results_against_another_reference_are_refused(runs, other_reference):
    with pytest.raises(QevalError) as info:
        leaderboard.build([runs, other_reference])
    msg = str(info.value)
    assert "different references or token sets" in msg
    assert "REF2" in msg and "reference label: REF vs REF2" in msg
    assert str(runs / "results") in msg and str(other_reference / "results") in msg


def test_results_over_other_tokens_are_refused(runs, other_tokens):
    with pytest.raises(QevalError, match="token ids sha256") as info:
        leaderboard.build([runs, other_tokens / "results" / "Q4_0.vs.REF.json"])
    assert str(other_tokens / "results" / "Q4_0.vs.REF.json") in str(info.value)


def test_cli_refuses_mixed_references(runs, other_reference, tmp_path):
    res = run_cli("leaderboard", runs, other_reference, "--out", tmp_path / "lb")
    assert_cli_error(res, "different references or token sets", "REF2")
    assert not (tmp_path / "lb" / "leaderboard.html").exists()


def test_cli_with_nothing_to_read(tmp_path):
    assert_cli_error(run_cli("leaderboard", tmp_path, "--out", tmp_path / "lb"), "no results found")


# --------------------------------------------------------------------------------------------------
# CLI and HTML
# --------------------------------------------------------------------------------------------------
def test_cli_writes_every_file(runs, summaries, tmp_path):
    out = tmp_path / "cli-out"
    res = run_cli("leaderboard", runs / "results", "--out", out, "--title", "Synthetic model card")
    assert res.returncode == 0, res.stderr
    for name in FILES:
        assert (out / name).is_file(), name
    assert (out / "leaderboard.md").read_text().startswith("## Synthetic model card")
    assert "Synthetic model card" in (out / "leaderboard.html").read_text()
    for label in summaries:
        assert label in res.stdout
    assert str(out / "leaderboard.html") in res.stdout


def test_html_is_self_contained(board, summaries):
    page = board.paths["leaderboard.html"].read_text()
    assert page.count("<svg") == len(plots.PLOTS)
    assert "<script" not in page.lower() and "<link" not in page.lower() and "@import" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "external resource"
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", page), "external resource in CSS"
    for label in summaries:
        assert f'data-label="{label}"' in page


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
                None)


def _run_chromium(binary: str, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp / 'chromium-profile'}"]
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=90)


def test_html_renders_in_headless_chromium(board, summaries, tmp_path):
    binary = _chromium()
    if binary is None:
        pytest.skip("no chromium binary on PATH; install it with `apt-get install -y chromium` to render the page")
    url = board.paths["leaderboard.html"].resolve().as_uri()
    dom = _run_chromium(binary, tmp_path, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert 'id="leaderboard"' in html
    rows = re.findall(r'<tr data-label="([^"]+)"', html)
    assert rows == _by_kld(summaries)
    assert html.count("<svg") == len(plots.PLOTS)
    for name in plots.PLOTS:
        assert f'id="plot-{name}"' in html
    shot = tmp_path / "leaderboard.png"
    res = _run_chromium(binary, tmp_path, f"--screenshot={shot}", "--window-size=1400,2000", url)
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    assert _png_size(shot) == (1400, 2000)
    assert shot.stat().st_size > 50_000  # a blank page is a few KB
    from matplotlib.image import imread  # noqa: PLC0415

    pixels = imread(shot)[..., :3]
    assert pixels.std() > 0.05  # table and plots drawn, not one flat colour
    assert (pixels.reshape(-1, 3).min(axis=1) < 0.5).mean() > 0.005  # plenty of dark ink


# --------------------------------------------------------------------------------------------------
# task flips beside the results (qeval.present.task_flips)
# --------------------------------------------------------------------------------------------------
N_TASKS = 80


def _answers(seed: int, flip_share: float, base: np.ndarray) -> np.ndarray:
    """Per-task choice scores: `base` with the answer of about `flip_share` of the tasks moved to another choice."""
    rng = np.random.default_rng(seed)
    scores = base.copy()
    for i in np.flatnonzero(rng.random(len(base)) < flip_share):
        scores[i, (int(np.argmax(base[i])) + 1) % 4] = 0.0  # the highest score now: the next choice wins
    return scores


def _write_task_store(runs: Path, label: str, measured: dict, scores: np.ndarray, golds: list[int]) -> Path:
    """A complete task store of `label` scored with the model and KV settings of one side of a comparison."""
    from qeval.storage.taskstore import TaskStoreWriter, make_record  # noqa: PLC0415

    header = {"identity": {"task": {"format": "hellaswag", "sha256": "cd" * 32, "n_items": N_TASKS},
                           "selection": {"limit": None}, "model": measured["model"], "tokenizer_sha256": "t",
                           "n_vocab": N_VOCAB, "settings": {"kv": measured["kv"], "layout": "llama"},
                           "scoring_version": 1},
              "n_selected": N_TASKS, "label": label, "task": {"name": "toy-hs", "format": "hellaswag"}}
    path = runs / "tasks" / "toy-hs" / f"{label}.tasks.jsonl"
    records = [make_record("hellaswag", i, scores[i] * 3 - 1, [3] * 4, scores[i] - 1 / 3,
                           [int(j == golds[i]) for j in range(4)]) for i in range(N_TASKS)]
    with TaskStoreWriter.open(path, header) as w:
        w.write(records)
        w.finish()
    return path


@pytest.fixture(scope="module")
def task_runs(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray], list[int]]:
    """Results for three candidates; task stores for the reference and two of them (Q4_0+kv-q8_0 has none)."""
    runs = build_results(tmp_path_factory.mktemp("tasks") / "runs", candidates=CANDIDATES[:3], seed=5)
    base = -np.random.default_rng(1).uniform(0.5, 3.0, (N_TASKS, 4))
    golds = [int(np.argmax(b)) if i % 4 else (int(np.argmax(b)) + 2) % 4 for i, b in enumerate(base)]
    scores = {"REF": base, "Q8_0": _answers(2, 0.05, base), "Q4_0": _answers(3, 0.3, base)}
    for label, s in scores.items():
        cand = "Q8_0" if label == "REF" else label
        request = json.loads((runs / "results" / f"{cand}.vs.REF.json").read_text())["request"]
        _write_task_store(runs, label, request["reference" if label == "REF" else "candidate"], s, golds)
    return runs, scores, golds


def test_leaderboard_shows_task_flips(task_runs, tmp_path):
    from qeval.compare.flips import mcnemar_exact  # noqa: PLC0415

    runs, scores, golds = task_runs
    board = leaderboard.leaderboard([runs], out=tmp_path / "lb")
    assert board.tasks == ("toy-hs",)
    rows = {r["label"]: r for r in board.records()}
    ref_correct = [int(np.argmax(scores["REF"][i])) == golds[i] for i in range(N_TASKS)]
    for label in ("Q8_0", "Q4_0"):  # expected from the scores, in plain Python
        cand_correct = [int(np.argmax(scores[label][i])) == golds[i] for i in range(N_TASKS)]
        c2w = sum(r and not c for r, c in zip(ref_correct, cand_correct))
        w2c = sum(c and not r for r, c in zip(ref_correct, cand_correct))
        row = rows[label]
        assert (row["correct_to_wrong@toy-hs"], row["wrong_to_correct@toy-hs"]) == (c2w, w2c)
        assert row["flips_pct@toy-hs"] == pytest.approx(100 * (c2w + w2c) / N_TASKS)
        assert row["mcnemar_p@toy-hs"] == mcnemar_exact(c2w, w2c)
        assert row["accuracy_pct@toy-hs"] == pytest.approx(100 * sum(cand_correct) / N_TASKS)
        assert row["ref_accuracy_pct@toy-hs"] == pytest.approx(100 * sum(ref_correct) / N_TASKS)
    assert rows["Q4_0"]["flips_pct@toy-hs"] > rows["Q8_0"]["flips_pct@toy-hs"] > 0
    assert rows["Q4_0+kv-q8_0"]["flips_pct@toy-hs"] is None  # no task store: an empty cell
    assert "toy-hs" not in {r.label: r for r in board.rows}["Q4_0+kv-q8_0"].task_flips
    md = (tmp_path / "lb" / "leaderboard.md").read_text()
    assert "flips % (toy-hs), McNemar p" in md and "McNemar test" in md
    q4 = next(line for line in md.splitlines() if line.startswith("| Q4_0 |"))
    assert f"{rows['Q4_0']['flips_pct@toy-hs']:.2f} ({rows['Q4_0']['correct_to_wrong@toy-hs']}↓" in q4
    with open(tmp_path / "lb" / "leaderboard.csv") as fh:
        table = {r["label"]: r for r in csv.DictReader(fh)}
    assert float(table["Q8_0"]["flips_pct@toy-hs"]) == rows["Q8_0"]["flips_pct@toy-hs"]
    assert table["Q4_0+kv-q8_0"]["flips_pct@toy-hs"] == ""
    assert 'id="plot-flips_vs_kld"' in (tmp_path / "lb" / "leaderboard.html").read_text()


def test_leaderboard_refuses_a_task_store_of_another_model(task_runs, tmp_path):
    runs, scores, golds = task_runs
    other = tmp_path / "runs"
    shutil.copytree(runs, other)
    request = json.loads((other / "results" / "Q4_0+kv-q8_0.vs.REF.json").read_text())["request"]
    wrong_kv = {"model": request["candidate"]["model"], "kv": {**request["candidate"]["kv"], "type_k": "q4_0"}}
    path = _write_task_store(other, "Q4_0+kv-q8_0", wrong_kv, scores["Q4_0"], golds)
    with pytest.raises(QevalError, match="KV type_k: q4_0 vs q8_0") as info:
        leaderboard.build([other])
    assert str(path) in str(info.value) and "recapture it" in str(info.value)
    assert_cli_error(run_cli("leaderboard", other, "--out", tmp_path / "lb"), str(path), "KV type_k")


# --------------------------------------------------------------------------------------------------
# notebook
# --------------------------------------------------------------------------------------------------
def test_notebook_executes_headless(runs, summaries, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(REPO / "notebooks" / "leaderboard.ipynb", as_version=4)
    monkeypatch.setenv("QEVAL_RESULTS_DIR", str(runs / "results"))
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(str(o.get("text", "")) + str(o.get("data", {})) for o in outputs)
    for label in summaries:
        assert label in text
    images = [o for o in outputs if "image/png" in o.get("data", {}) or "image/svg+xml" in o.get("data", {})]
    assert len(images) >= len(plots.PLOTS)
