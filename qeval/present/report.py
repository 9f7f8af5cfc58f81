"""Text and JSON views of results; the text blocks are laid out like llama-perplexity's."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

from qeval import __version__
from qeval.compare import sampler
from qeval.compare.metric_registry import KLD_BLOCK, METRICS, PPL_BLOCK, TOKEN_BLOCK, Metric, read, sampler_metrics
from qeval.compare.metrics import PER_TOKEN_FIELDS, Comparison
from qeval.identity import comparison_request
from qeval.present import task_flips
from qeval.storage.llamacpp import record_values
from qeval.storage.store import StoreHeader


def describe(source) -> dict:
    """Who a store is: the facts a reader of a report needs to trust the comparison."""
    h: StoreHeader = source.header
    return {
        "label": h.label,
        "path": str(source.path),
        "source": h.source,
        "model": h.model,
        "kv": h.kv,
        "corpus": h.corpus,
        "n_vocab": h.n_vocab,
        "n_ctx": h.n_ctx,
        "tokens_sha256": h.tokens_sha256,
        "chunks": len(source.chunk_indices),
        "complete": bool(source.complete),
    }


def comparison_json(cmp: Comparison, bands: list[tuple[int, int]] | None = None) -> dict:
    """The comparison, and what it measured: `request` (qeval.identity) decides whether a saved copy
    may stand for a later request. bands: of the by-depth block (default: powers of 4 from 512)."""
    return {"reference": describe(cmp.ref), "candidate": describe(cmp.cand), **cmp.summary(bands),
            "request": comparison_request(cmp.ref, cmp.cand, len(cmp.chunks),
                                          sampler.settings_names(sampler.names_in(cmp.per_token))).to_json(),
            "qeval_version": __version__}


def _pm(value: float, se: float, width: int = 10, prec: int = 6) -> str:
    return f"{value:{width}.{prec}f} ± {se:{width}.{prec}f}"


def comparison_text(result: dict) -> str:
    """llama-perplexity's three blocks, line for line, each followed by the lines of the metrics that
    qeval.compare.metric_registry places in it."""
    ref, cand = result["reference"], result["candidate"]
    p, k, dp = result["perplexity"], result["kld"], result["delta_p"]
    top1 = result["same_top1"]
    lines = [
        f"reference : {_who(ref)}",
        f"candidate : {_who(cand)}",
        f"chunks    : {result['chunks']} of n_ctx {ref['n_ctx']}, {result['scored_tokens']} scored tokens",
        *_block(PPL_BLOCK, result, [
            f"Mean PPL(Q)                   : {_pm(p['ppl_cand'], p['ppl_cand_se'])}",
            f"Mean PPL(base)                : {_pm(p['ppl_ref'], p['ppl_ref_se'])}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * p['cor_ln_ppl']:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {_pm(p['ln_ratio'], p['ln_ratio_se'])}",
            f"Mean PPL(Q)/PPL(base)         : {_pm(p['ratio'], p['ratio_se'])}",
            f"Mean PPL(Q)-PPL(base)         : {_pm(p['diff'], p['diff_se'])}"]),
        *_block(KLD_BLOCK, result, [
            f"Mean    KLD: {_pm(k['mean'], k['se'])}",
            *(f"{name:<7} KLD: {v:10.6f}" for name, v in k["ladder"].items())]),
        *_block(TOKEN_BLOCK, result, [
            f"Mean    Δp: {100 * dp['mean']:6.3f} ± {100 * dp['se']:5.3f} %",
            *(f"{name:<7} Δp: {100 * v:6.3f}%" for name, v in dp["ladder"].items()),
            f"RMS Δp    : {100 * dp['rms']:6.3f} ± {100 * dp['rms_se']:5.3f} %",
            f"Same top p: {100 * top1['fraction']:6.3f} ± {100 * top1['se']:5.3f} %"]),
        *depth_lines(result.get("by_depth", [])),
        *sampler_lines(result.get("samplers", {})),
    ]
    return "\n".join(lines)


def sampler_lines(samplers: dict) -> list[str]:
    """A short block per sampler (qeval.compare.sampler): the two distributions after its truncation and
    temperature, compared token by token."""
    rows = []
    for name, b in samplers.items():
        tvd, ladder = b["tvd"], b["tvd"]["ladder"]
        rows += ["", f"====== Sampler {name}: {sampler.parse(name).describe()} ======",
                 f"Mean    TVD     : {100 * tvd['mean']:7.3f} ± {100 * tvd['se']:6.3f} %   (mass that moves; "
                 f"median {100 * ladder['Median']:.3f}, 99% {100 * ladder['99.0%']:.3f}, "
                 f"max {100 * ladder['Maximum']:.3f} %)",
                 f"Agreement       : {100 * b['agreement']['mean']:7.3f} ± {100 * b['agreement']['se']:6.3f} %   "
                 "(coupled draws pick the same token: speculative-decoding acceptance)",
                 f"Support differs : {100 * b['support_differs']['fraction']:7.3f} ± "
                 f"{100 * b['support_differs']['se']:6.3f} %   (mean size: reference "
                 f"{b['support']['ref_mean']:.2f}, candidate {b['support']['cand_mean']:.2f} tokens)"]
        if "greedy_agreement" in b:
            g = b["greedy_agreement"]
            rows.append(f"Greedy agreement: {100 * g['fraction']:7.3f} ± {100 * g['se']:6.3f} %   (same argmax)")
    return rows


def depth_lines(bands: list[dict]) -> list[str]:
    """The by-depth block: one row per band of logit positions [lo, hi) (qeval.compare.depth)."""
    if not bands:
        return []
    rows = ["", "====== By depth (logit position; SE cluster-robust over 256-position blocks) ======",
            f"{'depth':>15} {'n':>7}  {'mean KLD':>21}  {'99% KLD':>9} {'99.9% KLD':>9}  {'same top %':>16}  "
            f"{'PPL(base)':>10} {'PPL(Q)':>10}  {'mean Δp %':>15}"]
    for b in bands:
        k, top1, p, dp = b["kld"], b["same_top1"], b["perplexity"], b["delta_p"]
        rows.append(f"{b['lo']:>7}-{b['hi']:<7} {b['n']:>7}  {k['mean']:9.6f} ± {k['se']:9.6f}  "
                    f"{k['ladder']['99.0%']:9.6f} {k['ladder']['99.9%']:9.6f}  "
                    f"{100 * top1['fraction']:7.3f} ± {100 * top1['se']:6.3f}  "
                    f"{p['ppl_ref']:10.4f} {p['ppl_cand']:10.4f}  {100 * dp['mean']:6.3f} ± {100 * dp['se']:5.3f}")
    return rows


def _block(name: str, result: dict, llama_lines: list[str]) -> list[str]:
    """A block: its heading, llama-perplexity's lines, then a line per registry metric placed in it (one the
    result holds: a result saved before a metric existed lacks it)."""
    held = result.get("metrics", {})
    extra = [_metric_line(m, held[m.key]) for m in METRICS.values()
             if m.report and m.report[0] == name and m.key in held]
    return ["", f"====== {name} statistics ======", *llama_lines, *extra]


def _metric_line(m: Metric, measured: dict) -> str:
    """A metric's line in llama-perplexity's style: percentages as `Same top p`, anything else as `Mean KLD`."""
    label, value, se = m.report[1], measured["value"], measured["se"]
    if m.unit == "%":
        return f"{label}: {value:6.3f}" + (f" ± {se:5.3f} %" if se is not None else " %")
    return f"{label}: " + (_pm(value, se) if se is not None else f"{value:10.6f}")


def _who(d: dict) -> str:
    model = d.get("model") or {}
    bits = [d["label"] or "?"]
    if model.get("file_name"):
        bits.append(model["file_name"])
    kv = d.get("kv") or {}
    if kv:
        bits.append(f"KV {kv.get('type_k', '?')}/{kv.get('type_v', '?')}")
    bits.append(f"({d['path']})")
    return "  ".join(bits)


def ppl_text(label: str, path: str, ppl: dict, chunks: int, n_tokens: int) -> str:
    return (f"{label} ({path}): {chunks} chunks, {n_tokens} scored tokens\n"
            f"Final estimate: PPL = {ppl['ppl']:.4f} +/- {ppl['ppl_se']:.5f}")


def info(source) -> dict:
    h: StoreHeader = source.header
    n_chunks = len(source.chunk_indices)
    scored = n_chunks * h.n_scored
    llama_bytes = 20 + 4 * h.n_chunks * h.n_ctx + scored * 2 * record_values(h.n_vocab)
    size = getattr(source, "size_bytes", 0)
    return {
        "path": str(source.path),
        "header": h.to_json(),
        "complete": bool(source.complete),
        "chunks_present": n_chunks,
        "chunks_expected": h.chunk_stop - h.chunk_start,
        "scored_tokens": scored,
        "size_bytes": size,
        "bytes_per_scored_token": size / scored if scored else math.nan,
        "llamacpp_equivalent_bytes": llama_bytes,
        "ratio_vs_llamacpp": llama_bytes / size if size else math.nan,
    }


def info_text(d: dict) -> str:
    h = d["header"]
    state = "complete" if d["complete"] else "INCOMPLETE (still being written or interrupted)"
    model = h.get("model") or {}
    lines = [
        f"store      : {d['path']}",
        f"label      : {h['label']}   source: {h['source']}   qeval {h['qeval_version']}, format v{h['format_version']}",
        f"state      : {state}: {d['chunks_present']} of {d['chunks_expected']} chunks "
        f"(chunk range {h['chunk_start']}:{h['chunk_stop']} of {h['n_chunks']})",
        f"layout     : n_vocab {h['n_vocab']}, n_ctx {h['n_ctx']}, {h['n_scored']} scored tokens per chunk "
        f"(--score {h.get('scoring', 'half')}: positions {h['first_scored']}..{h['n_ctx'] - 2}), "
        f"top-{h['top_k']} ids kept",
        f"code       : {json.dumps(h['codec'], sort_keys=True)}",
    ]
    if model:
        lines.append("model      : " + ", ".join(f"{k} {v}" for k, v in model.items() if not isinstance(v, dict)))
    if h.get("kv"):
        lines.append("kv cache   : " + ", ".join(f"{k} {v}" for k, v in h["kv"].items()))
    if h.get("corpus"):
        lines.append("corpus     : " + ", ".join(f"{k} {v}" for k, v in h["corpus"].items()))
    lines += [
        f"tokens     : sha256 {h['tokens_sha256'][:16]}…, tokenizer {h['tokenizer_sha256'][:16] or '-'}",
        f"size       : {d['size_bytes']:,} bytes, {d['bytes_per_scored_token']:,.0f} bytes per scored token "
        f"({d['scored_tokens']:,} tokens)",
        f"vs llama.cpp: {d['llamacpp_equivalent_bytes']:,} bytes in --kl-divergence-base layout, "
        f"{d['ratio_vs_llamacpp']:.1f}x larger",
    ]
    return "\n".join(lines)


def write_per_token(cmp: Comparison, path: Path) -> None:
    """One row per scored token: .npz keeps full precision, anything else is written as CSV."""
    t = cmp.per_token
    if path.suffix == ".npz":
        np.savez_compressed(path, **t)
        return
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        fields = (*PER_TOKEN_FIELDS, *filter(sampler.is_column, t))  # then the samplers' columns, if any
        w.writerow(fields)
        cols = [t[k] for k in fields]
        for row in zip(*cols):
            w.writerow([int(v) if isinstance(v, (np.integer, np.bool_)) else f"{float(v):.9g}" for v in row])


# The metrics on every leaderboard, in table order; each is a column `key` and, where it has an SE, `key_se`.
BOARD_METRICS = tuple(m for m in METRICS.values() if m.board)


def board_metrics(samplers=()) -> tuple[Metric, ...]:
    """The metrics of a leaderboard's columns: BOARD_METRICS, then the board metrics of each sampler in
    `samplers` (names; its mean TVD)."""
    return (*BOARD_METRICS, *(m for name in samplers for m in sampler_metrics(name) if m.board))


def board_keys(samplers=()) -> tuple[str, ...]:
    """The row keys of board_metrics(samplers): each metric's key and, where it has an SE, its SE key."""
    return tuple(k for m in board_metrics(samplers) for k in ((m.key, m.se_key) if m.has_se else (m.key,)))


