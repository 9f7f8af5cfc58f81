"""Per-row costs of qeval's work after the forward pass, at Qwen3.5's 248,320 vocab and Gemma-3's 262,144,
side by side in one run (issue 28).

    python bench/bench_rowcost.py [--rows 64] [--repeats 7] [--sampler qwen3.5-thinking]
                                  [--out bench/results/rowcost-amd-epyc.json]

Each vocab gets the same number of synthetic rows shaped like an LLM's logits (the tests' generator,
tests/conftest.py realistic_logits: a normal bulk, a Gumbel tail, a few dominant entries) and a candidate
(the same rows plus N(0, 0.5) noise). Every step is timed on one thread, alternating the two vocabs inside
every repeat so a busy machine disturbs both alike; a step's figure is the fastest of --repeats (the least
disturbed), its median beside it. Steps, as qeval runs them:

* encode: SqrtLogCode.encode_block over blocks of capture.ENCODE_BLOCK rows (top-10, exp, uint16 codes, planes);
* compress: those planes through a zstd compressobj at the store's level (ChunkBuilder.add);
* floor, decompress: the chunk's zstd frame decompressed into one reused block buffer, nothing else (zstandard);
* read planes: the same frame read as the comparison reads it (ChunkData.iter_planes, blocks of BLOCK_TOKENS);
* store vs store: kernels.pair_sums on decompressed planes (the fused KLD sums);
* live: what metrics.logit_sums does per row of a live candidate (pair_sums_logits + top_k_ids);
* sampler: sampler.run_block for each --sampler on decompressed planes (after pair_sums);
* compare_chunk, coded: metrics.compare_chunk of two coded chunks end to end (decompression included).

The expected ratio of the two vocabs is 248,320 / 262,144 = 0.947 for work linear in the row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import zstandard

from common import cpu_name

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from conftest import perturb, realistic_logits  # noqa: E402

from qeval.capture.capture import ENCODE_BLOCK  # noqa: E402
from qeval.compare import metrics, sampler  # noqa: E402
from qeval.compare.kernels import N_SUMS, decode_tables, pair_sums, pair_sums_logits  # noqa: E402
from qeval.storage.codec import SqrtLogCode, top_k_ids  # noqa: E402
from qeval.storage.store import ChunkBuilder, ChunkData, zstd_compressor  # noqa: E402

VOCABS = {"qwen3.5 (248,320)": 248_320, "gemma-3 (262,144)": 262_144}
DEFAULT_SAMPLERS = ["qwen3.5-thinking"]


@dataclass
class Rows:
    """One vocab's synthetic rows, coded and compressed once, and what each step reads."""

    n_vocab: int
    ref_logits: np.ndarray  # float32 [n, V]
    cand_logits: np.ndarray
    targets: np.ndarray
    ref_planes: np.ndarray  # uint8 [n, 2, V]
    cand_planes: np.ndarray
    ref_chunk: ChunkData
    cand_chunk: ChunkData
    frame: bytes  # the reference chunk's zstd frame
    tables: tuple[np.ndarray, np.ndarray]


def make_rows(n_vocab: int, n: int, seed: int) -> Rows:
    rng = np.random.default_rng(seed)
    code = SqrtLogCode()
    ref = realistic_logits(rng, n, n_vocab)
    cand = perturb(rng, ref, 0.5)
    targets = rng.integers(0, n_vocab, size=n)
    chunks, planes = [], []
    for logits in (ref, cand):
        builder, rows = ChunkBuilder(0), []
        for start in range(0, n, ENCODE_BLOCK):
            block = code.encode_block(logits[start:start + ENCODE_BLOCK], targets[start:start + ENCODE_BLOCK])
            builder.add(block.planes, block.logprob_target, block.logprob_max, block.top_ids)
            rows.append(block.planes)
        chunks.append(builder.finish())
        planes.append(np.concatenate(rows))
    return Rows(n_vocab, ref, cand, targets, planes[0], planes[1], chunks[0], chunks[1], chunks[0].codes_zst,
                decode_tables(code.lut()))


# ------------------------------------------------------------------------------------------------
# the steps: each does its work on every row of `r` once (returning None: timed whole)
# ------------------------------------------------------------------------------------------------
def encode(r: Rows) -> None:
    code = SqrtLogCode()
    for start in range(0, len(r.targets), ENCODE_BLOCK):
        code.encode_block(r.ref_logits[start:start + ENCODE_BLOCK], r.targets[start:start + ENCODE_BLOCK])


def compress(r: Rows) -> None:
    z = zstd_compressor().compressobj()
    for start in range(0, len(r.targets), ENCODE_BLOCK):
        z.compress(np.ascontiguousarray(r.ref_planes[start:start + ENCODE_BLOCK]).data)
    z.flush()


def decompress_floor(r: Rows) -> None:
    """Into one reused buffer of a comparison block's size: a fresh output array per frame would add page faults."""
    buf = memoryview(np.empty(metrics.BLOCK_TOKENS * 2 * r.n_vocab, dtype=np.uint8))
    with zstandard.ZstdDecompressor().stream_reader(r.frame) as reader:
        while reader.readinto(buf):
            pass


