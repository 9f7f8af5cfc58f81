"""Text and JSON views of results; the text blocks are laid out like llama-perplexity's."""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np

from qeval.compare import sampler
from qeval.compare.metric_registry import (
    KLD_BLOCK,
    METRICS,
    NOT_BOUNDED,
    PPL_BLOCK,
    TOKEN_BLOCK,
    Metric,
    MetricValue,
    lookup,
    plus_minus,
)
from qeval.compare.metrics import GROUP_FIELDS, PER_TOKEN_FIELDS
from qeval.compare.summary import ComparisonSummary, Side, TokenGroup, kv_text
from qeval.engine.machine import build_backend
from qeval.identity import NOT_RECORDED, form
from qeval.present.markdown import markdown_table
from qeval.storage import error_record
from qeval.storage.llamacpp import record_values
from qeval.storage.store import StoreHeader


def _relative_size(ratio: float) -> str:
    """llama.cpp's bytes over this store's, in words: which of the two is larger, and by how much."""
    if ratio >= 1 or not math.isfinite(ratio):
        return f"{ratio:.1f}x larger"
    return f"{1 / ratio:.1f}x smaller: this store is the larger (its fixed records, the code table and any embedded " \
           "output head, outweigh its scored tokens)"


def _pm(value: float, se: float) -> str:
    """A number ± its SE as llama-perplexity's blocks print it."""
    return plus_minus(value, se, "10.6f")


def _percent_pm(fraction: float, se: float, width: int) -> str:
    """A fraction ± its SE in percent, as llama-perplexity's `Same top p` line prints it (the SE one narrower)."""
    return plus_minus(100 * fraction, 100 * se, f"{width}.3f", f"{width - 1}.3f")


def ran_where(ref_header: StoreHeader, cand_header: StoreHeader) -> dict:
    """Where each side's logits were computed (a reference published from another machine is compared across
    machines): llama.cpp's build and the backend it computed on beyond the CPU, the CPU, layers offloaded."""
    return {"reference": _ran_on(ref_header), "candidate": _ran_on(cand_header)}


def _ran_on(h: StoreHeader) -> dict:
    return ran_on(h.capture.get("numerics"), h.capture.get("cpu"))


def ran_on(numerics: dict | str | None, cpu: str | None = None) -> dict:
    """Where logits recorded with these numerics (qeval.identity.producer's) were computed: build, backend, layers
    offloaded, and the CPU when known."""
    if not isinstance(numerics, dict):
        return {"backend": NOT_RECORDED}
    build = numerics.get("build") or {}
    return {"backend": build_backend(build.get("system_info") or ""), "llama_cpp_python": build.get("llama_cpp_python"),
            "system_info": build.get("system_info"), "cpu": cpu, "gpu_layers": numerics.get("gpu_layers")}


def ran_where_text(where: dict) -> str:
    def side(d: dict) -> str:
        if d["backend"] == NOT_RECORDED:
            return f"build {NOT_RECORDED}"
        return (f"{d['backend']} (llama-cpp-python {d['llama_cpp_python']}, {d['gpu_layers']} layers offloaded, "
                f"CPU {d['cpu'] or 'unknown'})")
    ref, cand = where["reference"], where["candidate"]
    same = "the same build" if ref.get("system_info") == cand.get("system_info") else "another build"
    floor = [f"             {line}" for line in floor_lines(where["floor"])] if "floor" in where else []
    return "\n".join([f"ran where  : reference {side(ref)}", f"             candidate {side(cand)}; {same}", *floor])


def floor_lines(floor: dict) -> list[str]:
    """The numerics-floor rows published with a reference for the candidate's backend
    (qeval.orchestrate.publish.published_floor), a line each, or that none applies and why."""
    if not floor["rows"]:
        why = f"publishes one for {', '.join(floor['published'])} only" if floor["published"] else \
            "was published without one"
        return [f"no numerics-floor row was published for backend {floor['backend']}: the reference {why}"]
    return [f"numerics floor on {f['backend']} ({f['kind']}): KLD {plus_minus(f['kld_mean'], f['kld_se'], '.6f')}, "
            f"same top-1 {plus_minus(_percent(f['same_top1']), _percent(f['same_top1_se']), '.2f')} % "
            f"({f['chunks']} chunks; {f['path']})" for f in floor["rows"]]