def common_samplers(summaries: list[dict]) -> tuple[str, ...]:
    """The samplers (as the first comparison names them) whose figures every comparison holds: a leaderboard's
    sampler columns."""
    first, *rest = summaries or [{}]
    return tuple(name for name in first.get("samplers") or {}
                 if all(sampler.held_as(s.get("samplers"), name) for s in rest))


def leaderboard_row(result: dict, samplers=()) -> dict:
    """One row of the KLD/PPL leaderboard from a comparison's JSON (None for a metric it does not hold), with the
    figures of `samplers` (names; held under that name or another of the same settings)."""
    cand = result["candidate"]
    model, kv = cand.get("model") or {}, cand.get("kv") or {}
    held = read(result)
    for name in samplers:  # held under this name, or under another of the same settings
        other = sampler.held_as(result.get("samplers"), name)
        if other not in (None, name):
            held.update((m.key, held.get(o.key)) for m, o in zip(sampler_metrics(name), sampler_metrics(other)))
    row = {
        "label": cand["label"],
        "quant": model.get("quant", "?"),
        "kv": f"{kv.get('type_k', '?')}/{kv.get('type_v', '?')}",
        "model_file": model.get("file_name"),
        "type_k": kv.get("type_k"), "type_v": kv.get("type_v"),
        "size_gib": model.get("size_gib"),
        "bpw": model.get("bits_per_weight"),
    }
    for m in board_metrics(samplers):
        mv = held.get(m.key)
        row[m.key] = None if mv is None else mv.value
        if m.has_se:
            row[m.se_key] = None if mv is None else mv.se
    deepest = (result.get("by_depth") or [None])[-1]  # the band of the deepest scored positions
    row.update(deepest_band=f"{deepest['lo']}-{deepest['hi']}" if deepest else None,
               kld_deepest=deepest["kld"]["mean"] if deepest else None,
               kld_deepest_se=deepest["kld"]["se"] if deepest else None)
    return row