def read_planes(r: Rows) -> None:
    for _ in r.ref_chunk.iter_planes(r.n_vocab, metrics.BLOCK_TOKENS):
        pass


def store_vs_store_kernel(r: Rows) -> None:
    sums = np.empty((len(r.targets), N_SUMS))
    pair_sums(r.ref_planes, r.cand_planes, *r.tables, *r.tables, sums)


def live_row(r: Rows) -> None:
    sums = np.empty(N_SUMS)
    scratch = np.empty((2, r.n_vocab), dtype=np.float32)
    for k in range(len(r.targets)):
        pair_sums_logits(r.ref_planes[k], r.cand_logits[k], *r.tables, sums, scratch)
        top_k_ids(r.cand_logits[k])


def sampler_step(samplers: list[str]) -> Callable[[Rows], float]:
    def run(r: Rows) -> float:
        lut = SqrtLogCode().lut()
        prep = sampler.prepare(samplers, lut, lut, r.n_vocab)
        sums = np.empty((len(r.targets), N_SUMS))
        pair_sums(r.ref_planes, r.cand_planes, *r.tables, *r.tables, sums)
        t = time.perf_counter()
        sampler.run_block(prep, r.ref_planes, r.cand_planes, sums, prep.new_output(len(r.targets)))
        return time.perf_counter() - t  # the sampler kernel alone: prepare and pair_sums are not its cost
    return run


def compare_coded(r: Rows) -> None:
    n = len(r.targets)
    tokens = np.concatenate([[0], r.targets]).astype(np.int32)
    metrics.compare_chunk(r.ref_chunk, r.cand_chunk, tokens, np.arange(n), r.tables, r.tables, r.n_vocab)


def measure(rows: dict[str, Rows], steps: dict[str, Callable[[Rows], float | None]], repeats: int) -> dict:
    """Seconds per row of every step at every vocab: each repeat runs every step at both vocabs in turn. A step
    that returns seconds timed its own work (leaving out its set-up); the others are timed whole."""
    times: dict[str, dict[str, list[float]]] = {s: {v: [] for v in rows} for s in steps}
    for name, step in steps.items():  # warm-up: numba compilation (or its cache), first-touch page faults
        for r in rows.values():
            step(r)
    for _ in range(repeats):
        for name, step in steps.items():
            for vocab, r in rows.items():
                t = time.perf_counter()
                own = step(r)
                elapsed = own if own is not None else time.perf_counter() - t
                times[name][vocab].append(elapsed / len(r.targets))
    return times


def summarise(times: dict, rows: dict[str, Rows]) -> dict:
    small, large = list(rows)
    out = {}
    for name, by_vocab in times.items():
        fastest = {v: min(ts) * 1e6 for v, ts in by_vocab.items()}
        out[name] = {"us_per_row_fastest": fastest,
                     "us_per_row_median": {v: statistics.median(ts) * 1e6 for v, ts in by_vocab.items()},
                     "ratio_248k_over_262k": fastest[small] / fastest[large]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64, help="rows per vocab (a multiple of ENCODE_BLOCK)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sampler", action="append", default=None)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "rowcost.json"))
    args = ap.parse_args()
    samplers = args.sampler or DEFAULT_SAMPLERS
    rows = {name: make_rows(v, args.rows, seed=28) for name, v in VOCABS.items()}
    steps = {"encode": encode, "compress (zstd level of the store)": compress,
             "floor: zstd decompress": decompress_floor, "read planes (decompress as compare does)": read_planes,
             "store-vs-store kernel (pair_sums)": store_vs_store_kernel,
             "live row (pair_sums_logits + top-10)": live_row,
             f"sampler kernel ({', '.join(samplers)})": sampler_step(samplers),
             "compare_chunk, coded vs coded (end to end)": compare_coded}
    times = measure(rows, steps, args.repeats)
    out = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "threads_used": 1,
                    "load_avg_1m_at_end": os.getloadavg()[0],
                    "note": "shared machine: other work ran alongside; figures are the fastest of the repeats"},
        "rows_per_vocab": args.rows, "repeats": args.repeats, "samplers": samplers,
        "compressed_bytes_per_row": {name: len(r.frame) / args.rows for name, r in rows.items()},
        "expected_linear_ratio": VOCABS["qwen3.5 (248,320)"] / VOCABS["gemma-3 (262,144)"],
        "steps": summarise(times, rows),
        "raw_s_per_row": times,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(table(out))


def table(out: dict) -> str:
    names = list(VOCABS)
    lines = [f"| step (one thread, µs per row, fastest of {out['repeats']}) | {names[0]} | {names[1]} | ratio |",
             "|---|---|---|---|"]
    for step, s in out["steps"].items():
        f = s["us_per_row_fastest"]
        lines.append(f"| {step} | {f[names[0]]:.0f} | {f[names[1]]:.0f} | {s['ratio_248k_over_262k']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
