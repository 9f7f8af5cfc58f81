"""`qeval cache-board`: a prose run, a conversation run (their own reference stores), needle results and deployment
records of one reference model, joined by label into one board. Synthetic stores compared for real (no model is
loaded); every cell checked against the saved results, the needle file and the records as written here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_cli_error, make_tokens, perturb, realistic_logits, run_cli, write_store
from deployment_records import MIB, machine, memory_entry, record_json, speed_entry, write_record
from test_leaderboard import _model, build_results, kv_block
from test_segments import CATEGORIES, N_CHUNKS, N_CTX, N_VOCAB, plain_positions, random_labels

from qeval import api
from qeval.orchestrate import boards
from qeval.storage.scoring import WindowLabels

REF = "Q8_0"
FLOOR_KV = {"type_k": "f16", "type_v": "f16", "flash_attn": "on"}  # the reference's cache on the other kernel path
# label, model file, quant, size GiB, bpw, KV, noise sigma
PROSE = (("Q8_0+kv-q8_0", "m-Q8_0.gguf", "Q8_0", 1.06, 8.5, "q8_0", 0.2),
         ("Q8_0+kv-q4_0", "m-Q8_0.gguf", "Q8_0", 1.06, 8.5, "q4_0", 0.9),
         ("Q8_0+kv-q8_0-q4_0", "m-Q8_0.gguf", "Q8_0", 1.06, 8.5, "q8_0/q4_0", 0.5),
         ("floor", "m-Q8_0.gguf", "Q8_0", 1.06, 8.5, FLOOR_KV, 0.05))
PROSE_CTX = 2560  # scored from 1280: two of the default depth bands (0, 512, 2048, 2560) hold tokens
SEGMENTS = ("answer@0", "tool_call@0", "tool_call@32")  # the conversations at two history depths
THINKING = "thinking@32"  # held too, but no column: a cache board reads tool calls and answers
CONVERSATION = (("Q8_0+kv-q4_0", "q4_0", 0.8), ("Q8_0+kv-q8_0-q4_0", "q8_0/q4_0", 0.4))  # no q8_0 row: empty cells
NEEDLE_ROWS = {"Q8_0+kv-q4_0": {25: (3, 4), 75: (1, 4)}, "Q8_0+kv-q5_0": {25: (4, 4), 75: (2, 4)}}  # (agree, asked)
HERE = machine()
KV_MIB = {REF: 68.0, "Q8_0+kv-q8_0": 36.125, "Q8_0+kv-q4_0": 19.125}  # at ctx 4096
TG = {REF: (50.0, 41.5), "Q8_0+kv-q8_0": (49.0, 40.0), "Q8_0+kv-q4_0": (47.5, 33.25)}  # at depths 0 and 4096


def fingerprint(quant: str) -> str:
    return _model("x", quant, 0, 0)["fingerprint"]


def build_conversations(runs: Path, ref_label: str = REF, ref_quant: str = "Q8_0") -> Path:
    """A conversation run: a labelled reference store of segments at two depths, candidates compared and saved."""
    rng = np.random.default_rng(5)
    tokens = make_tokens(rng, N_CHUNKS, N_CTX, N_VOCAB)
    labels = random_labels(rng)
    odd = labels[1::2]
    odd[odd == 1] = len(SEGMENTS) + 1  # the answers of every other window are thinking instead
    windows = WindowLabels.from_arrays(labels, (*SEGMENTS, THINKING), CATEGORIES, [0, 2, 1, 2, 0, 1])
    ref = {c: realistic_logits(rng, len(plain_positions(labels[c])), N_VOCAB) for c in range(N_CHUNKS)}
    extra = {"scoring": "assistant", "windows": windows.to_json(), "corpus": {"name": "conversations"}}
    runs.mkdir(parents=True)
    write_store(runs / f"{ref_label}.qeval", tokens, ref, N_VOCAB, label=ref_label,
                model=_model(f"m-{ref_quant}.gguf", ref_quant, 1.06, 8.5), kv=kv_block("f16"), **extra)
    for label, kv, sigma in CONVERSATION:
        write_store(runs / f"{label}.qeval", tokens, {c: perturb(rng, x, sigma) for c, x in ref.items()}, N_VOCAB,
                    label=label, model=_model("m-Q8_0.gguf", "Q8_0", 1.06, 8.5), kv=kv_block(kv), **extra)
        api.kld_report(ref_label, label, runs_dir=runs, threads=1, save_result=True)
    return runs


def wilson(k: int, n: int) -> tuple[float, float]:
    z = 1.959963984540054
    p, d = k / n, 1 + z * z / n
    centre, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return centre - half, centre + half


def agreement(k: int, n: int) -> dict:
    lo, hi = wilson(k, n)
    return {"hits": k, "n": n, "p": k / n, "lo": lo, "hi": hi}


def needle_result(ref_label: str = REF, ref_quant: str = "Q8_0") -> dict:
    """A `qeval needle --json` result, written by hand in its shape (qeval.orchestrate.needles)."""
    def row(label, kv, by_depth):
        return {"label": label, "model": "m.gguf", "fingerprint": fingerprint(ref_quant),
                "kv_allocated": {**kv_block(kv), "flash_attn": True},
                "depths": [{"depth": d, "agreement": agreement(*kn)} for d, kn in by_depth.items()]}

    return {"reference": ref_label, "needles": {"source": "needles.jsonl", "count": 30}, "corpus": "austen",
            "depths": [25.0, 75.0], "trials": 4, "seed": 0,
            "contexts": [{"n_ctx": 2048, "reference": row(ref_label, "f16", {25: (4, 4), 75: (4, 4)}),
                          "candidates": [row(label, label.split("kv-")[1], by) for label, by in NEEDLE_ROWS.items()]}]}


@pytest.fixture(autouse=True)
def here_machine(monkeypatch):
    monkeypatch.setattr(boards, "this_machine", lambda: HERE["id"])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cache-board")
    prose = build_results(root / "prose", PROSE, ref_label=REF, ref_quant="Q8_0", n_ctx=PROSE_CTX)
    for label, kv_mib in KV_MIB.items():
        rec = record_json(label, fingerprint("Q8_0"), "q8_0" if label != REF else "f16", HERE,
                          [memory_entry(4096, {"model": 1085, "kv": kv_mib, "compute": 300})],
                          [speed_entry("tg", 128, 0, TG[label][0]), speed_entry("tg", 128, 4096, TG[label][1])])
        rec["kv"].update(kv_block({"Q8_0+kv-q4_0": "q4_0", REF: "f16"}.get(label, "q8_0")))
        write_record(prose, rec)
    needles = root / "needles.json"
    needles.write_text(json.dumps(needle_result()))
    return {"prose": prose, "chat": build_conversations(root / "chat"), "needles": needles}


@pytest.fixture(scope="module")
def saved(inputs) -> dict[tuple[str, str], dict]:
    """(run, label) -> the saved comparison JSON, read apart from the board's code."""
    return {(run, json.loads(p.read_text())["candidate"]["label"]): json.loads(p.read_text())
            for run in ("prose", "chat") for p in (inputs[run] / "results").glob("*.vs.*.json")}


