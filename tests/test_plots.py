"""Exact zeros on the leaderboard's log axes (qeval.present.plots): a candidate whose logits equal the reference's
(KLD exactly 0, as a bit-identical control gives) is drawn at a floor one decade below the smallest positive value
drawn, marked and labelled "0" — never at an invented 1e-9 that stretches the axis over decades of nothing. Checked on
the matplotlib figures themselves (data, limits, tick labels), for every plot with a log axis; expected floors are
worked out here from the saved results, not by the helper under test."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from test_leaderboard import CANDIDATES, build_results

from qeval.present import leaderboard, plots
from qeval.present.task_flips import FlipFigures

# a candidate with the reference's own logits: every per-token KLD, every band's and the mean exactly 0
SAME = ("SAME", "m-SAME.gguf", "SAME", 1.5, 8.0, "f16", 0.0)


def decade_below(value: float) -> float:
    """The floor a plot must use for smallest positive value `value`: the power of ten one decade below its own."""
    return 10.0 ** (math.floor(math.log10(value)) - 1)


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    runs = build_results(tmp_path_factory.mktemp("zeros") / "runs", candidates=(SAME, *CANDIDATES))
    return leaderboard.build([runs])


@pytest.fixture(scope="module")
def clean_board(tmp_path_factory):
    return leaderboard.build([build_results(tmp_path_factory.mktemp("clean") / "runs")])


def tick_labels(ax, axis: str = "y") -> list[str]:
    ax.figure.canvas.draw()
    return [t.get_text() for t in getattr(ax, f"get_{axis}ticklabels")()]


def assert_marked_floor(ax, floor: float, axis: str = "y") -> None:
    """The axis is logarithmic and ends just below `floor`, whose tick reads "0", with a dotted line there."""
    assert getattr(ax, f"get_{axis}scale")() == "log"
    low, _ = getattr(ax, f"get_{axis}lim")()
    assert floor / 10 < low < floor, (low, floor)
    ticks = list(getattr(ax, f"get_{axis}ticks")())
    labels = tick_labels(ax, axis)
    assert labels[ticks.index(pytest.approx(floor))] == "0" and labels.count("0") == 1
    lines = [ln for ln in ax.get_lines() if ln.get_linestyle() == ":"]
    coordinate = (lambda ln: ln.get_ydata()) if axis == "y" else (lambda ln: ln.get_xdata())
    assert any(np.allclose(coordinate(ln), floor) for ln in lines)


def test_the_same_logits_give_exact_zeros(board):
    same = board.results[[r.label for r in board.rows].index("SAME")]
    assert board.rows[[r.label for r in board.rows].index("SAME")].kld_mean == 0.0 and not same.per_token["kld"].any()


def test_kld_vs_size_draws_zero_at_a_marked_floor(board):
    fig = plots.plot_kld_vs_size(board)
    ax = fig.axes[0]  # the weight quants' panel (the KV-cache quants have their own)
    weights = [r for r in board.rows if not r.kv_quant]
    smallest = min(r.kld_mean for r in weights if r.kld_mean > 0)
    floor = decade_below(smallest)
    assert_marked_floor(ax, floor)
    ys = {c.lines[0].get_ydata()[0] for c in ax.containers}
    assert floor in ys and min(ys) == floor  # SAME sits on the floor, nothing below it
    assert {r.kld_mean for r in weights if r.kld_mean > 0} <= ys  # the others where they are


def test_kld_distribution_puts_zero_tokens_in_a_bin_of_their_own(board):
    fig = plots.plot_kld_distribution(board)
    ax_hist, ax_tail = fig.axes
    positive = [np.asarray(res.per_token["kld"]) for res in board.results]
    lo = min(float(np.percentile(k[k > 0], 0.5)) for k in positive if (k > 0).any())
    floor = decade_below(lo)
    for ax in (ax_hist, ax_tail):
        assert_marked_floor(ax, floor, "x")
    same = [r.label for r in board.rows].index("SAME")
    # SAME's histogram: all of its tokens (weight 1) in the floor's bin
    patch = ax_hist.patches[same]
    xy = patch.get_xy()
    assert xy[:, 1].max() == pytest.approx(1.0)
    assert floor / 2 <= xy[np.argmax(xy[:, 1]), 0] <= floor * 2
    # its tail: P(KLD > x) steps down at the floor
    assert set(ax_tail.get_lines()[same].get_xdata()) == {floor}


def test_kld_by_depth_draws_a_zero_band_at_the_floor(board):
    fig = plots.plot_kld_by_depth(board)
    ax_mean, ax_p99 = fig.axes
    bands = {r.label: res.summary.by_depth for r, res in zip(board.rows, board.results)}
    means = [b.kld["mean"] for bs in bands.values() for b in bs]
    lower = [b.kld["mean"] - 1.96 * b.kld["se"] for bs in bands.values() for b in bs]
    floor = decade_below(min(v for v in means + lower if v > 0))
    assert_marked_floor(ax_mean, floor)
    same = [r.label for r in board.rows].index("SAME")
    assert set(ax_mean.get_lines()[same].get_ydata()) == {floor}
    p99 = [b.kld["ladder"]["99.0%"] for bs in bands.values() for b in bs]
    assert_marked_floor(ax_p99, decade_below(min(v for v in p99 if v > 0)))


def test_kld_by_group_draws_a_zero_segment_at_the_floor(board):
    """Rows given a segment and a category from their band's figures (SAME's are 0, as the issue's control was)."""
    rows = [dataclasses.replace(r, segments={"answer": res.summary.by_depth[0]},
                                categories={"chat": res.summary.by_depth[0]})
            for r, res in zip(board.rows, board.results)]
    fig = plots.plot_kld_by_group(dataclasses.replace(board, rows=rows))
    means = [res.summary.by_depth[0].kld["mean"] for res in board.results]
    lower = [res.summary.by_depth[0].kld["mean"] - 1.96 * res.summary.by_depth[0].kld["se"] for res in board.results]
    floor = decade_below(min(v for v in means + lower if v > 0))
    same = [r.label for r in board.rows].index("SAME")
    for ax in fig.axes:
        assert_marked_floor(ax, floor)
        container = ax.containers[same]
        assert container.lines[0].get_ydata()[0] == floor
        for c, mean in zip(ax.containers, means):  # the others at their means
            if mean > 0:
                assert c.lines[0].get_ydata()[0] == pytest.approx(mean, rel=1e-12)


