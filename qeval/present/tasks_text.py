"""Text of task accuracy (`qeval tasks show`) and of answer flips between two task stores (`qeval flips`)."""

from __future__ import annotations


def accuracy_text(store, n_records: int, acc: dict) -> str:
    """One task store's accuracy (qeval.compare.flips.accuracy) and where it is."""
    t = store.header.get("task", {})
    state = "" if store.complete else f", incomplete: {n_records} of {store.n_selected} tasks"
    return (f"{store.label} on {t.get('name')} ({store.kind}, {n_records} tasks{state}): "
            f"accuracy {acc['accuracy_pct']:.4f} ± {acc['se_pct'] or 0:.4f} % ({acc['correct']}/{acc['n']})\n"
            f"  store {store.path}")


def flips_text(r: dict, max_listed: int = 20) -> str:
    t, n = r["task"], r["n_tasks"]
    width = max(len(r["ref"]["label"]), len(r["cand"]["label"]))
    held = "" if r["ref_tasks"] == r["cand_tasks"] == n else \
        f" (the reference holds {r['ref_tasks']}, the candidate {r['cand_tasks']})"
    lines = [f"Task flips: {t.get('name')} ({t.get('format')}), {n} tasks in both stores{held}"]
    for side, key in (("reference", "ref"), ("candidate", "cand")):
        d = r[side]
        lines.append(f"  {side} {r[key]['label']:<{width}}  accuracy {d['accuracy_pct']:7.3f} ± "
                     f"{d['se_pct'] or 0:.3f} %  ({d['correct']}/{d['n']})")
    lines += [f"  Δ accuracy {r['delta_accuracy_pct']:+.3f} ± {r['delta_se_pct'] or 0:.3f} % (paired)",
              (f"  flips {r['flips']} ({r['flips_pct']:.2f} % of tasks): correct→wrong {r['correct_to_wrong']} "
               f"({r['correct_to_wrong_pct']:.2f} %), wrong→correct {r['wrong_to_correct']} "
               f"({r['wrong_to_correct_pct']:.2f} %); answers changed {r['answers_changed']} "
               f"({r['answers_changed_pct']:.2f} %)"),
              (f"  McNemar exact p = {r['mcnemar_p']:.4g} (two-sided, {r['correct_to_wrong']} vs "
               f"{r['wrong_to_correct']} discordant)")]
    if r["ref_margin_median_flipped"] is not None and r["ref_margin_median_kept"] is not None:
        lines.append(f"  median reference margin: flipped tasks {r['ref_margin_median_flipped']:.4f}, the others "
                     f"{r['ref_margin_median_kept']:.4f}")
    lines.append("  flips by reference margin (its answer's score minus the best other; equal-count bins):")
    lines.append(f"    {'margin':>19}  {'tasks':>5}  {'flips':>5}  {'c→w':>4}  {'w→c':>4}  {'flip rate':>9}  "
                 f"{'changed':>7}")
    for b in r["margin_bins"]:
        lines.append(f"    {b['margin_min']:8.4f} – {b['margin_max']:8.4f}  {b['n']:5d}  {b['flips']:5d}  "
                     f"{b['correct_to_wrong']:4d}  {b['wrong_to_correct']:4d}  {b['flip_rate_pct']:8.2f}%  "
                     f"{b['changed_rate_pct']:6.2f}%")
    flipped = r["flipped"]
    if flipped:
        shown = flipped[:max_listed]
        more = "" if len(shown) == len(flipped) else f", the first {len(shown)} of {len(flipped)} (--json lists all)"
        lines.append(f"  flipped tasks (choices counted from 0){more}:")
        for f in shown:
            lines.append(f"    task {f['index']:6d}  gold {f['gold']}  reference {f['ref_answer']} → candidate "
                         f"{f['cand_answer']}  {f['direction']:<13}  reference margin {f['ref_margin']:.4f}")
    return "\n".join(lines)