@pytest.fixture(scope="module")
def board(inputs, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # module-scoped: the autouse fixture is not in force yet
        mp.setattr(boards, "this_machine", lambda: HERE["id"])
        return boards.cache_board([inputs["prose"], inputs["chat"]], [inputs["needles"]],
                                  out=tmp_path_factory.mktemp("out"))


def rows_of(board) -> dict[str, dict]:
    return {r["label"]: r for r in board.records()}


def pm(mean: float, se: float) -> str:
    return f"{mean:.6f} ± {se:.6f}"


def test_rows_are_joined_by_label_reference_first_then_floor(board):
    assert board.labels[:2] == [REF, "floor"]
    assert set(board.labels) == {REF, *(p[0] for p in PROSE), "Q8_0+kv-q5_0"}
    assert board.labels[-1] == "Q8_0+kv-q5_0"  # only in the needle file: after every measured row
    rows = rows_of(board)
    assert rows[REF]["role"] == "reference" and rows["floor"]["role"] == "floor"
    assert rows["Q8_0+kv-q8_0-q4_0"]["kv"] == "q8_0/q4_0" and rows["Q8_0+kv-q5_0"]["kv"] == "q5_0/q5_0"
    assert [s.name for s in board.sources] == ["synthetic-corpus@2560", "conversations@48"]


def test_every_depth_band_of_the_prose_run(board, saved):
    rows = rows_of(board)
    table = dict(zip(board.labels, board.cells()))
    header = board.header()
    for label, *_ in PROSE:
        bands = saved["prose", label]["by_depth"]
        assert [(b["lo"], b["hi"]) for b in bands] == [(512, 2048), (2048, 2560)]
        for b in bands:
            key = f"synthetic-corpus@2560/kld_{b['lo']}-{b['hi']}"
            assert rows[label][key] == b["kld"]["mean"] and rows[label][f"{key}_se"] == b["kld"]["se"]
            column = header.index(f"synthetic-corpus@2560 KLD {b['lo']}-{b['hi']} ± SE")
            assert table[label][column] == pm(b["kld"]["mean"], b["kld"]["se"])
    assert rows["Q8_0+kv-q5_0"]["synthetic-corpus@2560/kld_512-2048"] is None


def test_tool_call_and_answer_kld_at_each_depth_and_a_missing_row(board, saved):
    rows = rows_of(board)
    for label, _, _ in CONVERSATION:
        segments = {g["segment"]: g for g in saved["chat", label]["by_segment"]}
        for name in SEGMENTS:
            key = f"conversations@48/kld_{name}"
            assert rows[label][key] == segments[name]["kld"]["mean"]
            assert rows[label][f"{key}_se"] == segments[name]["kld"]["se"]
        assert THINKING in segments
    assert not any("thinking" in h for h in board.header())
    table = dict(zip(board.labels, board.cells()))
    column = board.header().index("conversations@48 KLD tool_call@32 ± SE")
    assert table["Q8_0+kv-q8_0"][column] == ""  # not in the conversation run: an empty cell, no error
    assert rows["Q8_0+kv-q8_0"]["conversations@48/kld_tool_call@32"] is None


def test_the_floor_column_pairs_each_kv_row_with_the_floor(board, saved):
    rows = rows_of(board)
    table = dict(zip(board.labels, board.cells()))
    column = board.header().index("synthetic-corpus@2560 KLD over floor ± SE")
    assert table["floor"][column] == "floor"
    floor = saved["prose", "floor"]["kld"]["mean"]
    for label in ("Q8_0+kv-q8_0", "Q8_0+kv-q4_0", "Q8_0+kv-q8_0-q4_0"):
        excess = rows[label]["synthetic-corpus@2560/kld_over_floor"]
        # the same tokens on both: the paired mean difference is the difference of the means
        assert excess == pytest.approx(saved["prose", label]["kld"]["mean"] - floor, rel=1e-9)
        assert table[label][column].startswith(f"{excess:+.6f} ± ")


def test_needle_agreement_per_depth_and_n_ctx(board):
    rows = rows_of(board)
    table = dict(zip(board.labels, board.cells()))
    for label, by_depth in NEEDLE_ROWS.items():
        for depth, (k, n) in by_depth.items():
            key = f"needles@2048/agreement@{depth}"
            lo, hi = wilson(k, n)
            assert (rows[label][f"{key}_hits"], rows[label][f"{key}_n"]) == (k, n)
            assert rows[label][f"{key}_lo"] == pytest.approx(lo) and rows[label][f"{key}_hi"] == pytest.approx(hi)
            column = board.header().index(f"needles c2048 agreement @ {depth} %")
            assert table[label][column] == f"{100 * k / n:.0f} % [{100 * lo:.0f}, {100 * hi:.0f}] ({k}/{n})"
    assert table["Q8_0+kv-q4_0"][board.header().index("needles c2048 agreement @ 25 %")] == "75 % [30, 95] (3/4)"
    assert rows["Q8_0+kv-q8_0"]["needles@2048/agreement@25_hits"] is None


def test_kv_mib_at_the_context_and_tg_at_depth(board):
    rows = rows_of(board)
    table = dict(zip(board.labels, board.cells()))
    header = board.header()
    for label, mib in KV_MIB.items():
        assert rows[label]["kv_mib@4096"] == pytest.approx(int(mib * MIB) / MIB)
        assert table[label][header.index("KV MiB @ ctx 4096")] == f"{mib:,.1f}"
        assert (rows[label]["tg@d0"], rows[label]["tg@d4096"]) == TG[label]
        assert table[label][header.index("tg t/s @ d4096")] == f"{TG[label][1]:,.1f}"
    assert table["Q8_0+kv-q8_0-q4_0"][header.index("KV MiB @ ctx 4096")] == "not measured"


def test_files_and_cli(inputs, board, tmp_path):
    assert set(board.paths) == {"cache-board.md", "cache-board.json", "cache-board.html"}
    page = board.paths["cache-board.html"].read_text()
    assert page.startswith("<!DOCTYPE html>") and 'id="cache-board"' in page and "Q8_0+kv-q8_0-q4_0" in page
    written = json.loads(board.paths["cache-board.json"].read_text())
    assert written["rows"] == json.loads(json.dumps(board.records()))
    out = tmp_path / "cli"
    res = run_cli("cache-board", inputs["prose"], inputs["chat"], "--needles", inputs["needles"], "--out", out,
                  "--machine", HERE["id"][:8], "--json")
    assert res.returncode == 0, res.stderr
    printed = json.loads(res.stdout)
    assert printed["rows"] == written["rows"] and (out / "cache-board.html").is_file()
    text = run_cli("cache-board", inputs["prose"], "--out", out, "--machine", HERE["id"][:8])
    assert text.returncode == 0 and "| Q8_0+kv-q4_0 |" in text.stdout and "KV MiB @ ctx 4096" in text.stdout


def test_another_reference_is_refused_with_one_message(inputs, tmp_path):
    other = build_conversations(tmp_path / "other", ref_label="Q4_0", ref_quant="Q4_0")
    res = run_cli("cache-board", inputs["prose"], other, "--out", tmp_path / "out")
    assert res.returncode == 2
    assert_cli_error(res, "different reference models", "label: Q8_0 vs Q4_0", "fingerprint", str(other / "results"))
    needles = tmp_path / "needles.json"
    needles.write_text(json.dumps(needle_result(ref_quant="Q4_0")))
    res = run_cli("cache-board", inputs["prose"], "--needles", needles, "--out", tmp_path / "out")
    assert res.returncode == 2
    assert_cli_error(res, "different reference models", "fingerprint", str(needles))
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_no_needle_result_is_refused(inputs, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert_cli_error(run_cli("cache-board", inputs["prose"], "--needles", bad), "not a needle result", str(bad))


def test_a_label_with_other_kv_types_in_another_source_is_refused(inputs, tmp_path):
    result = needle_result()
    result["contexts"][0]["candidates"][0]["kv_allocated"].update(type_k="q8_0", type_v="q8_0")
    needles = tmp_path / "needles.json"
    needles.write_text(json.dumps(result))
    assert_cli_error(run_cli("cache-board", inputs["prose"], "--needles", needles, "--out", tmp_path / "out"),
                     "Q8_0+kv-q4_0 has K/V q4_0/q4_0", "q8_0/q8_0", str(needles))


def test_two_needle_results_for_one_row_and_n_ctx_are_refused(inputs, tmp_path):
    copy = tmp_path / "again.json"
    copy.write_text(inputs["needles"].read_text())
    assert_cli_error(run_cli("cache-board", inputs["prose"], "--needles", inputs["needles"], "--needles", copy,
                             "--out", tmp_path / "out"),
                     "two needle results for Q8_0+kv-q4_0 at n_ctx 2048", str(copy))
    assert not (tmp_path / "out").exists()