def test_flips_vs_kld_draws_a_zero_kld_at_the_floor(board):
    flips = FlipFigures(flips_pct=2.0, flips=2, correct_to_wrong=1, wrong_to_correct=1, mcnemar_p=1.0, n_tasks=100,
                        accuracy_pct=70.0, ref_accuracy_pct=70.0)
    rows = [dataclasses.replace(r, task_flips={"cloze": flips}) for r in board.rows]
    fig = plots.plot_flips_vs_kld(dataclasses.replace(board, rows=rows, tasks=("cloze",)))
    ax, = fig.axes
    floor = decade_below(min(r.kld_mean for r in board.rows if r.kld_mean > 0))
    assert_marked_floor(ax, floor, "x")
    assert min(ax.get_lines()[0].get_xdata()) == floor


def test_heatmap_keeps_a_log_scale_and_greys_a_zero_cell(board):
    from matplotlib.colors import LogNorm  # noqa: PLC0415

    fig = plots.plot_heatmap(board, "kld_mean")
    ax = fig.axes[0]
    image, = ax.get_images()
    positive = [r.kld_mean for r in board.rows if r.kld_mean > 0]
    assert isinstance(image.norm, LogNorm) and image.norm.vmin == pytest.approx(min(positive))
    names, kvs, values, _ = plots.heatmap_grid(board, "kld_mean")
    i, j = np.argwhere(values == 0)[0]
    assert image.get_array()[i, j] < image.norm.vmin  # drawn in the colour under the scale
    assert tuple(image.cmap.get_under()[:3]) != tuple(image.cmap(0.0)[:3])
    assert "0" in [t.get_text() for t in ax.texts]


def test_without_zeros_no_floor_is_drawn(clean_board):
    """The same plots of a board whose every KLD is positive: plain log axes, no "0" anywhere."""
    for name, fig in clean_board.figures().items():
        for ax in fig.axes:
            for axis in ("x", "y"):
                if getattr(ax, f"get_{axis}scale")() == "log":
                    assert "0" not in tick_labels(ax, axis), name
                    assert not [ln for ln in ax.get_lines() if ln.get_linestyle() == ":"], name


def test_log_zero_places_zeros_and_only_zeros_at_the_floor():
    log = plots.LogZero([0.0, 0.003, 0.5], reach=[-0.001])
    assert log.needed and log.floor == pytest.approx(1e-4)
    np.testing.assert_allclose(log.place([0.0, -1e-12, 0.003, 0.5]), [1e-4, 1e-4, 0.003, 0.5])
    np.testing.assert_allclose(log.below([0.003], [0.004]), [0.003 - 1e-4])  # the bar ends at the floor
    plain = plots.LogZero([0.003, 0.5], reach=[0.001])
    assert not plain.needed and plain.place([0.003]).tolist() == [0.003]
