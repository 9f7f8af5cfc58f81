"""Per-row costs of qeval's work after the forward pass, at Qwen3.5's 248,320 vocab and Gemma-3's 262,144,
side by side in one run (issue 28).

    python bench/bench_rowcost.py [--rows 64] [--repeats 7] [--sampler qwen3.5-thinking]
                                  [--out bench/results/rowcost-amd-epyc.json]

Each vocab gets the same number of synthetic rows shaped like an LLM's logits (the tests' generator,
tests/conftest.py realistic_logits: a normal bulk, a Gumbel tail, a few dominant entries) and a candidate
(the same rows plus N(0, 0.5) noise). Every step is timed on one thread, alternating the two vocabs inside
every repeat so a busy machine disturbs both alike. A step's figure is its thread's CPU time (time.thread_time: the
time spent waiting for a core on a shared machine is left out; every step runs on the calling thread), fastest of
--repeats (the least disturbed), with the median and the wall clock beside it. Steps, as qeval runs them:

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
            builder.add_block(block)
            rows.append(block.planes)
        chunks.append(builder.finish())
        planes.append(np.concatenate(rows))
    return Rows(n_vocab, ref, cand, targets, planes[0], planes[1], chunks[0], chunks[1], chunks[0].codes_zst,
                decode_tables(code.lut()))


# ------------------------------------------------------------------------------------------------
# the steps: each sets up what it needs from `r` and returns the work to time, every row of `r` once
# ------------------------------------------------------------------------------------------------
Work = Callable[[], object]


def encode(r: Rows) -> Work:
    code = SqrtLogCode()
    return lambda: [code.encode_block(r.ref_logits[a:a + ENCODE_BLOCK], r.targets[a:a + ENCODE_BLOCK])
                    for a in range(0, len(r.targets), ENCODE_BLOCK)]


def compress(r: Rows) -> Work:
    blocks = [np.ascontiguousarray(r.ref_planes[a:a + ENCODE_BLOCK]) for a in range(0, len(r.targets), ENCODE_BLOCK)]

    def work() -> None:
        z = zstd_compressor().compressobj()
        for block in blocks:
            z.compress(block.data)
        z.flush()
    return work


def decompress_floor(r: Rows) -> Work:
    """Into one reused buffer of a comparison block's size: a fresh output array per frame would add page faults."""
    buf = memoryview(np.empty(metrics.BLOCK_TOKENS * 2 * r.n_vocab, dtype=np.uint8))

    def work() -> None:
        with zstandard.ZstdDecompressor().stream_reader(r.frame) as reader:
            while reader.readinto(buf):
                pass
    return work


def read_planes(r: Rows) -> Work:
    return lambda: [None for _ in r.ref_chunk.iter_planes(r.n_vocab, metrics.BLOCK_TOKENS)]


def store_vs_store_kernel(r: Rows) -> Work:
    sums = np.empty((len(r.targets), N_SUMS))
    return lambda: pair_sums(r.ref_planes, r.cand_planes, *r.tables, *r.tables, sums)


def live_row(r: Rows) -> Work:
    sums = np.empty(N_SUMS)
    scratch = np.empty((2, r.n_vocab), dtype=np.float64)

    def work() -> None:
        for k in range(len(r.targets)):
            pair_sums_logits(r.ref_planes[k], r.cand_logits[k], *r.tables, sums, scratch)
            top_k_ids(r.cand_logits[k])
    return work


def sampler_step(samplers: list[str]) -> Callable[[Rows], Work]:
    """The sampler kernel alone: its tables and the rows' pair_sums (which it reads) are set up first."""
    def step(r: Rows) -> Work:
        lut = SqrtLogCode().lut()
        prep = sampler.prepare(samplers, lut, lut, r.n_vocab)
        sums = np.empty((len(r.targets), N_SUMS))
        pair_sums(r.ref_planes, r.cand_planes, *r.tables, *r.tables, sums)
        out = prep.new_output(len(r.targets))
        return lambda: sampler.run_block(prep, r.ref_planes, r.cand_planes, sums, out)
    return step


def compare_coded(r: Rows) -> Work:
    n = len(r.targets)
    tokens = np.concatenate([[0], r.targets]).astype(np.int32)
    return lambda: metrics.compare_chunk(r.ref_chunk, r.cand_chunk, tokens, np.arange(n), r.tables, r.tables,
                                         r.n_vocab)


def measure(rows: dict[str, Rows], steps: dict[str, Callable[[Rows], Work]], repeats: int) -> dict:
    """Seconds per row, by clock, step and vocab: each repeat runs every step at both vocabs in turn."""
    times = {clock: {s: {v: [] for v in rows} for s in steps} for clock in ("cpu", "wall")}
    for step in steps.values():
        for r in rows.values():
            work = step(r)
            work()  # warm-up: numba compilation (or its cache), first-touch page faults
    for _ in range(repeats):
        for name, step in steps.items():
            for vocab, r in rows.items():
                work = step(r)
                c, t = time.thread_time(), time.perf_counter()
                work()
                times["cpu"][name][vocab].append((time.thread_time() - c) / len(r.targets))
                times["wall"][name][vocab].append((time.perf_counter() - t) / len(r.targets))
    return times


def summarise(times: dict, rows: dict[str, Rows]) -> dict:
    """Per step: µs per row (fastest and median of the repeats) on both clocks, and the ratio of the vocabs' fastest
    CPU times."""
    small, large = list(rows)
    out = {}
    for name in times["cpu"]:
        entry = {}
        for clock, by_step in times.items():
            entry[f"{clock}_us_per_row_fastest"] = {v: min(ts) * 1e6 for v, ts in by_step[name].items()}
            entry[f"{clock}_us_per_row_median"] = {v: statistics.median(ts) * 1e6 for v, ts in by_step[name].items()}
        fastest = entry["cpu_us_per_row_fastest"]
        entry["ratio_248k_over_262k"] = fastest[small] / fastest[large]
        out[name] = entry
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
                    "note": "shared machine: other work ran alongside; figures are the fastest of the repeats, on this "
                            "thread's CPU time (waits for a core left out) and on the wall clock"},
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
    lines = [f"| step (one thread: CPU µs per row, fastest of {out['repeats']}; wall) | {names[0]} | {names[1]} "
             "| ratio (CPU) |", "|---|---|---|---|"]
    for step, s in out["steps"].items():
        c, w = s["cpu_us_per_row_fastest"], s["wall_us_per_row_fastest"]
        lines.append(f"| {step} | {c[names[0]]:.0f} ({w[names[0]]:.0f}) | {c[names[1]]:.0f} ({w[names[1]]:.0f}) "
                     f"| {s['ratio_248k_over_262k']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