def _percent(fraction: float | None) -> float | None:
    return None if fraction is None else 100 * fraction


def comparison_text(summary: ComparisonSummary) -> str:
    """llama-perplexity's three blocks, line for line, each followed by the lines of the metrics that
    qeval.compare.metric_registry places in it."""
    ref, cand, blocks = summary.reference, summary.candidate, summary.figures.blocks
    p, k, dp = blocks["perplexity"], blocks["kld"], blocks["delta_p"]
    top1 = blocks["same_top1"]
    lines = [
        f"reference : {_who(ref)}",
        f"candidate : {_who(cand)}",
        f"chunks    : {summary.chunks} of n_ctx {ref.n_ctx}, {summary.scored_tokens} scored tokens",
        *_block(PPL_BLOCK, summary, [
            f"Mean PPL(Q)                   : {_pm(p['ppl_cand'], p['ppl_cand_se'])}",
            f"Mean PPL(base)                : {_pm(p['ppl_ref'], p['ppl_ref_se'])}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * p['cor_ln_ppl']:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {_pm(p['ln_ratio'], p['ln_ratio_se'])}",
            f"Mean PPL(Q)/PPL(base)         : {_pm(p['ratio'], p['ratio_se'])}",
            f"Mean PPL(Q)-PPL(base)         : {_pm(p['diff'], p['diff_se'])}"]),
        *_block(KLD_BLOCK, summary, [
            f"Mean    KLD: {_pm(k['mean'], k['se'])}",
            *(f"{name:<7} KLD: {v:10.6f}" for name, v in k["ladder"].items())]),
        *_block(TOKEN_BLOCK, summary, [
            f"Mean    Δp: {_percent_pm(dp['mean'], dp['se'], 6)} %",
            *(f"{name:<7} Δp: {100 * v:6.3f}%" for name, v in dp["ladder"].items()),
            f"RMS Δp    : {_percent_pm(dp['rms'], dp['rms_se'], 6)} %",
            f"Same top p: {_percent_pm(top1['fraction'], top1['se'], 6)} %"]),
        *bound_lines(summary),
        *group_lines(summary),
        *sampler_lines(summary.samplers),
    ]
    return "\n".join(lines)


BOUND_HEADING = "Error bound of the stored form (certified: docs/error-bound.md)"


def bound_lines(summary: ComparisonSummary) -> list[str]:
    """The certified bound of every figure (the figure on the exact logits lies within it): a line per bounded
    figure, then those that are exact and those no record bounds; or why the comparison has none."""
    held = summary.metrics or {}
    measured = [(lookup(key), v) for key, v in held.items() if lookup(key) is not None]
    if not measured:
        return []
    bounds = {m.key: v.bound for m, v in measured}
    if all(b is None or b == NOT_RECORDED for b in bounds.values()):
        return ["", f"====== {BOUND_HEADING} ======", not_recorded_text(summary)]
    lines = ["", f"====== {BOUND_HEADING} ======"]
    lines += [f"{m.title:<22}: {m.number(v.value)}{m.percent}, within {m.number(v.bound)}{m.percent}"
              for m, v in measured if v.bound_value]
    exact = [m.title for m, v in measured if v.bound == 0 and not m.restates]
    if exact:
        lines.append(f"{'exact':<22}: " + ", ".join(exact))
    free = [m.title for m, v in measured if v.bound == NOT_BOUNDED]
    if free:
        lines.append(f"{'not bounded':<22}: " + ", ".join(free) + " (a sampler's truncation set may change)")
    return lines


def not_recorded_text(summary: ComparisonSummary) -> str:
    """Why a comparison has no bound: which store records no error, and what gives one."""
    sides = [(role, side) for role, side in (("reference", summary.reference), ("candidate", summary.candidate))
             if not side.records_error]
    which = " and ".join(f"the {role} store {side.label or side.path}" for role, side in sides) or "a store"
    return (f"not recorded: {which} records no error of its stored form (made before qeval measured it at capture, "
            "or imported from llama.cpp). Capture it again with this qeval (qeval capture ... --force) to get "
            "certified bounds on every figure.")


