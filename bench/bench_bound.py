"""The stored reference's certified error bound on the demo's rows, in each form, against the truth
(docs/error-bound.md)

    PYTHONPATH=. nice python bench/bench_bound.py [--chunks 3] [--repeats 3] [--work DIR]
        [--out bench/results/bound-<cpu>.json]

Gemma-3-270M (the demo's quants, ~/.cache/qeval/models), n_ctx 512, the shipped corpus, --chunks windows:
1. The Q8_0 reference is decoded once, as a capture decodes it, with its head inputs (Engine.output_hidden); its
   float32 logits are kept (a memory-mapped .npy under --work) and made into two stores by qeval's capture code,
   both from these same rows: the logits form (format 4, with the per-token error record) and the hidden form
   (format 6, as `qeval capture --reference-form hidden` writes it: the head embedded, each piece the head's input,
   its two error records measured against these logits: of the coded replayed rows, and of the replayed rows
   themselves, which a live comparison reads uncoded). The truth below is then the truth of both stores.
2. Each row of the demo's board is decoded live: the control (the reference under the matrix's control batch
   layout), KV q8_0 and q4_0 (flash attention on), Q4_K_M, Q4_0, Q3_K_M, Q2_K. Its float32 rows go through
   qeval's comparison of a stored reference against a live candidate (metrics.compare, the kernel `qeval kld`
   runs), against each store, and the same figures are computed in float64 from the two exact rows.
3. Per row and form (rows[i]["logits"], rows[i]["hidden"]: read uncoded with llama.cpp's own kernel where its rows
   hash as the capture's, rows[i]["hidden_portable"]: with qeval's portable replay, as on a CPU whose ggml sums
   otherwise; results["replay_engines"] says which engine each read used): mean KLD as qeval reports it, its certified bound, the
   true difference from the mean KLD of the exact logits, the mean per-token |error|; how often the per-token bound
   holds (it must: 100 %), and how loose it is (median and p99 of bound / |error| over tokens with an error above
   1e-12), both directions.
4. Timings, side by side in this run (best of --repeats; the load is printed): coding rows without and with the
   error record (one thread; with it the scalars are exact float64 too); comparing the stored reference with the
   Q4_0 candidate's live rows and with its store, each without the bound (stores without a record) and with it
   (2 threads, metrics.compare as `qeval kld` runs it, the forward pass excluded; logits form); and the forward
   pass per scored row, for scale.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import time
from pathlib import Path

import numpy as np
from common import best

from qeval.capture.capture import HIDDEN, LOGITS, PieceBuilder, StoredForm, scored_targets, store_header, stored_form
from qeval.compare import metrics
from qeval.engine.engine import Engine, EngineSettings
from qeval.inputs.corpus import load_corpus, make_windows, tokenize_documents
from qeval.orchestrate import demo
from qeval.orchestrate.matrix import control_settings
from qeval.storage.codec import SqrtLogCode
from qeval.storage.store import StoreReader, StoreWriter, zstd_compressor

N_CTX = 512
PORTABLE = "hidden_portable"  # the hidden store read with qeval's portable replay (ggml taken as not matching)
BLOCK = 16  # rows coded per call, as the capture codes them
KV_FA = {"type_k": "q8_0", "type_v": "q8_0", "flash_attn": "on"}
ROWS = [("control", "Q8_0", None), ("Q8_0+kv-q8_0", "Q8_0", KV_FA),
        ("Q8_0+kv-q4_0", "Q8_0", {**KV_FA, "type_k": "q4_0", "type_v": "q4_0"}),
        *((q, q, {}) for q in demo.DEMO_WEIGHT_QUANTS)]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def decode_rows(engine: Engine, windows: np.ndarray, out: np.ndarray | None = None,
                hidden: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """float32 [windows, scored, V]: the engine's scored rows of every window, decoded as a capture decodes them
    (their head inputs into `hidden` [windows, scored, n_embd] too, given an engine that outputs them); and seconds
    of decoding."""
    n_scored = len(engine.scoring.positions(N_CTX))
    rows = out if out is not None else np.empty((len(windows), n_scored, engine.n_vocab), dtype=np.float32)
    t0 = time.perf_counter()
    for call in engine.iter_calls(windows):
        for block in call:
            rows[block.window, block.first_row:block.first_row + len(block.logits)] = block.logits
            if hidden is not None:
                hidden[block.window, block.first_row:block.first_row + len(block.logits)] = block.hidden
    return rows, time.perf_counter() - t0


def write_reference(engine: Engine, windows: np.ndarray, logits: np.ndarray, path: Path, label: str,
                    code: SqrtLogCode, form: StoredForm = StoredForm(), hidden: np.ndarray | None = None) -> None:
    """A store of these rows in `form`, as a capture codes and writes them (with `code`'s error record or without;
    the hidden form from the rows' head inputs, `hidden`)."""
    header = store_header(engine, label, windows, (0, len(windows)), {"name": "shipped"}, code,
                          head=form.header_entry(), **form.facts())
    path.unlink(missing_ok=True)
    positions = engine.scoring.positions(N_CTX)
    with StoreWriter.open(path, header, windows, code.lut(), head=form.head) as writer:
        for c in range(len(windows)):
            builder = PieceBuilder(c, zstd_compressor(1), 0)
            for s in range(0, len(positions), BLOCK):
                builder.add(form.encode(logits[c, s:s + BLOCK], None if hidden is None else hidden[c, s:s + BLOCK],
                                        scored_targets(windows[c], positions[s:s + BLOCK]), code, s))
            writer.write_chunk(builder.finish())
        writer.finish()


class LiveRows:
    """A candidate's float32 rows read as a live candidate (qeval.capture.capture.LiveSource with coding off)."""

    live = complete = True
    coded = False

    def __init__(self, ref: StoreReader, rows: np.ndarray):
        self.header, self.tokens, self.lut, self.path = ref.header, ref.tokens, ref.lut, "(live rows)"
        self.chunk_indices, self.rows = ref.chunk_indices, rows

    def read_chunk(self, index: int):
        rows = self.rows[index]

        class Chunk:
            n_tokens = len(rows)

            @staticmethod
            def iter_logits():
                for s in range(0, len(rows), 64):  # in decode calls of 64 rows
                    yield s, rows[s:s + 64], True
        Chunk.index = index
        return Chunk()


def true_klds(ref: np.ndarray, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KL(p || q) and KL(q || p) per row of the exact rows: float64 log-softmax of the float32 logits."""
    out = np.empty((2, len(ref)))
    for s in range(0, len(ref), 16):
        lp, lq = (x[s:s + 16].astype(np.float64) for x in (ref, cand))
        lp -= lp.max(axis=1, keepdims=True)
        lq -= lq.max(axis=1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(axis=1, keepdims=True))
        lq -= np.log(np.exp(lq).sum(axis=1, keepdims=True))
        p, q = np.exp(lp), np.exp(lq)
        out[0, s:s + 16] = (p * (lp - lq)).sum(axis=1)
        out[1, s:s + 16] = (q * (lq - lp)).sum(axis=1)
    return out[0], out[1]


def looseness(bound: np.ndarray, err: np.ndarray) -> dict:
    """How the per-token bound compares with the per-token true |error|."""
    seen = err > 1e-12  # an error at float64 rounding says nothing of the bound's looseness
    ratio = bound[seen] / err[seen]
    return {"holds_pct": 100.0 * float(np.mean(err <= bound)), "tokens": int(len(err)),
            "mean_bound": float(bound.mean()), "mean_abs_error": float(err.mean()),
            "median_ratio": float(np.median(ratio)) if seen.any() else math.nan,
            "p99_ratio": float(np.percentile(ratio, 99)) if seen.any() else math.nan}


def measure_row(ref: StoreReader, ref_rows: np.ndarray, cand_rows: np.ndarray) -> dict:
    """A candidate's figures against one stored reference, beside the truth of the exact rows it was made from."""
    cmp = metrics.compare(ref, LiveRows(ref, cand_rows), threads=1)
    t = cmp.per_token
    forward, reverse = (np.concatenate(x) for x in zip(*(true_klds(ref_rows[c], cand_rows[c]) for c in cmp.chunks)))
    err_f, err_r = np.abs(t["kld"] - forward), np.abs(t["kld_reverse"] - reverse)
    return {"kld_mean": float(t["kld"].mean()), "kld_mean_bound": float(t["kld_bound"].mean()),
            "kld_mean_exact": float(forward.mean()),
            "kld_mean_true_difference": float(abs(t["kld"].mean() - forward.mean())),
            "forward": looseness(t["kld_bound"], err_f), "reverse": looseness(t["kld_reverse_bound"], err_r),
            "nll_cand_max_abs_error": float(np.max(np.abs(t["nll_cand"] - nll_exact(cand_rows, ref.tokens, ref))))}


def nll_exact(rows: np.ndarray, tokens: np.ndarray, ref: StoreReader) -> np.ndarray:
    """−log p(correct token) of the exact rows, in float64."""
    out = []
    positions = ref.header.positions
    for c in range(len(rows)):
        x = rows[c].astype(np.float64)
        m = x.max(axis=1, keepdims=True)
        lz = np.log(np.exp(x - m).sum(axis=1)) + m[:, 0]
        out.append(lz - x[np.arange(len(x)), tokens[c, positions + 1]])
    return np.concatenate(out)


def timings(engine_store: dict[str, Path], cand_rows: np.ndarray, repeats: int) -> dict:
    """Side by side, best of `repeats`, ms per scored row: coding the reference's rows without / with the error
    record (one thread); comparing the stored reference with the candidate's live float32 rows, and with the
    candidate's store (`qeval kld` store against store), both without the bound (stores without a record) and with
    it (2 threads, as `qeval kld` runs)."""
    out = {}
    with StoreReader(engine_store["with"]) as ref:
        rows = cand_rows[0, :32]
        targets = ref.tokens[0, ref.header.positions[:32] + 1].astype(np.int64)
    for name, code in (("code_without_record", SqrtLogCode(error=None)), ("code_with_record", SqrtLogCode())):
        code.encode_block(rows[:BLOCK], targets[:BLOCK])  # compiled and warm
        out[name] = best(lambda c=code: [c.encode_block(rows[s:s + BLOCK], targets[s:s + BLOCK])
                                         for s in range(0, len(rows), BLOCK)], repeats) / len(rows) * 1e3
    n = cand_rows.shape[0] * cand_rows.shape[1]
    for kind in ("without", "with"):
        with StoreReader(engine_store[kind]) as ref, StoreReader(engine_store[f"cand_{kind}"]) as cand:
            live = LiveRows(ref, cand_rows)
            metrics.compare(ref, live, threads=2)  # compiled and warm
            out[f"compare_live_{kind}_bound"] = best(lambda: metrics.compare(ref, live, threads=2), repeats) / n * 1e3
            out[f"compare_stored_{kind}_bound"] = best(lambda: metrics.compare(ref, cand, threads=2), repeats) / n * 1e3
    return {f"{k}_ms_per_row": v for k, v in out.items()}


def print_row(name: str, figures: dict) -> None:
    f, r = figures["forward"], figures["reverse"]
    print(f"{name:<23} mean KLD {figures['kld_mean']:.6f}  bound {figures['kld_mean_bound']:.2e}  true difference "
          f"{figures['kld_mean_true_difference']:.2e} (mean |error| {f['mean_abs_error']:.2e}); holds "
          f"{f['holds_pct']:.0f} % / {r['holds_pct']:.0f} % of {f['tokens']} tokens; bound/error median "
          f"{f['median_ratio']:.1f} p99 {f['p99_ratio']:.0f} (reverse {r['median_ratio']:.1f}, "
          f"{r['p99_ratio']:.0f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/qeval-bench-bound"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    models = demo.prepare_models(demo.models_dir())
    settings = EngineSettings()
    print(f"{cpu_name()}; {load()}")
    with Engine(models["Q8_0"], N_CTX, settings) as engine:
        corpus = load_corpus(None)
        windows = make_windows(tokenize_documents(corpus, engine.tokenize, False), N_CTX, args.chunks, "corpus")
        n_scored = len(engine.scoring.positions(N_CTX))
        ref_rows = np.lib.format.open_memmap(args.work / "Q8_0.npy", "w+", np.float32,
                                             (len(windows), n_scored, engine.n_vocab))
        hidden = np.empty((len(windows), n_scored, engine.n_embd), dtype=np.float32)
        engine.output_hidden()  # as a capture in the hidden form decodes: both stores are made of these rows
        _, forward_s = decode_rows(engine, windows, ref_rows, hidden)
        stores = {"with": args.work / "Q8_0.qeval", "without": args.work / "Q8_0-norecord.qeval",
                  HIDDEN: args.work / "Q8_0-hidden.qeval"}
        write_reference(engine, windows, ref_rows, stores["with"], "Q8_0", SqrtLogCode())
        write_reference(engine, windows, ref_rows, stores["without"], "Q8_0", SqrtLogCode(error=None))
        write_reference(engine, windows, ref_rows, stores[HIDDEN], "Q8_0", SqrtLogCode(),
                        stored_form(HIDDEN, models["Q8_0"], settings), hidden)
    results = {"cpu": cpu_name(), "chunks": args.chunks, "scored_tokens": int(len(windows) * n_scored),
               "load_before": load(), "forward_ms_per_scored_row": forward_s / (len(windows) * n_scored) * 1e3,
               "rows": []}
    with (StoreReader(stores["with"]) as logits_ref, StoreReader(stores[HIDDEN]) as hidden_ref,
          StoreReader(stores[HIDDEN]) as portable_ref):
        portable_ref.replay_matched("ggml", False)  # as on a CPU whose ggml sums otherwise than the capturing one
        refs = {LOGITS: logits_ref, HIDDEN: hidden_ref, PORTABLE: portable_ref}
        for label, quant, kv in ROWS:
            cand_settings = control_settings(settings, N_CTX) if kv is None else EngineSettings(**kv)
            with Engine(models[quant], N_CTX, cand_settings) as engine:
                cand_rows, _ = decode_rows(engine, windows)
                if label == "Q4_0":  # its stores too, for the timings of store against store
                    stores.update(cand_with=args.work / "Q4_0.qeval", cand_without=args.work / "Q4_0-norecord.qeval")
                    write_reference(engine, windows, cand_rows, stores["cand_with"], "Q4_0", SqrtLogCode())
                    write_reference(engine, windows, cand_rows, stores["cand_without"], "Q4_0", SqrtLogCode(error=None))
            row = {"label": label, **{form: measure_row(ref, ref_rows, cand_rows) for form, ref in refs.items()}}
            results["rows"].append(row)
            for form in refs:
                print_row(f"{label} ({form})", row[form])
            if label == "Q4_0":
                results["timings"] = timings(stores, cand_rows, args.repeats)
            del cand_rows
        results["replay_engines"] = {HIDDEN: hidden_ref.replay_matches, PORTABLE: portable_ref.replay_matches}
    results["load_after"] = load()
    t = results["timings"]
    print(f"coding a row (1 thread): {t['code_without_record_ms_per_row']:.2f} ms without the record, "
          f"{t['code_with_record_ms_per_row']:.2f} ms with it (forward pass {results['forward_ms_per_scored_row']:.1f} "
          f"ms per scored row)")
    print(f"comparing, per row (2 threads): live rows {t['compare_live_without_bound_ms_per_row']:.2f} ms without the "
          f"bound, {t['compare_live_with_bound_ms_per_row']:.2f} ms with it; store against store "
          f"{t['compare_stored_without_bound_ms_per_row']:.2f} / {t['compare_stored_with_bound_ms_per_row']:.2f} ms")
    print(results["load_after"])
    slug = "-".join(re.findall(r"[a-z0-9]+", re.sub(r"\((R|TM)\)", "", cpu_name(), flags=re.I).lower())[:3])
    out = args.out or Path("bench/results") / f"bound-{slug}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