DEEPEST_KEYS = ("deepest_band", "kld_deepest", "kld_deepest_se")


def leaderboard_columns(samplers=(), tasks=()) -> tuple[tuple[str, str], ...]:
    """(heading, row key) of the table's columns after the label: a TVD column per sampler, a flips column
    per task set (qeval.present.task_flips)."""
    return (("quant", "quant"), ("KV", "kv"), ("size GiB", "size_gib"), ("BPW", "bpw"),
            *((m.heading + (" ± SE" if m.has_se else ""), m.key) for m in board_metrics(samplers)),
            ("KLD deepest band ± SE", "kld_deepest"), *task_flips.columns(tasks))


def leaderboard_cells(r: dict, samplers=(), tasks=()) -> list[str]:
    """The formatted cells of one leaderboard row: label, then leaderboard_columns(samplers, tasks)."""
    deepest = "" if r.get("kld_deepest") is None else (
        f"{_num(r['kld_deepest'], '.6f')} ± {_num(r['kld_deepest_se'], '.6f')} ({r['deepest_band']})")
    return [r["label"], r["quant"], r["kv"], _num(r["size_gib"], ".3f"), _num(r["bpw"], ".2f"),
            *(_metric_cell(m, r) for m in board_metrics(samplers)), deepest,
            *(task_flips.cell(r, task) for task in tasks)]