def sampler_lines(samplers: dict) -> list[str]:
    """A short block per sampler (qeval.compare.sampler): the two distributions after its truncation and
    temperature, compared token by token."""
    rows = []
    for name, b in samplers.items():
        tvd, ladder = b["tvd"], b["tvd"]["ladder"]
        rows += ["", f"====== Sampler {name}: {sampler.parse(name).describe()} ======",
                 f"Mean    TVD     : {_percent_pm(tvd['mean'], tvd['se'], 7)} %   (mass that moves; "
                 f"median {100 * ladder['Median']:.3f}, 99% {100 * ladder['99.0%']:.3f}, "
                 f"max {100 * ladder['Maximum']:.3f} %)",
                 f"Agreement       : {_percent_pm(b['agreement']['mean'], b['agreement']['se'], 7)} %   "
                 "(coupled draws pick the same token: speculative-decoding acceptance)",
                 f"Support differs : {_percent_pm(b['support_differs']['fraction'], b['support_differs']['se'], 7)} "
                 f"%   (mean size: reference "
                 f"{b['support']['ref_mean']:.2f}, candidate {b['support']['cand_mean']:.2f} tokens)"]
        if "greedy_agreement" in b:
            g = b["greedy_agreement"]
            rows.append(f"Greedy agreement: {_percent_pm(g['fraction'], g['se'], 7)} %   (same argmax)")
    return rows


# The blocks of token groups (qeval.compare.depth): summary attribute, heading, column title, how a group is named.
GROUP_BLOCKS = (("by_depth", "By depth (logit position; SE cluster-robust over 256-position blocks)", "depth",
                 lambda g: f"{g.lo:>7}-{g.hi:<7}"),
                ("by_confidence", "By the reference's confidence (its top-1 probability; SE cluster-robust over "
                 "256-position blocks)", "ref top-1 p", lambda g: f"{g.name:>15}"),
                ("by_segment", "By segment (the assistant's tokens; SE cluster-robust)", "segment",
                 lambda g: f"{g.name:>15}"),
                ("by_category", "By category (conversations; SE cluster-robust)", "category", lambda g: f"{g.name:>15}"))
CONFIDENCE_NOT_RECORDED = ("not recorded: a result saved before qeval kept the reference's top-1 probability per "
                           "token; name it by its label (qeval kld --ref REF --cand LABEL) or as a result file "
                           "to qeval check or compare with the reference store at hand, and they are read from it")


def group_lines(summary: ComparisonSummary) -> list[str]:
    """The by-depth block, by the reference's confidence, then by segment and by category for conversations: one row
    per group, one layout. A summary with by-depth figures but none by confidence says that they are not recorded."""
    rows = []
    for attribute, heading, title, name in GROUP_BLOCKS:
        groups = getattr(summary, attribute) or []
        if attribute == "by_confidence" and summary.by_depth and summary.by_confidence is None:
            rows += ["", f"====== {heading} ======", CONFIDENCE_NOT_RECORDED]
        if not groups:
            continue
        rows += ["", f"====== {heading} ======",
                 f"{title:>15} {'n':>7}  {'mean KLD':>21}  {'99% KLD':>9} {'99.9% KLD':>9}  {'same top %':>16}  "
                 f"{'PPL(base)':>10} {'PPL(Q)':>10}  {'mean Δp %':>15}  {'KLD share %':>11}"]
        rows += [group_row(name(g), g) for g in groups]
    return rows


def group_row(name: str, group: TokenGroup) -> str:
    blocks = group.figures.blocks
    k, top1, p, dp = blocks["kld"], blocks["same_top1"], blocks["perplexity"], blocks["delta_p"]
    share = "?" if group.kld_share is None else f"{100 * group.kld_share:.2f}"
    return (f"{name} {group.n:>7}  {plus_minus(k['mean'], k['se'], '9.6f')}  "
            f"{k['ladder']['99.0%']:9.6f} {k['ladder']['99.9%']:9.6f}  "
            f"{_percent_pm(top1['fraction'], top1['se'], 7)}  "
            f"{p['ppl_ref']:10.4f} {p['ppl_cand']:10.4f}  {_percent_pm(dp['mean'], dp['se'], 6)}  {share:>11}")


