"""The text of paired comparisons (`qeval compare`): a verdict per metric and the table of differences."""

from __future__ import annotations

import math

from qeval.compare import metric_registry
from qeval.compare.paired_stats import BOOT_SEED, N_BOOT, PairedDifference
from qeval.present.gate_text import control_text


def _decimals(x: float) -> int:
    """Decimals that show about two significant digits of `x` (a CI half-width)."""
    if not math.isfinite(x) or x <= 0.0:
        return 4
    return int(min(8, max(1, 1 - math.floor(math.log10(x)))))


def _signed(x: float, dec: int) -> str:
    s = f"{x:+.{dec}f}"
    return ("−" + s[1:]) if s.startswith("-") else s


def format_p(p: float) -> str:
    if p < 0.001:
        return "p < 0.001"
    return f"p = {p:.2g}" if p < 0.1 else f"p = {p:.2f}"


def verdict(r: PairedDifference, name_a: str = "A", name_b: str = "B") -> str:
    """One plain sentence: which candidate is better on this metric, or that the data can't tell."""
    what = metric_registry.lookup(r.metric).title.removeprefix("mean ")  # the per-token values: "A has lower KLD than B"
    dec = _decimals((r.ci_high - r.ci_low) / 2.0 if r.ci_high > r.ci_low else abs(r.diff))
    numbers = (f"difference {_signed(r.diff, dec)} {r.unit}, {100 * r.confidence:g} % CI "
               f"[{_signed(r.ci_low, dec)}, {_signed(r.ci_high, dec)}], {format_p(r.p_value)} over {r.n_chunks} chunks")
    if r.metric == "nll_mean":
        numbers += f"; PPL ratio {name_a}/{name_b} {math.exp(r.diff):.4f}"
    if r.diff == 0.0 and r.se == 0.0:
        return f"no significant difference in {what} between {name_a} and {name_b}: identical on all " \
               f"{r.n_tokens} tokens"
    if not r.significant:
        return f"no significant difference in {what} between {name_a} and {name_b}: {numbers}"
    if r.metric == "same_top1_pct":
        claim = f"{name_a} keeps the reference's top-1 token {'more' if r.diff > 0 else 'less'} often than {name_b}"
    else:
        claim = f"{name_a} has {'lower' if r.diff < 0 else 'higher'} {what} than {name_b}"
    return f"{claim}: {numbers}"


def paired_text(result: dict) -> str:
    ref, a, b = result["reference"], result["a"], result["b"]
    how = ("a t-interval over per-chunk mean differences" if result["method"] == "t"
           else f"a block bootstrap over chunks ({N_BOOT} draws, seed {BOOT_SEED})")
    lines = [f"reference : {ref['label']} ({ref['path']})",
             f"A         : {a['label']} ({a['path']})",
             f"B         : {b['label']} ({b['path']})",
             f"paired    : {result['chunks']} chunks of n_ctx {ref['n_ctx']}, {result['scored_tokens']} scored tokens, "
             f"the same tokens for A and B",
             *([f"depth     : only scored tokens at logit positions {result['depth']['lo']}:{result['depth']['hi']}"]
               if "depth" in result else []),
             *(["tokens    : only the assistant's tokens in " + ", ".join(f"{k} {v!r}" for k, v in
                                                                         result["selection"].items())]
               if "selection" in result else []),
             f"intervals : {100 * result['confidence']:g} % from {how}", *[f"note      : {n}" for n in result["notes"]],
             "",
             f"{'metric':<14} {'A':>12} {'B':>12} {'A − B':>12}   {'CI':<27} p"]
    for key, d in result["differences"].items():
        dec = _decimals((d["ci_high"] - d["ci_low"]) / 2.0 if d["ci_high"] > d["ci_low"] else abs(d["diff"]))
        m = metric_registry.lookup(key)
        ci = f"[{_signed(d['ci_low'], dec)}, {_signed(d['ci_high'], dec)}]"
        means = f"{d['mean_a']:>12{m.fmt}} {d['mean_b']:>12{m.fmt}}"
        lines.append(f"{m.heading:<14} {means} {_signed(d['diff'], dec):>12}   "
                     f"{ci:<27} {format_p(d['p_value'])[2:]}")
    lines += ["", *[f"- {v}" for v in result["verdicts"]]]
    for role, over in result.get("control", {}).items():
        lines.append(f"- {role}: {control_text(over)}")
    return "\n".join(lines)
