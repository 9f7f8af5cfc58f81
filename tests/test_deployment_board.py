"""Speed and memory on the board (qeval.present.deployment_board), the front over quality × memory × speed
(qeval.compare.ranking) and the deployment question (qeval.compare.deployment_choice, `qeval choose`).

The quality side is the real pipeline (synthetic stores compared and saved, as tests/test_leaderboard.py builds
them); speed and memory are hand-written records (tests/deployment_records.py) whose figures every expectation here
is computed from. Until qeval.storage.deployment is merged, its reader is the stand-in of deployment_records.
"""

from __future__ import annotations

import csv
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_cli_error, run_cli
from deployment_records import MIB, machine, memory_entry, record_json, speed_entry, write_record
from test_leaderboard import _model, build_results

from qeval import api
from qeval.compare import deployment_choice, ranking
from qeval.compare.deployment_choice import GIB, Candidate, Question
from qeval.errors import QevalError
from qeval.orchestrate import boards
from qeval.present import leaderboard
from qeval.present.board import BoardRow
from qeval.present.choose_text import reason_text
from qeval.present.deployment_board import CONTROL_WHY, Records
from qeval.present.deployment_page import question_link
from qeval.storage.deployment import load_records

# label, model file, quant, size GiB, bpw, KV type, noise sigma (more noise -> higher KLD)
CANDIDATES = (("Q8_0", "m-Q8_0.gguf", "Q8_0", 1.06, 8.5, "f16", 0.15),
              ("Q6_K", "m-Q6_K.gguf", "Q6_K", 0.82, 6.6, "f16", 0.3),
              ("Q5_K", "m-Q5_K.gguf", "Q5_K", 0.70, 5.5, "f16", 0.45),
              ("Q4_0", "m-Q4_0.gguf", "Q4_0", 0.60, 4.5, "f16", 0.6),
              ("Q4_0+kv-q8_0", "m-Q4_0.gguf", "Q4_0", 0.60, 4.5, "q8_0", 0.9),
              ("Q3_K", "m-Q3_K.gguf", "Q3_K", 0.50, 3.4, "f16", 1.2),
              ("Q2_K", "m-Q2_K.gguf", "Q2_K", 0.45, 2.9, "f16", 1.6),
              ("Q4_0+kv-q4_0", "m-Q4_0.gguf", "Q4_0", 0.60, 4.5, "q4_0", 2.0))
HERE = machine()  # the machine the tests run "on"
GPU = machine("Intel Xeon 8480+", backend="CUDA", cores=16,
              gpus=({"name": "NVIDIA H100 80GB HBM3", "driver": "580.65", "memory_bytes": 85 * GIB},))
CTX, DEPTH = 32768, 4096
OOM = "cannot allocate a context of 32768 tokens: llama.cpp asked for 9.90 GiB"