def _block(name: str, summary: ComparisonSummary, llama_lines: list[str]) -> list[str]:
    """A block: its heading, llama-perplexity's lines, then a line per registry metric placed in it (one the
    result holds: a result saved before a metric existed lacks it)."""
    held = summary.metrics or {}
    extra = [_metric_line(m, held[m.key]) for m in METRICS.values()
             if m.report and m.report[0] == name and m.key in held]
    return ["", f"====== {name} statistics ======", *llama_lines, *extra]


def _metric_line(m: Metric, measured: MetricValue) -> str:
    """A metric's line in llama-perplexity's style: percentages as `Same top p`, anything else as `Mean KLD`."""
    label, value, se = m.report[1], measured.value, measured.se
    if m.unit == "%":
        return f"{label}: " + (f"{value:6.3f}" if se is None else plus_minus(value, se, "6.3f", "5.3f")) + " %"
    return f"{label}: " + (_pm(value, se) if se is not None else f"{value:10.6f}")


def _who(side: Side) -> str:
    bits = [side.label or "?"]
    if side.facts.get("file_name"):
        bits.append(side.facts["file_name"])
    if side.kv:
        bits.append(f"KV {side.kv_text()}")
    bits.append(f"({side.path})")
    return "  ".join(bits)


def ppl_text(label: str, path: str, ppl: dict, chunks: int, n_tokens: int) -> str:
    return (f"{label} ({path}): {chunks} chunks, {n_tokens} scored tokens\n"
            f"Final estimate: PPL = {ppl['ppl']:.4f} +/- {ppl['ppl_se']:.5f}")


def info(source) -> dict:
    """What `qeval info` shows of a store: its header, state, size, stored form and the error it recorded."""
    h: StoreHeader = source.header
    n_chunks = len(source.chunk_indices)
    scored = sum(h.n_scored_of(c) for c in source.chunk_indices)
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
        "form": form(h),
        "error": error_record.recorded(source),
        **hidden_form_facts(source, size, scored),
    }


def hidden_form_facts(source, size: int, scored: int) -> dict:
    """A store that may hold the hidden form: its pieces by form, its head, and its bytes per scored token without
    the head (the head is stored once, whatever the number of tokens)."""
    h = source.header
    if not h.hidden:
        return {}
    forms = Counter(f for _, _, f in source.piece_forms()) if hasattr(source, "piece_forms") else Counter()
    lean = source.lean_pieces() if hasattr(source, "lean_pieces") else 0
    return {"pieces_by_form": dict(sorted(forms.items())), "lean_pieces": lean, "head": h.head,
            "replay": error_record.replayed(source),
            "bytes_per_scored_token_without_head": (size - h.head["bytes"]) / scored if scored else math.nan}


def _scored_text(h: dict) -> str:
    """Which tokens a store scores, from its header's JSON."""
    if "n_scored" in h:
        return (f"{h['n_scored']} scored tokens per chunk (--score {h.get('scoring', 'half')}: positions "
                f"{h['first_scored']}..{h['n_ctx'] - 2})")
    windows = h["windows"]
    return (f"--score {h['scoring']}: the assistant's tokens of {len(windows['chunks'])} conversation windows "
            f"(segments {', '.join(windows['segments'])}; categories {', '.join(windows['categories'])})")


