"""Verdicts that say what the data can say (issue 35, item 5; qeval.compare.verdict): a label is decided only where
the interval rules out what it denies, else it reads "undecided (N chunks)".

The 2-chunk case from the issue: a 2-chunk matrix labelled Q2_K with KV q4_0 "KLD over floor +0.658272 ± 0.065735
(within)" and explained "(within)" as "costs no more than the floor", though with 1 degree of freedom the interval
is ±12.7 SEs. Here per-token KLDs are built so that the chunk means give exactly that excess and SE, over 2 chunks
and over 40; the interval is computed independently with scipy's t.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.stats import t as scipy_t

from qeval.compare import verdict
from qeval.compare.metric_registry import MetricValue
from qeval.present import board

FLOOR_KLD = 0.0031  # the floor's own mean KLD: the margin "(within)" claims the excess stays below
PER_CHUNK = 5


def chunk_excesses(mean: float, se: float, n_chunks: int) -> np.ndarray:
    """n_chunks per-chunk excesses whose mean is `mean` and whose SE (sd/sqrt(n), ddof 1) is `se`."""
    z = np.linspace(-1.0, 1.0, n_chunks)
    z = (z - z.mean()) / z.std(ddof=1)
    return mean + se * math.sqrt(n_chunks) * z


def kv_row_over_floor(mean: float, se: float, n_chunks: int) -> board.BoardRow:
    """A KV row and the floor on the same tokens, the row's per-token KLD the floor's plus its chunk's excess; the
    KV row after compare_with_floor."""
    d = chunk_excesses(mean, se, n_chunks)
    chunk = np.repeat(np.arange(n_chunks), PER_CHUNK)
    position = np.tile(np.arange(PER_CHUNK), n_chunks)
    floor_kld = np.random.default_rng(3).gamma(2.0, FLOOR_KLD / 2.0, chunk.size)
    floor_kld += FLOOR_KLD - floor_kld.mean()
    columns = {"floor": {"chunk": chunk, "position": position, "kld": floor_kld},
               "q2_k+kv-q4_0": {"chunk": chunk, "position": position, "kld": floor_kld + d[chunk]}}

    def row(label, kld, **flags):
        return board.BoardRow(label=label, quant="Q2_K", kv="q4_0/q4_0",
                              metrics={"kld_mean": MetricValue(kld, 1e-4)}, chunks=n_chunks, **flags)

    rows = [row("floor", FLOOR_KLD, floor=True), row("q2_k+kv-q4_0", FLOOR_KLD + mean, kv_quant=True)]
    board.compare_with_floor(rows, lambda r: columns[r.label])
    return rows[1]


def expected_state(mean: float, se: float, n_chunks: int, margin: float) -> str:
    half = scipy_t.ppf(0.975, n_chunks - 1) * se
    return "above" if mean - half > 0 else "within" if mean + half <= margin else "undecided"


def test_the_issues_two_chunk_excess_is_undecided_and_40_chunks_decide_it():
    two = kv_row_over_floor(0.658272, 0.065735, 2)
    assert (two.kld_over_floor, two.kld_over_floor_se) == pytest.approx((0.658272, 0.065735), rel=1e-9)
    assert two.over_floor.low == pytest.approx(0.658272 - 12.7062 * 0.065735, rel=1e-4)  # -0.177: reaches 0
    assert expected_state(0.658272, 0.065735, 2, FLOOR_KLD) == two.over_floor.state == "undecided"
    assert board.floor_cell(two) == "+0.658272 ± 0.065735 undecided (2 chunks)"
    assert two.to_json()["floor_verdict"] == "undecided" and two.to_json()["floor_verdict_chunks"] == 2

    forty = kv_row_over_floor(0.658272, 0.065735, 40)
    assert forty.kld_over_floor_se == pytest.approx(0.065735, rel=1e-9)
    assert expected_state(0.658272, 0.065735, 40, FLOOR_KLD) == forty.over_floor.state == "above"
    assert board.floor_cell(forty) == "+0.658272 ± 0.065735 (above)"


def test_within_the_floor_needs_the_interval_below_the_floors_own_kld():
    """A tiny excess is "(within)" over 40 chunks (its interval below the floor's 0.0031); over 2 chunks the same
    excess and SE reach past it: undecided, never "(within)"."""
    forty = kv_row_over_floor(0.0001, 0.0005, 40)
    assert expected_state(0.0001, 0.0005, 40, FLOOR_KLD) == forty.over_floor.state == "within"
    assert board.floor_cell(forty) == "+0.000100 ± 0.000500 (within)"
    two = kv_row_over_floor(0.0001, 0.0005, 2)
    assert expected_state(0.0001, 0.0005, 2, FLOOR_KLD) == two.over_floor.state == "undecided"


def test_the_boards_table_json_and_note_never_read_undecided_as_within():
    floor = board.BoardRow(label="floor", quant="Q8_0", kv="f16/f16 gen",
                           metrics={"kld_mean": MetricValue(FLOOR_KLD, 1e-4)}, floor=True, chunks=2)
    two = kv_row_over_floor(0.658272, 0.065735, 2)
    md = board.leaderboard_markdown([floor, two])
    line = next(x for x in md.splitlines() if x.startswith("| q2_k+kv-q4_0 |"))
    assert "+0.658272 ± 0.065735 undecided (2 chunks)" in line and "(within)" not in line
    note = board.notes(floor=True)
    assert board.FLOOR_NOTE in note and board.VERDICT_RULE in note
    assert "costs no more than" not in note and "never read as (within)" in note
    assert json.loads(json.dumps(two.to_json()))["floor_verdict"] == "undecided"


@pytest.mark.parametrize(("excess", "se", "chunks", "margin", "state"), [
    (0.5, 0.1, 40, 0.0, "above"),  # clear of 0
    (-0.5, 0.1, 40, 0.0, "within"),  # all of it at most the margin 0 (a gate's pass)
    (0.05, 0.1, 40, 0.0, "undecided"),  # straddles 0
    (0.05, 0.01, 40, 1.0, "above"),  # above wins where both hold: a small cost that is certainly there
    (0.0, 0.01, 40, 0.1, "within"),
    (0.0, 0.01, 2, 0.1, "undecided"),  # 12.7 SEs reach past the margin
    (0.0, 0.0, 1, 0.1, "undecided"),  # one chunk decides nothing, however narrow
    (0.0, 0.0, 40, 0.0, "within"),  # exactly at the margin: within
])
def test_the_rule(excess, se, chunks, margin, state):
    v = verdict.judge(excess, se, chunks, margin=margin)
    assert (v.state, v.chunks) == (state, chunks)
    if chunks >= 2:
        half = scipy_t.ppf(0.975, chunks - 1) * se
        assert (v.low, v.high) == pytest.approx((excess - half, excess + half), rel=1e-12, abs=1e-15)


def test_bounds_widen_the_interval_on_both_sides():
    """A certified bound is no SE: it is added to either side, so an excess its SEs alone would call above is not."""
    v = verdict.judge(0.01, 0.001, 40, margin=0.03, bounds=0.009)
    half = scipy_t.ppf(0.975, 39) * 0.001 + 0.009
    assert (v.low, v.high) == pytest.approx((0.01 - half, 0.01 + half), rel=1e-12)
    assert v.state == "within" and verdict.judge(0.01, 0.001, 40, margin=0.03).state == "above"


def test_words_and_written_columns():
    v = verdict.judge(0.05, 0.1, 3)
    assert v.words() == "undecided (3 chunks)" and verdict.judge(1.0, 0.1, 3).words(above="beyond") == "beyond"
    assert verdict.written(v, "floor_verdict") == {"floor_verdict": "undecided", "floor_verdict_chunks": 3}
    assert verdict.written(None, "noise_verdict") == {"noise_verdict": None, "noise_verdict_chunks": None}
    assert verdict.fewer_chunks(40, 8) == 8 and verdict.fewer_chunks(40, None) is None