# label -> ({n_ctx: {part: MiB} or error}, {(test, tokens, depth): tokens/s}) on HERE; Q5_K has no record at all
FIGURES = {
    "REF": ({4096: {"model": 2048, "kv": 64, "compute": 500}, CTX: {"model": 2048, "kv": 512, "compute": 520}},
            {("pp", 512, 0): 100.0, ("tg", 128, 0): 10.0, ("pp", 512, DEPTH): 80.0, ("tg", 128, DEPTH): 8.0}),
    "Q8_0": ({4096: {"model": 1085, "kv": 64, "compute": 500}, CTX: {"model": 1085, "kv": 512, "compute": 520}},
             {("pp", 512, 0): 150.0, ("tg", 128, 0): 18.0, ("pp", 512, DEPTH): 120.0, ("tg", 128, DEPTH): 15.0}),
    "Q6_K": ({4096: {"model": 840, "kv": 64, "compute": 500}, CTX: OOM},
             {("pp", 512, 0): 160.0, ("tg", 128, 0): 22.0, ("pp", 512, DEPTH): 130.0, ("tg", 128, DEPTH): 21.0}),
    "Q4_0": ({4096: {"model": 615, "kv": 64, "compute": 500}, CTX: {"model": 615, "kv": 512, "compute": 520}},
             {("pp", 512, 0): 170.0, ("tg", 128, 0): 30.0, ("pp", 512, DEPTH): 140.0, ("tg", 128, DEPTH): 24.0}),
    # more memory and slower than Q4_0 at CTX and DEPTH, and a worse KLD: off the front, yet it passes
    "Q4_0+kv-q8_0": ({4096: {"model": 615, "kv": 34, "compute": 600}, CTX: {"model": 615, "kv": 272, "compute": 813}},
                     {("pp", 512, 0): 160.0, ("tg", 128, 0): 28.0, ("pp", 512, DEPTH): 90.0,
                      ("tg", 128, DEPTH): 21.0}),
    "Q3_K": ({4096: {"model": 512, "kv": 64, "compute": 500}},
             {("pp", 512, 0): 180.0, ("tg", 128, 0): 33.0, ("pp", 512, DEPTH): 150.0, ("tg", 128, DEPTH): 26.0}),
    "Q4_0+kv-q4_0": ({4096: {"model": 615, "kv": 18, "compute": 500}, CTX: {"model": 615, "kv": 144, "compute": 520}},
                     {("pp", 512, 0): 150.0, ("tg", 128, 0): 25.0}),
}
ON_GPU = {"Q2_K": ({CTX: {"model": 461, "kv": 512, "compute": 300}}, {("tg", 128, DEPTH): 180.0}),
          "Q4_0": ({CTX: {"model": 615, "kv": 512, "compute": 300}}, {("tg", 128, DEPTH): 150.0})}


def fingerprint(quant: str) -> str:
    return _model("x", quant, 0, 0)["fingerprint"]


def quant_of(label: str) -> tuple[str, str]:
    """(quant, KV type) of a row of this board."""
    if label == "REF":
        return "BF16", "f16"
    row = next(c for c in CANDIDATES if c[0] == label)
    return row[2], row[5]


def write_figures(runs: Path, figures: dict, on: dict, spread: float | None = 0.04) -> None:
    for label, (memory, speed) in figures.items():
        quant, kv = quant_of(label)
        write_record(runs, record_json(label, fingerprint(quant), kv, on,
                                       [memory_entry(n, parts) for n, parts in memory.items()],
                                       [speed_entry(*key, tps, spread) for key, tps in speed.items()]))


def split_row(line: str) -> list[str]:
    """The cells of a markdown table row (a \\| inside a cell is not a border)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def total_bytes(parts: dict) -> int:
    return sum(int(v * MIB) for v in parts.values())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    runs = build_results(tmp_path_factory.mktemp("deployment") / "runs", candidates=CANDIDATES, seed=3)
    write_figures(runs, FIGURES, HERE)
    write_figures(runs, ON_GPU, GPU, spread=None)
    return runs


@pytest.fixture(autouse=True)
def here_machine(monkeypatch):
    """This machine, as the records name it: the tests' own HERE, not the machine they run on."""
    monkeypatch.setattr(boards, "this_machine", lambda: HERE["id"])


@pytest.fixture(scope="module")
def klds(runs) -> dict[str, float]:
    """label -> mean KLD, read from the saved results."""
    return {json.loads(p.read_text())["candidate"]["label"]: json.loads(p.read_text())["kld"]["mean"]
            for p in (runs / "results").glob("*.vs.REF.json")}


def board_of(runs: Path, machine_key: str | None = None) -> leaderboard.Leaderboard:
    return leaderboard.build([runs], deployment=Records(tuple(load_records(runs)), HERE["id"], machine_key))


# --------------------------------------------------------------------------------------------------
# the board: CSV, JSON, markdown
# --------------------------------------------------------------------------------------------------
def test_the_reference_gets_a_row_and_every_row_its_figures(runs, klds):
    board = board_of(runs)
    assert [r.label for r in board.table_rows] == ["REF", *sorted(klds, key=klds.get)]
    ref = board.table_rows[0]
    assert ref.reference and ref.rank is None and not ref.pareto
    assert [r.rank for r in board.rows] == list(range(1, len(CANDIDATES) + 1))
    view = board.deployment
    assert view.machine.key == HERE["id"][:12] and view.machine.current
    assert view.contexts() == (4096, CTX)
    assert view.speeds() == (("pp", 512, 0), ("pp", 512, DEPTH), ("tg", 128, 0), ("tg", 128, DEPTH))
    assert set(view.machines) == {HERE["id"][:12], GPU["id"][:12]}