def info_text(d: dict) -> str:
    h = d["header"]
    state = "complete" if d["complete"] else "INCOMPLETE (still being written or interrupted)"
    model = h.get("model") or {}
    lines = [
        f"store      : {d['path']}",
        f"label      : {h['label']}   source: {h['source']}   qeval {h['qeval_version']}, format v{h['format_version']}",
        f"state      : {state}: {d['chunks_present']} of {d['chunks_expected']} chunks "
        f"(chunk range {h['chunk_start']}:{h['chunk_stop']} of {h['n_chunks']})",
        f"layout     : n_vocab {h['n_vocab']}, n_ctx {h['n_ctx']}, {_scored_text(h)}, top-{h['top_k']} ids kept",
        f"form       : {json.dumps(d['form'], sort_keys=True)}",
    ]
    if model:
        lines.append("model      : " + ", ".join(f"{k} {v}" for k, v in model.items() if not isinstance(v, dict)))
    if h.get("kv"):
        lines.append("kv cache   : " + ", ".join(f"{k} {v}" for k, v in h["kv"].items() if k != "rotation")
                     + f" ({kv_text(h['kv']).strip()})")
    numerics = (h.get("capture") or {}).get("numerics")
    lines.append("numerics   : " + (NOT_RECORDED + " (made before qeval recorded them)" if not isinstance(numerics, dict)
                                    else f"llama-cpp-python {numerics['build'].get('llama_cpp_python')}, "
                                         f"{numerics['build'].get('system_info')}; layers offloaded "
                                         f"{numerics.get('gpu_layers')}; environment "
                                         + (", ".join(f"{k}={v}" for k, v in numerics["env"].items()) or "none set")))
    if h.get("corpus"):
        lines.append("corpus     : " + ", ".join(f"{k} {v}" for k, v in h["corpus"].items()))
    lines += [
        f"tokens     : sha256 {h['tokens_sha256'][:16]}…, tokenizer {h['tokenizer_sha256'][:16] or '-'}",
        f"size       : {d['size_bytes']:,} bytes, {d['bytes_per_scored_token']:,.0f} bytes per scored token "
        f"({d['scored_tokens']:,} tokens)",
        f"vs llama.cpp: {d['llamacpp_equivalent_bytes']:,} bytes in --kl-divergence-base layout, "
        + _relative_size(d['ratio_vs_llamacpp']),
        f"error      : {error_text(d['error'])}",
    ]
    if "head" in d:
        head = d["head"]
        lines += ["pieces     : " + ", ".join(f"{n} {f}" for f, n in d["pieces_by_form"].items())
                  + f" (asked for: {head['form']}; the hidden form is replayed through the head below)",
                  f"head       : {head['tensor']} {head['type']} [{head['n_vocab']} x {head['n_embd']}], activations "
                  f"{head['activation']}, soft-cap {head['softcap'] or 'none'}, {head['bytes']:,} bytes embedded once, "
                  f"sha256 {head['fingerprint'][:16]}…; {d['bytes_per_scored_token_without_head']:,.0f} bytes per "
                  "scored token without it",
                  f"replay     : {replay_text(d['replay'])}"]
        if d["lean_pieces"]:
            lines.append(f"lean       : {d['lean_pieces']} hidden pieces replayed by llama.cpp's own kernel only: read "
                         "where it gives the capture's rows again (this CPU kind and build); `qeval certify` makes "
                         "them readable anywhere (publish does it)")
    return "\n".join(lines)


def error_text(e: dict) -> str:
    """The error a store recorded at capture (docs/error-bound.md), or why it has none."""
    if not e["recorded"]:
        return (f"{NOT_RECORDED}: the store records no error of its stored form (made before qeval measured it at "
                "capture, or imported from llama.cpp): comparisons against it show no certified bound. Capture it "
                "again with this qeval (qeval capture ... --force) to get one.")
    if not e["tokens"]:
        return "recorded (no complete chunk yet)"
    return (f"measured at capture against the exact logits, per scored token: KL(exact ‖ stored) mean "
            f"{e['kl_mean']:.2e}, max {e['kl_max']:.2e} nats; |Δ log p| ≤ {e['max_abs_dlogp_top_band']:.2e} within "
            f"{e['bands']['band_width']:g} nat of the top, ≤ {e['max_abs_dlogp']:.3g} over the whole vocabulary (the "
            "deepest entries, of negligible mass); each comparison turns it into a certified bound on its figures")