def _metric_cell(m: Metric, r: dict) -> str:
    cell = _num(r[m.key], m.fmt)
    return f"{cell} ± {_num(r[m.se_key], m.fmt.lstrip('+'))}" if m.has_se and r[m.key] is not None else cell


def leaderboard_sorted(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (r["kld_mean"], r["label"]))


def leaderboard_markdown(rows: list[dict], pareto=None, samplers=(), tasks=()) -> str:
    """A paste-ready markdown table, sorted by mean KLD; `pareto` (labels) adds a Pareto-front column, each of
    `samplers` (names) a TVD column, each of `tasks` (task set names) a flips column."""
    header = ["label", *(name for name, _ in leaderboard_columns(samplers, tasks))] + \
        ([] if pareto is None else ["Pareto"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in leaderboard_sorted(rows):
        cells = [_md_escape(c) for c in leaderboard_cells(r, samplers, tasks)]
        if pareto is not None:
            cells.append("✓" if r["label"] in pareto else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|")


def _num(v, fmt: str) -> str:
    return "?" if v is None else f"{v:{fmt}}"


def ppl_matrix_markdown(pairs: list[tuple[str, str, str]], summaries: list[dict]) -> str:
    """Rows = model file, columns = KV type; cells = PPL ± SE (the reference's PPL for its own f16 cell)."""
    kvs = list(dict.fromkeys(["f16"] + [kv for _, _, kv in pairs]))
    models = list(dict.fromkeys(path for _, path, _ in pairs))
    cell = {}
    for (label, path, kv), s in zip(pairs, summaries):
        p = s["perplexity"]
        cell[(path, kv)] = f"{p['ppl_cand']:.4f} ± {p['ppl_cand_se']:.4f}"
        ref_model = s["reference"]["model"].get("file_name")
        cell.setdefault(("ref", "f16"), (ref_model, f"{p['ppl_ref']:.4f} ± {p['ppl_ref_se']:.4f} (ref)"))
    ref_name, ref_cell = cell.get(("ref", "f16"), (None, ""))
    if not any(kv == "f16" for _, _, kv in pairs) and ref_name not in {Path(p).name for p in models}:
        kvs.remove("f16")
    lines = ["| model | " + " | ".join(f"KV {kv}" for kv in kvs) + " |", "|---|" + "---|" * len(kvs)]
    for path in models:
        name = Path(path).name
        cells = [cell.get((path, kv), ref_cell if name == ref_name and kv == "f16" else "") for kv in kvs]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