def test_csv_and_json_hold_every_figure_of_this_machine(runs, tmp_path):
    board = leaderboard.write(board_of(runs), tmp_path / "board")
    with open(board.paths["leaderboard.csv"], newline="") as fh:
        rows = {r["label"]: r for r in csv.DictReader(fh)}
    doc = json.loads(board.paths["leaderboard.json"].read_text())
    by_label = {r["label"]: r for r in doc["rows"]}
    assert list(rows) == list(by_label) == [r.label for r in board.table_rows]
    for label, (memory, speed) in FIGURES.items():
        csv_row, json_row = rows[label], by_label[label]
        for n in (4096, CTX):
            figure = memory.get(n)
            if isinstance(figure, dict):
                assert json_row[f"memory_gib@{n}"] == total_bytes(figure) / GIB
                assert float(csv_row[f"memory_gib@{n}"]) == total_bytes(figure) / GIB
                for part, mib in figure.items():
                    assert json_row[f"memory_{part}_gib@{n}"] == int(mib * MIB) / GIB
                assert json_row[f"memory_error@{n}"] is None
            else:  # failed (its sentence kept) or not measured: no number, never a zero
                assert json_row[f"memory_gib@{n}"] is None and csv_row[f"memory_gib@{n}"] == ""
                assert json_row[f"memory_error@{n}"] == figure
        for test, n, depth in ((t, n, d) for t, n in (("pp", 512), ("tg", 128)) for d in (0, DEPTH)):
            column = f"{test}{n}@d{depth}"
            assert json_row[column] == speed.get((test, n, depth))
            assert json_row[f"{column}_spread"] == (0.04 if (test, n, depth) in speed else None)
        assert json_row["measured_on"] == HERE["id"][:12] + (" " + GPU["id"][:12] if label in ON_GPU else "")
        assert json_row["figures_machine"] == csv_row["figures_machine"] == HERE["id"][:12]
    assert rows["REF"]["reference"] == "True" and by_label["Q8_0"]["reference"] is False
    # Q5_K: no record anywhere; Q2_K: only on the other machine, whose figures stay out of these columns
    for label in ("Q5_K", "Q2_K"):
        assert all(by_label[label][k] is None for k in doc["columns"] if "@" in k), label
    assert by_label["Q2_K"]["measured_on"] == GPU["id"][:12] and by_label["Q5_K"]["measured_on"] is None
    assert by_label["Q2_K"]["figures_machine"] is None and rows["Q2_K"]["figures_machine"] == ""
    # the per-device breakdown of every record, both machines
    records = doc["deployment"]["records"]
    assert records["Q2_K"][GPU["id"][:12]]["memory"][0]["devices"] == {"CPU": {"model": 461 * MIB, "kv": 512 * MIB,
                                                                               "compute": 300 * MIB}}
    assert doc["deployment"]["machine"] == HERE["id"][:12]
    assert doc["deployment"]["machines"][GPU["id"][:12]]["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"
    # the estimate keeps its name as one
    assert "memory_estimate_gib" in doc["columns"] and "memory_gib" not in doc["columns"]


def test_markdown_says_not_measured_names_machines_and_keeps_other_machines_apart(runs):
    board = board_of(runs)
    md = board.markdown()
    other = md.index(f"**Measured on another machine, {GPU['id'][:12]}:**")
    table = [line for line in md[:other].splitlines() if line.startswith("| ")]
    header = split_row(table[0])
    for heading in ("memory GiB @ ctx 4096", f"memory GiB @ ctx {CTX}", "pp512 t/s @ d0", f"tg128 t/s @ d{DEPTH}",
                    "deployment front"):
        assert heading in header, heading
    cells = {split_row(line)[0]: split_row(line) for line in table[1:]}
    at = {h: i for i, h in enumerate(header)}
    q5 = cells["Q5_K"]
    assert q5[at[f"memory GiB @ ctx {CTX}"]] == "not measured" and q5[at[f"tg128 t/s @ d{DEPTH}"]] == "not measured"
    assert cells["Q6_K"][at[f"memory GiB @ ctx {CTX}"]] == "failed"
    assert cells["Q3_K"][at[f"memory GiB @ ctx {CTX}"]] == "not measured"
    assert cells["Q4_0"][at[f"memory GiB @ ctx {CTX}"]] == f"{total_bytes(FIGURES['Q4_0'][0][CTX]) / GIB:.3f}"
    assert cells["Q4_0"][at[f"tg128 t/s @ d{DEPTH}"]] == "24.0 (4.0 %)"
    assert cells["REF"][at["mean KLD ± SE"]] == "reference"
    # the other machine's figures: in a table of their own, under its name, never in the columns above
    assert cells["Q2_K"][at[f"tg128 t/s @ d{DEPTH}"]] == "not measured"
    assert "NVIDIA H100 80GB HBM3 (driver 580.65), CUDA backend" in md[other:other + 300]
    gpu_table = [line for line in md[other:].splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in gpu_table[1:]] == ["Q4_0", "Q2_K"]
    assert "| 180.0 |" in gpu_table[2]
    assert "Rows were measured on 2 machines" in md
    assert f"AMD EPYC 9B14 (2 cores), CPU backend, llama-cpp-python 0.3.36 [{HERE['id'][:12]}, this machine]" in md
    assert "threads 2, -ngl 0, -b 2048, -ub 512, flash attention auto" in md


def test_the_deployment_front_is_the_brute_force_front(runs, klds):
    board = board_of(runs)
    assert board.deployment.front_at == (CTX, DEPTH)
    points = {label: (-np.inf if label == "REF" else klds[label], total_bytes(mem[CTX]), speed[("tg", 128, DEPTH)])
              for label, (mem, speed) in FIGURES.items()
              if isinstance(mem.get(CTX), dict) and ("tg", 128, DEPTH) in speed}
    expected = {a for a, p in points.items()
                if not any(q[0] <= p[0] and q[1] <= p[1] and q[2] >= p[2] and q != p for q in points.values())}
    assert expected == {"REF", "Q8_0", "Q4_0"}  # Q4_0+kv-q8_0 is beaten by Q4_0 on all three
    assert board.deployment.front == expected
    assert {r["label"] for r in board.records() if r["deployment_front"]} == expected


def test_a_record_of_another_model_file_is_left_out_and_said(runs, tmp_path):
    stale = tmp_path / "runs"
    build_results(stale, candidates=CANDIDATES[:1], seed=3)
    write_record(stale, record_json("Q8_0", fingerprint("Q6_K"), "f16", HERE, [memory_entry(4096, {"model": 1})], []))
    board = board_of(stale)
    assert board.deployment.on("Q8_0") is None
    assert "Left out: the record of Q8_0" in board.markdown() and "measure Q8_0 again" in board.markdown()


def test_a_board_without_records_is_the_board_it_was(runs, tmp_path):
    plain = tmp_path / "runs"
    build_results(plain, candidates=CANDIDATES[:2], seed=3)
    board = leaderboard.build([plain], deployment=boards.records_for([plain]))
    assert board.deployment is None and board.reference_row is None
    assert [r.label for r in board.table_rows] == [r.label for r in board.rows]
    assert board.columns == leaderboard.Leaderboard([], [], {}, "").columns


def test_card_shows_speed_and_memory(runs, tmp_path):
    result, text = api.card_report([runs], out=tmp_path / "card")
    md = (tmp_path / "card" / "card.md").read_text()
    assert f"memory GiB @ ctx {CTX}" in md and "| REF |" in md and "not measured" in md
    sidecar = json.loads((tmp_path / "card" / "card.json").read_text())
    rows = {r["label"]: r for r in sidecar["rows"]}
    assert rows["Q4_0"][f"tg128@d{DEPTH}"] == 24.0 and rows["REF"]["reference"] is True
    assert rows["Q4_0"][f"memory_gib@{CTX}"] == total_bytes(FIGURES["Q4_0"][0][CTX]) / GIB
    assert sidecar["deployment"]["machine"] == HERE["id"][:12]


# --------------------------------------------------------------------------------------------------
# the question
# --------------------------------------------------------------------------------------------------
def test_choose_answers_and_names_every_row_ruled_out(runs, klds):
    result, text = api.choose_report([runs], memory="2.5GiB", context="32k", min_tg=20, depth=DEPTH)
    assert result["best"] == "Q4_0" and result["passing"] == ["Q4_0", "Q4_0+kv-q8_0"]
    why = {r["label"]: [x["text"] for x in r["reasons"]] for r in result["ruled_out"]}
    gib = {label: total_bytes(mem[CTX]) / GIB for label, (mem, _) in FIGURES.items() if isinstance(mem.get(CTX), dict)}
    assert why == {
        "REF": [f"does not fit: {gib['REF']:.2f} GiB > 2.5 GiB at context 32,768",
                "too slow: 8.0 tokens/s < 20 tokens/s at depth 4,096"],
        "Q8_0": ["too slow: 15.0 tokens/s < 20 tokens/s at depth 4,096"],
        "Q6_K": [f"could not be measured at context 32,768: {OOM}"],
        "Q5_K": ["not measured: no speed or memory record"],
        "Q3_K": ["not measured at context 32,768 (measured contexts: 4,096)"],
        "Q2_K": ["measured on another machine: Intel Xeon 8480+ / NVIDIA H100 80GB HBM3"],
        "Q4_0+kv-q4_0": ["not measured at depth 4,096 (measured depths: 0)"]}
    assert set(why) | set(result["passing"]) == {"REF", *klds}  # every row named once
    assert result["front"] == ["REF", "Q8_0", "Q4_0"]
    assert "Answer: Q4_0: mean KLD " in text
    assert f"{gib['Q4_0']:.2f} GiB at context 32,768, 24.0 tokens/s at depth 4,096" in text
    assert "  REF (reference): does not fit" in text
    assert "Link: leaderboard.html?mem=2.5&ctx=32768&tg=20&depth=4096" in text


def test_choose_on_memory_alone_and_on_speed_alone(runs, klds):
    result, _ = api.choose_report([runs], memory=3, context=CTX)  # the reference needs 3080 MiB: over 3 GiB
    assert result["best"] == "Q8_0"
    result, _ = api.choose_report([runs], memory="3100MiB", context=CTX)
    assert result["best"] == "REF"  # the reference is the best quality by definition
    result, _ = api.choose_report([runs], min_tg=25, depth=0)
    fast = [label for label, (_, speed) in FIGURES.items() if speed.get(("tg", 128, 0), 0) >= 25]
    assert result["passing"] == sorted(fast, key=lambda label: klds.get(label, -1))
    result, _ = api.choose_report([runs], min_tg=1000, depth=0)
    assert result["best"] is None and result["passing"] == []


def test_choose_on_another_machine(runs):
    result, text = api.choose_report([runs], memory=8, context=CTX, min_tg=100, depth=DEPTH,
                                     machine=GPU["id"][:6])
    assert result["machine"] == GPU["id"][:12] and result["best"] == "Q4_0" and result["passing"] == ["Q4_0", "Q2_K"]
    why = {r["label"]: r["reasons"][0]["text"] for r in result["ruled_out"]}
    assert why["Q8_0"] == "measured on another machine: AMD EPYC 9B14"
    assert why["Q5_K"] == "not measured: no speed or memory record"


def test_choose_by_another_quality(runs, summaries_of):
    result, _ = api.choose_report([runs], min_tg=20, depth=DEPTH, by="same_top1_pct")
    passing = result["passing"]
    top1 = [summaries_of[label] for label in passing]
    assert top1 == sorted(top1, reverse=True)  # higher is better


@pytest.fixture(scope="module")
def summaries_of(runs) -> dict[str, float]:
    """label -> same top-1 %, read from the saved results."""
    out = {}
    for p in (runs / "results").glob("*.vs.REF.json"):
        s = json.loads(p.read_text())
        out[s["candidate"]["label"]] = s["metrics"]["same_top1_pct"]["value"]
    return out


def test_choose_cli(runs):
    res = run_cli("choose", runs, "--memory", "2.5", "--context", "32768", "--min-tg", "20", "--depth", "4096")
    assert res.returncode == 0, res.stderr
    assert "Answer: Q4_0" in res.stdout and "Q6_K: could not be measured at context 32,768" in res.stdout
    res = run_cli("choose", runs, "--memory", "2.5", "--context", "32768", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["question"]["n_ctx"] == CTX


def test_a_speed_without_a_depth_is_read_at_depth_0_as_llama_bench_reads_it(runs):
    res = run_cli("choose", runs, "--min-tg", "25", "--json")
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    assert result["question"]["depth"] == 0 and result == api.choose_report([runs], min_tg=25, depth=0)[0]
    assert "Default with --min-tg: 0" in " ".join(run_cli("choose", "--help").stdout.split())


@pytest.mark.parametrize("args, fragments", [
    (("--memory", "8 potatoes", "--context", "32768"), ("--memory '8 potatoes' is not a size",)),
    (("--memory", "0", "--context", "32768"), ("must be a positive size",)),
    (("--memory", "8", "--context", "16384"), ("--context 16384 was not measured", "4096, 32768")),
    (("--memory", "8", "--context", "lots"), ("--context 'lots' is not a token count",)),
    (("--memory", "8"), ("give both --memory and --context",)),
    (("--min-tg", "-5", "--depth", "0"), ("--min-tg must be a speed of 0 tokens/s or more",)),
    (("--min-tg", "fast", "--depth", "0"), ("--min-tg 'fast' is not a speed",)),
    (("--depth", "0",), ("give both --min-tg and --depth",)),
    (("--min-tg", "20", "--depth", "1000"), ("--depth 1000", "measured depths are 0, 4096")),
    ((), ("ask for memory",)),
    (("--min-tg", "20", "--depth", "0", "--by", "vibes"), ("--by 'vibes' is not a board metric",)),
    (("--min-tg", "20", "--depth", "0", "--machine", "ffff"), ("--machine 'ffff' is none of the machines",)),
])
def test_choose_refuses_bad_input(runs, args, fragments):
    assert_cli_error(run_cli("choose", runs, *args), *fragments)


def test_choose_without_records_is_refused(tmp_path):
    plain = build_results(tmp_path / "runs", candidates=CANDIDATES[:1], seed=3)
    assert_cli_error(run_cli("choose", plain, "--memory", "8", "--context", "4096"), "no speed or memory record")
    assert_cli_error(run_cli("leaderboard", plain, "--machine", "abc", "--out", tmp_path / "lb"),
                     "--machine abc: no speed or memory record")


def test_leaderboard_cli_shows_another_machine(runs, tmp_path):
    res = run_cli("leaderboard", runs, "--machine", GPU["id"][:8], "--out", tmp_path / "lb")
    assert res.returncode == 0, res.stderr
    assert f"[{GPU['id'][:12]}]" in res.stdout and f"**Measured on another machine, {HERE['id'][:12]}:**" in res.stdout


# --------------------------------------------------------------------------------------------------
# the question and the front on plain values
# --------------------------------------------------------------------------------------------------
def test_every_reason_on_plain_candidates():
    q = Question(memory_gib=1.0, n_ctx=100, min_tg=10.0, depth=0)
    cases = [(Candidate("control", 0.0, excluded=CONTROL_WHY), ["not a candidate"]),
             (Candidate("gone", 0.1), ["not measured"]),
             (Candidate("there", 0.1, elsewhere="GPU box"), ["measured on another machine"]),
             (Candidate("noq", None, {100: GIB}, {0: 11.0}), ["no quality figure"]),
             (Candidate("big", 0.1, {100: GIB + 1}, {0: 11.0}), ["does not fit"]),
             (Candidate("slow", 0.1, {100: GIB}, {0: 9.99}), ["too slow"]),
             (Candidate("both", 0.1, {100: 2 * GIB}, {0: 1.0}), ["does not fit", "too slow"]),
             (Candidate("oom", 0.1, {100: "no room"}, {0: 11.0}), ["could not be measured"]),
             (Candidate("ctx", 0.1, {200: GIB}, {0: 11.0}), ["not measured"]),
             (Candidate("ok", 0.1, {100: GIB}, {0: 10.0}), [])]
    for c, kinds in cases:
        assert [r.kind for r in deployment_choice.reasons(c, q)] == kinds, c.label
    assert {r.kind for c, _ in cases for r in deployment_choice.reasons(c, q)} == set(deployment_choice.RULE_OUTS)
    choice = deployment_choice.choose([c for c, _ in cases], q)
    assert choice.best.label == "ok" and [c.label for c, _ in choice.ruled_out] == [c.label for c, _ in cases[:-1]]


def test_a_near_miss_never_reads_as_the_limit():
    q = Question(memory_gib=1.0, n_ctx=100, min_tg=10.0, depth=0)
    near = Candidate("near", 0.1, {100: 1.004 * GIB}, {0: 9.96})
    assert [reason_text(r, q) for r in deployment_choice.reasons(near, q)] == [
        "does not fit: 1.004 GiB > 1 GiB at context 100", "too slow: 9.96 tokens/s < 10 tokens/s at depth 0"]


def test_ties_break_on_memory_then_speed_then_label():
    q = Question(memory_gib=10.0, n_ctx=1, min_tg=0.0, depth=0)
    cs = [Candidate("b", 0.2, {1: 2.0}, {0: 5.0}), Candidate("a", 0.2, {1: 2.0}, {0: 5.0}),
          Candidate("fast", 0.2, {1: 2.0}, {0: 6.0}), Candidate("small", 0.2, {1: 1.0}, {0: 1.0}),
          Candidate("best", 0.1, {1: 9.0}, {0: 1.0})]
    assert [c.label for c in deployment_choice.choose(cs, q).passing] == ["best", "small", "fast", "a", "b"]


def _brute_front(points: np.ndarray, better: np.ndarray) -> np.ndarray:
    """float64, every pair: on the front unless another point is no worse on every axis and better on one."""
    signed = points * better  # larger is better
    no_worse = (signed[:, None, :] >= signed[None, :, :]).all(axis=2)  # [i, j]: i no worse than j
    better_one = (signed[:, None, :] > signed[None, :, :]).any(axis=2)
    dominated = (no_worse & better_one).any(axis=0)
    return ~dominated


@pytest.mark.parametrize("seed", range(30))
def test_front_matches_brute_force_on_random_points(seed):
    rng = np.random.default_rng(seed)
    n, dims = int(rng.integers(1, 40)), int(rng.integers(1, 5))
    # few distinct values, so ties and identical points are common
    points = rng.integers(0, 5, size=(n, dims)).astype(np.float64) + rng.choice([0.0, 0.5], size=(n, dims))
    better = rng.choice([ranking.LOWER, ranking.HIGHER], size=dims)
    expected = _brute_front(points, better.astype(np.float64))
    got = ranking.front([tuple(p) for p in points], tuple(int(b) for b in better))
    assert got == expected.tolist()
    # a missing coordinate takes a point off the front and it dominates nothing
    holes = [None if random.Random(seed + i).random() < 0.2 else tuple(p) for i, p in enumerate(points)]
    kept = np.array([h is not None for h in holes])
    expected = np.zeros(n, bool)
    if kept.any():
        expected[kept] = _brute_front(points[kept], better.astype(np.float64))
    assert ranking.front(holes, tuple(int(b) for b in better)) == expected.tolist()


def test_parse_sizes_and_counts():
    assert boards.parse_size("8") == 8.0
    assert boards.parse_size("8GiB") == boards.parse_size("8 G") == 8.0
    assert boards.parse_size("512MiB") == 0.5
    assert boards.parse_size("8GB") == 8e9 / GIB
    assert boards.parse_count("32k", "--context") == 32768
    for bad in ("", "8 GiBs", "-1", "1e999"):
        with pytest.raises(QevalError):
            boards.parse_size(bad)
    assert question_link(Question(memory_gib=7.5, n_ctx=4096, min_tg=12.5, depth=0, by="kld_999")) == \
        "mem=7.5&ctx=4096&tg=12.5&depth=0&by=kld_999"


def test_the_control_is_named_not_chosen():
    rows = [BoardRow(label="control", quant="?", kv="f16/f16", type_k="f16", type_v="f16", size_gib=1.0, metrics={},
                     control=True)]
    from qeval.present.deployment_board import DeploymentBoard, Machine  # noqa: PLC0415

    view = DeploymentBoard(Machine("a" * 12, {"id": "a" * 64}, True), {}, {})
    (c,) = view.candidates(rows)
    q = Question(min_tg=1, depth=0)
    assert reason_text(deployment_choice.reasons(c, q)[0], q) == CONTROL_WHY


# --------------------------------------------------------------------------------------------------
# early decisions stay decided on quality alone
# --------------------------------------------------------------------------------------------------
def test_early_decisions_never_read_speed_or_memory(runs, tmp_path, monkeypatch):
    """The matrix's early rule (matrix.decisions_of over saved results) decides the same with and without the
    records beside them, and never calls their reader (the import contract keeps qeval.compare.early from them)."""
    import shutil  # noqa: PLC0415

    from qeval.compare.early import EarlySettings  # noqa: PLC0415
    from qeval.orchestrate import matrix  # noqa: PLC0415

    def refuse(*_):
        raise AssertionError("the early path read speed or memory")

    monkeypatch.setattr(boards, "records_in", refuse)
    monkeypatch.setattr(boards, "this_machine", refuse)
    bare = tmp_path / "runs"
    shutil.copytree(runs / "results", bare / "results")
    labels = [c[0] for c in CANDIDATES]

    def decided(where: Path) -> list:
        saved = [(label, where / "results" / f"{label}.vs.REF.json") for label in labels]
        return [(d.label, d.stop, d.reason, d.on_front, d.estimate.mean)
                for d in matrix.decisions_of(saved, 6, EarlySettings())]

    assert (runs / "deployment").is_dir() and not (bare / "deployment").exists()
    assert decided(runs) == decided(bare)


def test_a_board_measured_only_elsewhere_says_so_and_points_to_the_machine(runs, tmp_path):
    there = tmp_path / "runs"
    build_results(there, candidates=CANDIDATES[:1], seed=3)
    write_figures(there, {"Q8_0": FIGURES["Q8_0"]}, GPU)
    board = board_of(there)
    view = board.deployment
    assert view.machine.key == HERE["id"][:12] and view.contexts() == () and not view.front_column
    md = board.markdown()
    assert f"Nothing on this board was measured on {HERE['id'][:12]}" in md
    assert f"Rows were measured on other machines only ({GPU['id'][:12]}: Intel Xeon 8480+" in md
    assert f"**Measured on another machine, {GPU['id'][:12]}:**" in md
    assert_cli_error(run_cli("choose", there, "--memory", "8", "--context", "4096"),
                     "--context 4096 was not measured", f"--machine {GPU['id'][:12]} asks it")
    res = run_cli("choose", there, "--memory", "8", "--context", "4096", "--machine", GPU["id"][:12])
    assert res.returncode == 0 and "Answer: Q8_0" in res.stdout


def test_a_record_without_the_asked_figures_is_not_measured_there():
    """A record that holds a prompt speed only: the row is measured, not at the asked depth."""
    c = Candidate("pp-only", 0.1, recorded=True)
    q = Question(min_tg=1, depth=0)
    assert [reason_text(r, q) for r in deployment_choice.reasons(c, q)] == ["not measured at depth 0"]
