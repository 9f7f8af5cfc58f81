"""Per-window scored positions from per-token labels (--score assistant), and the groups they give: by_segment,
by_category, --segment/--category. Synthetic labelled stores; every figure checked against plain float64."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import assert_cli_error, make_tokens, perturb, realistic_logits, run_cli, write_store
from test_depth import cluster_se64

from qeval import api
from qeval.compare.depth import Selection
from qeval.errors import QevalError, StoreFormatError
from qeval.present import results
from qeval.storage.scoring import WindowLabels
from qeval.storage.store import StoreHeader, StoreReader, StoreWriter

N_CTX, N_VOCAB, N_CHUNKS = 48, 1500, 6
SEGMENTS = ("thinking", "answer", "tool_call")
CATEGORIES = ("chat", "code", "math")


def random_labels(rng: np.random.Generator) -> np.ndarray:
    """uint8 [N_CHUNKS, N_CTX]: runs of each segment and of unlabelled tokens, as conversations give them."""
    labels = np.zeros((N_CHUNKS, N_CTX), dtype=np.uint8)
    for row in labels:
        at = int(rng.integers(0, 6))
        while at < N_CTX:
            run = int(rng.integers(1, 9))
            row[at:at + run] = rng.integers(0, len(SEGMENTS) + 1)
            at += run
        row[int(rng.integers(1, N_CTX))] = 2  # every window scores something
    return labels


def plain_positions(labels_row: np.ndarray) -> np.ndarray:
    """Logit position p is scored when token p+1 is labelled (token 0 never is: no position precedes it)."""
    return np.array([p for p in range(N_CTX - 1) if labels_row[p + 1]], dtype=np.int64)


@pytest.fixture
def labelled(tmp_path):
    rng = np.random.default_rng(11)
    tokens = make_tokens(rng, N_CHUNKS, N_CTX, N_VOCAB)
    labels = random_labels(rng)
    category_of = [0, 2, 1, 2, 0, 1]  # each category in two windows: a cluster-robust SE needs two blocks
    windows = WindowLabels.from_arrays(labels, SEGMENTS, CATEGORIES, category_of)
    ref_logits = {c: realistic_logits(rng, len(plain_positions(labels[c])), N_VOCAB) for c in range(N_CHUNKS)}
    cand_logits = {c: perturb(rng, x, 0.5) for c, x in ref_logits.items()}
    directory = tmp_path / "runs"
    directory.mkdir()
    extra = {"scoring": "assistant", "windows": windows.to_json()}
    write_store(directory / "REF.qeval", tokens, ref_logits, N_VOCAB, label="REF", **extra)
    write_store(directory / "CAND.qeval", tokens, cand_logits, N_VOCAB, label="CAND", **extra)
    return directory, tokens, labels, category_of


def test_window_labels_give_the_positions_of_labelled_tokens():
    rng = np.random.default_rng(1)
    labels = random_labels(rng)
    labels[:, 0] = 3  # token 0 is never scored, whatever its label
    windows = WindowLabels.from_arrays(labels, SEGMENTS, CATEGORIES, [0, 1, 2, 0, 1, 2])
    back = WindowLabels.from_json(json.loads(json.dumps(windows.to_json())), N_CTX, N_CHUNKS)
    assert back == windows
    for c in range(N_CHUNKS):
        expected = labels[c].copy()
        expected[0] = 0
        np.testing.assert_array_equal(back.labels(c, N_CTX), expected)
        np.testing.assert_array_equal(back.positions(c, N_CTX), plain_positions(labels[c]))
        assert back.segment_codes(c, back.positions(c, N_CTX), N_CTX).tolist() == \
            [int(labels[c][p + 1]) for p in plain_positions(labels[c])]
    assert back.head(2).category_of == (0, 1) and len(back.head(2).runs) == 2


@pytest.mark.parametrize("broken, message", [
    (lambda d: d["chunks"][0].extend([3, 2, 1]), "out of order"),  # overlaps the run before it
    (lambda d: d["chunks"][1].__setitem__(3, 9), "label 9"),
    (lambda d: d["chunks"].pop(), "all 2 windows"),
    (lambda d: d["chunks"].__setitem__(0, [0]), "no token is scored"),
    (lambda d: d["chunks"][0].__setitem__(0, 7), "category 7"),
    (lambda d: d.__setitem__("segments", []), "segments"),
    (lambda d: d["chunks"][0].__setitem__(1, 0), "out of order"),  # token 0 labelled
    (lambda d: d["chunks"][0].append(5), "integers"),
])
def test_malformed_window_labels_are_refused(broken, message):
    d = {"segments": list(SEGMENTS), "categories": ["chat"], "chunks": [[0, 1, 4, 1, 4, 9, 2], [0, 2, 3, 3]]}
    WindowLabels.from_json(d, 16, 2)
    broken(d)
    with pytest.raises(ValueError, match=message):
        WindowLabels.from_json(d, 16, 2)


def test_a_header_scores_by_labels_exactly_when_it_holds_them(labelled):
    directory = labelled[0]
    with StoreReader(directory / "REF.qeval") as store:
        d = store.header.to_json()
    assert d["format_version"] == 4 and "n_scored" not in d  # labels and an error record
    StoreHeader.from_json(d, "x")
    for change, message in ((lambda h: h.__setitem__("scoring", "half"), "--score half"),
                            (lambda h: h.pop("windows"), "without per-token labels"),
                            (lambda h: h.__setitem__("format_version", 2), "format version 2")):
        bad = json.loads(json.dumps(d))
        change(bad)
        with pytest.raises(StoreFormatError, match=message):
            StoreHeader.from_json(bad, "x")


def test_labelled_store_holds_a_row_per_labelled_token_and_resumes(labelled, tmp_path):
    directory, tokens, labels, _ = labelled
    with StoreReader(directory / "REF.qeval", verify_chunks=True) as store:
        for c in range(N_CHUNKS):
            assert store.read_chunk(c).n_tokens == len(plain_positions(labels[c])) == store.header.n_scored_of(c)
        header, lut, chunks = store.header, store.lut, [store.read_chunk(c) for c in range(2)]
        chunks = [type(c)(c.index, c.logprob_target, c.logprob_max, c.top_ids, bytes(c.codes_zst), error=c.error)
                  for c in chunks]
    path = tmp_path / "part.qeval"
    with StoreWriter.open(path, header, tokens, lut) as w:
        w.write_chunk(chunks[0])
    with StoreWriter.open(path, header, tokens, lut) as w:  # resumed: chunk 0 is complete, chunk 1 comes next
        assert w.done_chunks == {0}
        w.write_chunk(chunks[1])
        assert w.done_chunks == {0, 1}


def test_by_segment_and_by_category_match_float64(labelled, tmp_path):
    directory, _, labels, category_of = labelled
    out = tmp_path / "tokens.npz"
    result, text = api.kld_report("REF", "CAND", runs_dir=directory, threads=1, per_token=out)
    t = dict(np.load(out))
    expected_positions = np.concatenate([plain_positions(labels[c]) for c in range(N_CHUNKS)])
    np.testing.assert_array_equal(t["position"], expected_positions)
    np.testing.assert_array_equal(t["segment"], [labels[c][p + 1] - 1 for c, p in zip(t["chunk"], t["position"])])
    np.testing.assert_array_equal(t["category"], [category_of[c] for c in t["chunk"]])
    assert result["labels"] == {"segments": list(SEGMENTS), "categories": list(CATEGORIES)}
    for key, column, names in (("by_segment", "segment", SEGMENTS), ("by_category", "category", CATEGORIES)):
        groups = result[key]
        assert [g[column] for g in groups] == [n for k, n in enumerate(names) if (t[column] == k).any()]
        assert sum(g["n"] for g in groups) == result["scored_tokens"] == len(t["kld"])
        for g in groups:
            keep = t[column] == names.index(g[column])
            kld = t["kld"][keep].astype(np.float64)
            assert g["n"] == int(keep.sum())
            assert g["kld"]["mean"] == pytest.approx(math.fsum(kld.tolist()) / len(kld), rel=1e-12)
            assert g["kld"]["ladder"]["99.9%"] == pytest.approx(np.percentile(kld, 99.9), rel=1e-12)
            assert g["same_top1"]["fraction"] == pytest.approx(t["same_top1"][keep].mean(), rel=1e-12)
            assert g["kld"]["se"] == pytest.approx(cluster_se64(kld, t["chunk"][keep], t["position"][keep]), rel=1e-9)
    assert "====== By segment" in text and "====== By category" in text and "tool_call" in text
    csv_path = tmp_path / "tokens.csv"
    api.kld_report("REF", "CAND", runs_dir=directory, threads=1, per_token=csv_path)
    lines = csv_path.read_text().splitlines()
    header, first = lines[0].split(","), lines[1].split(",")
    assert header[-2:] == ["segment", "category"]
    assert first[-2:] == [SEGMENTS[t["segment"][0]], CATEGORIES[t["category"][0]]]  # names, not codes


def test_a_saved_result_keeps_its_groups_and_can_be_cut_to_one(labelled):
    directory = labelled[0]
    api.kld_report("REF", "CAND", runs_dir=directory, threads=1, save_result=True)
    path = directory / "results" / "CAND.vs.REF.json"
    saved = results.load_result(path, with_per_token=True)
    assert [g.name for g in saved.summary.by_segment] == [g["segment"] for g in json.loads(path.read_text())["by_segment"]]
    answer = saved.selected(Selection(segment="answer"))
    code = saved.selected(Selection(category="code"))
    by_segment = {g.name: g for g in saved.summary.by_segment}
    by_category = {g.name: g for g in saved.summary.by_category}
    assert answer.summary.scored_tokens == by_segment["answer"].n
    assert answer.summary.figures.kld["mean"] == pytest.approx(by_segment["answer"].kld["mean"], rel=1e-12)
    assert code.summary.figures.kld["mean"] == pytest.approx(by_category["code"].kld["mean"], rel=1e-12)
    assert answer.summary.to_json()["selection"] == {"segment": "answer"}
    both = saved.selected(Selection(segment="answer", category="code"))
    keep = (saved.per_token["segment"] == 1) & (saved.per_token["category"] == 1)
    assert both.summary.scored_tokens == int(keep.sum())
    with pytest.raises(QevalError, match="thinking, answer, tool_call"):
        saved.selected(Selection(segment="reasoning"))


def test_check_and_compare_take_a_segment_and_a_category(labelled):
    directory = labelled[0]
    res = run_cli("check", "--ref", "REF", "--cand", "CAND", "--segment", "answer", "--max-kld", "100",
                  "--json", "--runs-dir", directory)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["selection"] == {"segment": "answer"}
    full, _ = api.kld_report("REF", "CAND", runs_dir=directory, threads=1)
    answer = next(g for g in full["by_segment"] if g["segment"] == "answer")
    assert out["checks"][0]["value"] == pytest.approx(answer["kld"]["mean"], rel=1e-12)
    paired, text = api.paired_report("REF", "CAND", "CAND", runs_dir=directory, category="math")
    math_group = next(g for g in full["by_category"] if g["category"] == "math")
    assert paired["scored_tokens"] == math_group["n"] and paired["selection"] == {"category": "math"}
    assert "only the assistant's tokens in category 'math'" in text
    assert_cli_error(run_cli("check", "--ref", "REF", "--cand", "CAND", "--category", "poetry", "--max-kld", "1",
                             "--runs-dir", directory), "--category 'poetry'", "chat, code, math")


def test_a_segment_of_text_windows_is_refused(tmp_path):
    from conftest import make_pair

    pair = make_pair(tmp_path / "runs")
    assert_cli_error(run_cli("check", "--ref", "REF", "--cand", "CAND", "--segment", "answer", "--max-kld", "1",
                             "--runs-dir", pair.directory), "not of conversations")


def test_stores_labelled_differently_are_not_compared(labelled, tmp_path):
    directory, tokens, labels, category_of = labelled
    relabelled = labels.copy()
    relabelled[0, 1:] = 0
    relabelled[0, 5] = 1
    windows = WindowLabels.from_arrays(relabelled, SEGMENTS, CATEGORIES, category_of)
    rng = np.random.default_rng(2)
    logits = {c: realistic_logits(rng, len(windows.positions(c, N_CTX)), N_VOCAB) for c in range(N_CHUNKS)}
    write_store(directory / "OTHER.qeval", tokens, logits, N_VOCAB, label="OTHER", scoring="assistant",
                windows=windows.to_json())
    assert_cli_error(run_cli("kld", "--ref", "REF", "--cand", "OTHER", "--runs-dir", directory),
                     "per-token labels differ")


def test_leaderboard_has_a_kld_column_per_segment_and_draws_kld_by_group(labelled, tmp_path):
    import csv  # noqa: PLC0415
    import dataclasses  # noqa: PLC0415

    from qeval.present import board as boardrows  # noqa: PLC0415
    from qeval.present import card, leaderboard, plots  # noqa: PLC0415 - matplotlib

    directory, tokens, labels, _ = labelled
    rng = np.random.default_rng(5)
    far = {c: realistic_logits(rng, len(plain_positions(labels[c])), N_VOCAB) for c in range(N_CHUNKS)}
    with StoreReader(directory / "REF.qeval") as store:
        windows = store.header.to_json()["windows"]
    write_store(directory / "FAR.qeval", tokens, far, N_VOCAB, label="FAR", scoring="assistant", windows=windows)
    for cand in ("CAND", "FAR"):
        api.kld_report("REF", cand, runs_dir=directory, threads=1, save_result=True)
    saved = {cand: json.loads((directory / "results" / f"{cand}.vs.REF.json").read_text()) for cand in ("CAND", "FAR")}
    segments = [g["segment"] for g in saved["CAND"]["by_segment"]]
    assert segments == [s for s in SEGMENTS if s in segments] and len(segments) > 1

    board = leaderboard.leaderboard([directory / "results"], out=tmp_path / "board")
    assert board.segments == tuple(segments)
    keys = [k for name in segments for k in (f"kld_{name}", f"kld_{name}_se")]
    i = board.columns.index("kld_deepest_se") + 1
    assert list(board.columns[i:i + len(keys)]) == keys
    doc = json.loads((tmp_path / "board" / "leaderboard.json").read_text())
    with open(tmp_path / "board" / "leaderboard.csv", newline="") as f:
        csv_rows = {r["label"]: r for r in csv.DictReader(f)}
    md = (tmp_path / "board" / "leaderboard.md").read_text()
    header = [c.strip() for c in next(line for line in md.splitlines() if line.startswith("| label")).strip("|")
              .split(" | ")]  # " | ": a cell may hold an escaped \\|
    at = header.index("KLD deepest band ± SE") + 1
    assert header[at:at + len(segments)] == [f"KLD {name} ± SE" for name in segments]
    for row in doc["rows"]:
        line = next(line for line in md.splitlines() if line.startswith(f"| {row['label']} |"))
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        for j, g in enumerate(saved[row["label"]]["by_segment"]):
            name, mean, se = g["segment"], g["kld"]["mean"], g["kld"]["se"]
            assert row[f"kld_{name}"] == mean and row[f"kld_{name}_se"] == se
            assert float(csv_rows[row["label"]][f"kld_{name}"]) == mean
            assert float(csv_rows[row["label"]][f"kld_{name}_se"]) == se
            assert cells[at + j] == f"{mean:.6f} ± {se:.6f}"
    page = board.paths["leaderboard.html"].read_text()
    assert all(f"<th>KLD {name} ± SE</th>" in page for name in segments) and 'id="plot-kld_by_group"' in page
    assert (tmp_path / "board" / "kld_by_group.png").stat().st_size > 0

    # a row lacking a segment: an empty cell, null in JSON; the names keep the summaries' order
    first, *_ = board.rows
    lacking = dataclasses.replace(first, label="LACKING", segments={k: v for k, v in first.segments.items()
                                                                    if k != segments[0]})
    assert boardrows.group_names([lacking, first]) == tuple(segments)
    cells = boardrows.leaderboard_cells(lacking, segments=segments)
    assert cells[-len(segments)] == "" and cells[-1] != ""
    assert lacking.to_json().get(f"kld_{segments[0]}") is None

    # the plot: a panel by segment and one by category, a marker series per candidate at its groups' means
    fig = board.figures()["kld_by_group"]
    assert "kld_by_group" in plots.PLOTS and len(fig.axes) == 2
    for ax, key, column in zip(fig.axes, ("by_segment", "by_category"), ("segment", "category")):
        names = [g[column] for g in saved["CAND"][key]]
        assert [t.get_text() for t in ax.get_xticklabels()] == names
        assert [c.get_label() for c in ax.containers] == [r.label for r in board.rows]
        for container, r in zip(ax.containers, board.rows):
            means = [g["kld"]["mean"] for g in saved[r.label][key]]
            np.testing.assert_allclose(container.lines[0].get_ydata(), means, rtol=1e-12)

    # the model card: a column per segment, the sidecar's by_segment the saved means and SEs
    c = card.build([directory / "results"])
    table = c.markdown().splitlines()
    head = [h.strip() for h in next(line for line in table if line.startswith("| label")).strip("|").split(" | ")]
    assert [h for h in head if h.startswith("mean KLD, ") and "positions" not in h] == \
        [f"mean KLD, {name} ± SE" for name in segments]
    for row in c.to_json()["rows"]:
        assert row["by_segment"] == {g["segment"]: {"kld_mean": g["kld"]["mean"], "kld_mean_se": g["kld"]["se"]}
                                     for g in saved[row["label"]]["by_segment"]}