def replay_text(replays: dict) -> str:
    """What the hidden pieces recorded of their rows read uncoded, per replay engine (format 6), or why nothing."""
    if not replays:
        return ("read coded only (format 5, made before qeval recorded the replays' own error): capture it again "
                "to read it uncoded against a live candidate")
    return ("read uncoded against a live candidate by the first engine whose rows hash as the capture's here; "
            "measured at capture against the exact logits, per scored token: " + "; ".join(
                f"{engine} ({e['tokens']:,} tokens): KL(exact ‖ replayed) mean {e['kl_mean']:.2e}, max "
                f"{e['kl_max']:.2e} nats, |Δ log p| ≤ {e['max_abs_dlogp']:.2e}" for engine, e in replays.items()))


def write_per_token(t: dict[str, np.ndarray], label_names: dict | None, path: Path) -> None:
    """One row per scored token (per-token columns `t`; label_names: a conversation comparison's, which its
    segment and category codes index): .npz keeps full precision, anything else is written as CSV."""
    if path.suffix == ".npz":
        np.savez_compressed(path, **t)
        return
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        fields = (*PER_TOKEN_FIELDS, *filter(t.__contains__, GROUP_FIELDS), *filter(sampler.is_column, t))  # if any
        w.writerow(fields)
        cols = [group_names(label_names, k, t[k]) if k in GROUP_FIELDS else t[k] for k in fields]
        for row in zip(*cols):
            w.writerow([v if isinstance(v, str) else int(v) if isinstance(v, (np.integer, np.bool_)) else f"{float(v):.9g}"
                        for v in row])


def group_names(label_names: dict, column: str, codes: np.ndarray) -> list[str]:
    """A segment or category column as names (the .npz keeps the codes, and the names in the result's labels)."""
    names = label_names["segments" if column == "segment" else "categories"]
    return [names[int(c)] for c in codes]


def ppl_matrix_markdown(pairs: list[tuple[str, str, str]], summaries: list[ComparisonSummary]) -> str:
    """Rows = model file, columns = KV type; cells = PPL ± SE (the reference's PPL for its own f16 cell)."""
    kvs = list(dict.fromkeys(["f16"] + [kv for _, _, kv in pairs]))
    models = list(dict.fromkeys(path for _, path, _ in pairs))
    cell = {}
    for (label, path, kv), s in zip(pairs, summaries):
        p = s.perplexity
        cell[(path, kv)] = plus_minus(p["ppl_cand"], p["ppl_cand_se"], ".4f")
        ref_model = s.reference.facts.get("file_name")
        cell.setdefault(("ref", "f16"), (ref_model, f"{plus_minus(p['ppl_ref'], p['ppl_ref_se'], '.4f')} (ref)"))
    ref_name, ref_cell = cell.get(("ref", "f16"), (None, ""))
    if not any(kv == "f16" for _, _, kv in pairs) and ref_name not in {Path(p).name for p in models}:
        kvs.remove("f16")

    def row(path: str) -> list[str]:
        name = Path(path).name
        return [name, *(cell.get((path, kv), ref_cell if name == ref_name and kv == "f16" else "") for kv in kvs)]

    return markdown_table(["model", *(f"KV {kv}" for kv in kvs)], map(row, models))


def certify_text(certified: dict) -> str:
    """The line `qeval certify` prints (qeval.orchestrate.certify)."""
    if not certified["lean_pieces"]:
        return f"{certified['path']} holds no lean piece: every machine reads it as it is"
    coded = (f"; {certified['coded']} coded as logits (their portable replay missed auto's bound)"
             if certified["coded"] else "")
    return (f"certified {certified['path']}: {certified['lean_pieces']} lean pieces now read on any machine"
            f"{coded}, {certified['size_bytes']:,} bytes")


def merge_text(merged: dict) -> str:
    """The line `qeval merge` prints: the store written and its parts (qeval.orchestrate.merge)."""
    parts = ", ".join(f"{Path(p['path']).name} {p['chunk_range'][0]}:{p['chunk_range'][1]}" for p in merged["parts"])
    return (f"wrote {merged['path']}: {merged['chunks']} chunks from {len(merged['parts'])} parts ({parts}), "
            f"{merged['size_bytes']:,} bytes")
