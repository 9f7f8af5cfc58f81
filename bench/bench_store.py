"""Store and kernel numbers on real Gemma-3-270M logits (issue: the qeval spine).

    python bench/bench_store.py [--chunks 4] [--out bench/results/store.json]

Measures, against exact float64 math on the same float32 logits:
  * noise floor: mean KLD(exact P || decoded P_hat) of the stored code,
  * store-vs-store mean KLD and ladder vs exact float64 KLD, for Q8_0 vs Q4_0 / Q3_K_M / Q2_K,
  * bytes per scored token, and the size/noise-floor frontier over the code's knee,
  * encode throughput (normalise + code + compress), scored tokens/s, 1 and 2 threads.
Throughput and memory of `qeval kld` are measured by bench/bench_kld.py.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import zstandard

from qeval.capture.capture import iter_pieces, scored_targets
from qeval.compare import stats
from qeval.compare.kernels import decode_tables
from qeval.compare.metrics import compare_chunk
from qeval.engine.engine import Engine, EngineSettings
from qeval.inputs.corpus import load_corpus, make_windows
from qeval.orchestrate import demo
from qeval.storage.codec import SqrtLogCode
from qeval.storage.scoring import HALF
from qeval.storage.store import ZSTD_LEVEL, ChunkBuilder, zstd_compressor

CANDIDATES = ("Q4_0", "Q3_K_M", "Q2_K")
KNEES = (0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0)


def encode_window(engine, index: int, window: np.ndarray, code: SqrtLogCode, pool: ThreadPoolExecutor):
    """One window of at most PIECE_ROWS scored rows decoded, coded and compressed into a chunk, as a capture does."""
    chunk, = iter_pieces(engine, window[None], [index], [engine.scoring.positions(engine.n_ctx)], code, pool,
                         zstd_compressor(pool._max_workers))
    return chunk


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def exact_kld(lp: np.ndarray, lq: np.ndarray) -> np.ndarray:
    return (np.exp(lp) * (lp - lq)).sum(axis=1)


def window_logits(engine: Engine, window: np.ndarray) -> np.ndarray:
    return np.concatenate([view.copy() for _, view in engine.iter_scored_logits(window)])


def decoded_logprobs(codes: np.ndarray, lut: np.ndarray) -> np.ndarray:
    d = lut.astype(np.float64)[codes]
    return d - np.log(np.exp(d).sum(axis=1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--out", default="bench/results/store.json")
    args = ap.parse_args()
    paths = demo.prepare_models(demo.models_dir())
    code = SqrtLogCode()
    settings = EngineSettings(n_threads=2)
    text = load_corpus().text
    with Engine(paths["Q8_0"], 512, settings) as ref_engine:
        windows = make_windows(ref_engine.tokenize(text), 512, args.chunks)
        ref_logits = [window_logits(ref_engine, w) for w in windows]
    out: dict = {"model": "gemma-3-270m", "n_vocab": int(ref_logits[0].shape[1]), "chunks": args.chunks,
                 "scored_tokens": int(sum(len(x) for x in ref_logits)), "code": code.params()}

    # --- noise floor, size, encode speed ----------------------------------------------------------
    floors, sizes = [], []
    for c, logits in enumerate(ref_logits):
        targets = scored_targets(windows[c], HALF.positions(windows.shape[1]))
        block = code.encode_block(logits, targets)
        floors.append(exact_kld(log_softmax64(logits), decoded_logprobs(block.codes, code.lut())))
        builder = ChunkBuilder(c)
        builder.add(block.planes, block.logprob_target, block.logprob_max, block.top_ids, block.error)
        sizes.append(len(builder.finish().codes_zst) + 8 * 2 * len(logits) + 4 * 10 * len(logits))
        exact_target = log_softmax64(logits)[np.arange(len(targets)), targets]
        out.setdefault("max_abs_err_logprob_target", 0.0)
        out["max_abs_err_logprob_target"] = max(out["max_abs_err_logprob_target"],
                                                float(np.abs(block.logprob_target - exact_target).max()))
    floor = np.concatenate(floors)
    out["noise_floor"] = {"mean": float(floor.mean()), "p99": float(np.percentile(floor, 99)), "max": float(floor.max())}
    out["bytes_per_scored_token"] = sum(sizes) / out["scored_tokens"]
    out["llamacpp_bytes_per_scored_token"] = 2 * (2 * ((out["n_vocab"] + 1) // 2) + 4)
    out["ratio_vs_llamacpp"] = out["llamacpp_bytes_per_scored_token"] / out["bytes_per_scored_token"]
    out["encode_tokens_per_s"] = encode_speed(ref_logits[0], scored_targets(windows[0], HALF.positions(windows.shape[1])), code)

    # --- size / noise-floor frontier over the knee ------------------------------------------------
    frontier = []
    sample = ref_logits[0]
    exact = log_softmax64(sample)
    for knee in KNEES:
        k_code = SqrtLogCode(knee=knee)
        blk = k_code.encode_block(sample, scored_targets(windows[0], HALF.positions(windows.shape[1])))
        size = len(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(blk.planes.tobytes())) / len(sample)
        f = exact_kld(exact, decoded_logprobs(blk.codes, k_code.lut()))
        frontier.append({"knee": knee, "noise_floor_mean": float(f.mean()), "bytes_per_token": size})
    out["frontier"] = frontier

    # --- store-vs-store vs exact float64 ----------------------------------------------------------
    out["store_vs_exact"] = {}
    tables = decode_tables(code.lut())
    for name in CANDIDATES:
        ours, exact_vals = [], []
        with Engine(paths[name], 512, settings) as engine, ThreadPoolExecutor(2) as pool:
            for c, window in enumerate(windows):
                cand_logits = window_logits(engine, window)
                exact_vals.append(exact_kld(log_softmax64(ref_logits[c]), log_softmax64(cand_logits)))
                ref_chunk = _chunk(c, ref_logits[c], window, code)
                cand_chunk = encode_window(engine, c, window, code, pool)
                ours.append(compare_chunk(ref_chunk, cand_chunk, window, HALF.positions(len(window)), tables, tables, out["n_vocab"])["kld"])
        ours_all, exact_all = np.concatenate(ours), np.concatenate(exact_vals)
        lad_ours = stats.ladder(ours_all, stats.KLD_LADDER)
        lad_exact = stats.ladder(exact_all, stats.KLD_LADDER)
        out["store_vs_exact"][name] = {
            "mean_kld_store": float(ours_all.mean()), "mean_kld_exact": float(exact_all.mean()),
            "mean_rel_err": float(abs(ours_all.mean() - exact_all.mean()) / exact_all.mean()),
            "ladder_rel_err": {k: float(abs(lad_ours[k] - lad_exact[k]) / lad_exact[k]) for k in lad_exact},
            "max_abs_err_per_token": float(np.abs(ours_all - exact_all).max()),
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


def _chunk(index: int, logits: np.ndarray, window: np.ndarray, code: SqrtLogCode):
    targets = scored_targets(window, HALF.positions(len(window)))
    builder = ChunkBuilder(index)
    for s in range(0, len(logits), 16):
        b = code.encode_block(logits[s:s + 16], targets[s:s + 16])
        builder.add(b.planes, b.logprob_target, b.logprob_max, b.top_ids, b.error)
    return builder.finish()


def encode_speed(logits: np.ndarray, targets: np.ndarray, code: SqrtLogCode) -> dict:
    result = {}
    for threads in (1, 2):
        with ThreadPoolExecutor(threads) as pool:
            _chunk(0, logits[:16], np.concatenate([np.zeros(257, np.int32), targets]), code)  # warm-up
            t = time.perf_counter()
            builder = ChunkBuilder(0, compressor=zstd_compressor(threads))
            for blk in pool.map(lambda s: code.encode_block(logits[s:s + 16], targets[s:s + 16]),
                                range(0, len(logits), 16)):
                builder.add(blk.planes, blk.logprob_target, blk.logprob_max, blk.top_ids, blk.error)
            builder.finish()
            result[f"{threads}_threads"] = len(logits) / (time.perf_counter() - t)
    return result


if __name__ == "__main__":
    main()
