"""Streaming comparison of a candidate against a reference, chunk pair by chunk pair.

Memory stays at a few chunks whatever the chunk count: each worker holds one compressed chunk of
each side and one block of decoded code planes. Per-token results (a handful of floats per scored
token) are kept for percentiles and for `--per-token`.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from qeval.compare import depth, metric_registry, sampler, stats
from qeval.compare.kernels import N_SUMS, decode_tables, kld_from_sums, pair_sums
from qeval.errors import MismatchError, QevalError
from qeval.pool import bounded_map
from qeval.storage.store import ChunkData, StoreHeader, StoreReader

TOPK_AGREEMENT = (5, 10)
# Tokens per decompressed block: 2 rows are 1 MB per store, so the kernel reads planes still in cache
# (16-token blocks: 1,870 tokens/s; 2-token blocks: 2,150, on 2 cores at a 262K vocab).
BLOCK_TOKENS = 2


class LogitSource(Protocol):
    """A store, or anything read like one (a llama.cpp base file)."""

    path: object
    header: StoreHeader
    tokens: np.ndarray
    lut: np.ndarray
    complete: bool
    chunk_indices: list[int]

    def read_chunk(self, index: int) -> ChunkData: ...


# Per-token columns, in this order, in Comparison.per_token and --per-token files.
PER_TOKEN_FIELDS = ("chunk", "position", "token", "kld", "kld_reverse", "nll_ref", "nll_cand", "p_ref",
                    "p_cand", "same_top1", "top5_agreement", "top10_agreement")


@dataclass
class Comparison:
    ref: LogitSource
    cand: LogitSource
    chunks: list[int]
    per_token: dict[str, np.ndarray]

    @property
    def scored_tokens(self) -> int:
        return len(self.per_token["kld"])

    def summary(self, bands: list[tuple[int, int]] | None = None) -> dict:
        """llama-perplexity's statistics blocks (what its text layout prints), "metrics": every metric of
        qeval.compare.metric_registry under its one name, and "by_depth": the same per band of logit
        position (qeval.compare.depth; default bands: powers of 4 from 512)."""
        if bands is None:
            bands = depth.parse_bands(None, self.ref.header.n_ctx)
        return {"chunks": len(self.chunks), **summarize_tokens(self.per_token),
                "by_depth": depth.by_depth(self.per_token, bands, summarize_tokens)}


def summarize_tokens(t: dict[str, np.ndarray]) -> dict:
    """Every figure of a set of scored tokens (per-token columns of PER_TOKEN_FIELDS)."""
    kld_mean, kld_se = stats.mean_se(t["kld"])
    rkld_mean, rkld_se = stats.mean_se(t["kld_reverse"])
    dp = t["p_cand"] - t["p_ref"]
    dp_mean, dp_se = stats.mean_se(dp)
    rms, rms_se = stats.rms_se(dp)
    top1, top1_se = stats.proportion_se(t["same_top1"])
    out = {
        "scored_tokens": len(t["kld"]),
        "perplexity": stats.paired_perplexity(t["nll_cand"], t["nll_ref"]),
        "kld": {"mean": kld_mean, "se": kld_se, "ladder": stats.ladder(t["kld"], stats.KLD_LADDER)},
        "kld_reverse": {"mean": rkld_mean, "se": rkld_se,
                        "ladder": stats.ladder(t["kld_reverse"], stats.KLD_LADDER)},
        "delta_p": {"mean": dp_mean, "se": dp_se, "ladder": stats.ladder(dp, stats.DP_LADDER),
                    "rms": rms, "rms_se": rms_se},
        "same_top1": {"fraction": top1, "se": top1_se},
    }
    for k in TOPK_AGREEMENT:
        m, se = stats.mean_se(t[f"top{k}_agreement"])
        out[f"top{k}_agreement"] = {"mean": m, "se": se}
    out["metrics"] = metric_registry.compute(t)
    if sampler.names_in(t):  # per-token columns of samplers (compare(..., samplers=...))
        out["samplers"] = sampler.summary(t)
    return out


def usable_chunks(source: LogitSource, role: str) -> range:
    if not source.complete:
        h = source.header
        raise QevalError(
            f"{role} store {source.path} is incomplete: {len(source.chunk_indices)} of "
            f"{h.chunk_stop - h.chunk_start} chunks written (a capture still running or interrupted; "
            "re-run the same `qeval capture` command to resume it)")
    return source.header.chunk_range


def select_chunks(ref: LogitSource, cand: LogitSource, n_chunks: int | None) -> list[int]:
    """The first n chunks both sides hold (default: all they share), after checking they compare."""
    rh, ch = ref.header, cand.header
    if rh.n_vocab != ch.n_vocab:
        raise MismatchError(f"vocab size differs: reference {rh.n_vocab}, candidate {ch.n_vocab} "
                            "(different tokenizers cannot be compared)")
    if rh.n_ctx != ch.n_ctx:
        raise MismatchError(f"context size differs: reference n_ctx {rh.n_ctx}, candidate n_ctx {ch.n_ctx}")
    if rh.scoring != ch.scoring:
        raise MismatchError(f"scored positions differ: reference --score {rh.scoring}, candidate --score "
                            f"{ch.scoring} (capture both with the same --score)")
    if rh.tokenizer_sha256 and ch.tokenizer_sha256 and rh.tokenizer_sha256 != ch.tokenizer_sha256:
        raise MismatchError("tokenizers differ (same vocab size, different token pieces)")
    ref_range, cand_range = usable_chunks(ref, "reference"), usable_chunks(cand, "candidate")
    start = max(ref_range.start, cand_range.start)
    stop = min(ref_range.stop, cand_range.stop)
    if start != 0 or stop <= start:
        raise MismatchError(f"the stores share no chunk range starting at chunk 0 (reference "
                            f"{ref_range.start}:{ref_range.stop}, candidate {cand_range.start}:{cand_range.stop}); "
                            "merge shards first")
    if n_chunks is not None:
        if n_chunks < 1:
            raise QevalError("--chunks must be at least 1")
        if n_chunks > stop:
            raise QevalError(f"--chunks {n_chunks} asks for more than the stores hold together "
                             f"(reference {ref_range.stop}, candidate {cand_range.stop} chunks)")
        stop = n_chunks
    chunks = list(range(stop))
    check_same_tokens(ref.tokens[:stop], cand.tokens[:stop], rh.n_ctx)
    return chunks


def check_same_tokens(ref_tokens: np.ndarray, cand_tokens: np.ndarray, n_ctx: int) -> None:
    diff = np.flatnonzero(ref_tokens.ravel() != cand_tokens.ravel())
    if len(diff):
        pos = int(diff[0])
        raise MismatchError(
            f"token ids differ at position {pos} (chunk {pos // n_ctx}, offset {pos % n_ctx}): reference "
            f"{int(ref_tokens.ravel()[pos])}, candidate {int(cand_tokens.ravel()[pos])} "
            f"({len(diff)} positions differ in all) - the runs used different corpora or tokenizers")


def compare_chunk(ref: ChunkData, cand: ChunkData, tokens: np.ndarray, positions: np.ndarray, ref_tables,
                  cand_tables, n_vocab: int, kernel_pool: ThreadPoolExecutor | None = None,
                  samplers: sampler.Prepared | None = None) -> dict[str, np.ndarray]:
    """Per-token metrics of one chunk pair. `tokens` is the chunk's n_ctx token ids, `positions` the scored
    logit positions (header.positions).

    With `kernel_pool`, token blocks go to its threads as they are decompressed (at most two
    blocks per thread in flight, so memory stays bounded). `samplers` (sampler.prepare) adds their
    per-token columns, computed on the same decompressed blocks.
    """
    n = ref.n_tokens
    if cand.n_tokens != n:
        raise MismatchError(f"chunk {ref.index}: {n} scored tokens in the reference, {cand.n_tokens} in the candidate")
    sums = np.empty((n, N_SUMS), dtype=np.float64)
    sampled = samplers.new_output(n) if samplers is not None else None

    def kernels(planes_ref, planes_cand, rows: slice) -> None:
        pair_sums(planes_ref, planes_cand, *ref_tables, *cand_tables, sums[rows])
        if samplers is not None:  # after pair_sums: it reads the rows' total masses
            sampler.run_block(samplers, planes_ref, planes_cand, sums[rows], sampled[rows])

    pending: list = []
    in_flight = 2 * kernel_pool._max_workers if kernel_pool else 0
    buffers = in_flight + 2  # a decompressed block must outlive the kernel tasks that read it
    # strict: both streams run to their end (a live candidate fills in its scalars there)
    for (start, planes_ref), (_, planes_cand) in zip(ref.iter_planes(n_vocab, BLOCK_TOKENS, buffers),
                                                     cand.iter_planes(n_vocab, BLOCK_TOKENS, buffers),
                                                     strict=True):
        args = (planes_ref, planes_cand, slice(start, start + len(planes_ref)))
        if kernel_pool is None:
            kernels(*args)
            continue
        pending.append(kernel_pool.submit(kernels, *args))
        if len(pending) >= in_flight:
            pending.pop(0).result()
    for future in pending:
        future.result()
    kld, kld_reverse = kld_from_sums(sums)
    out = {
        "chunk": np.full(n, ref.index, dtype=np.int32),
        "position": positions.astype(np.int32),  # the logit position: the context holds position + 1 tokens
        "token": tokens[positions + 1].astype(np.int32),
        "kld": kld,
        "kld_reverse": kld_reverse,
        "nll_ref": -ref.logprob_target,
        "nll_cand": -cand.logprob_target,
        "p_ref": np.exp(ref.logprob_target),
        "p_cand": np.exp(cand.logprob_target),
        "same_top1": ref.top_ids[:, 0] == cand.top_ids[:, 0],
    }
    for k in TOPK_AGREEMENT:
        kk = min(k, ref.top_ids.shape[1], cand.top_ids.shape[1])  # tiny vocabs keep fewer ids
        overlap = (ref.top_ids[:, :kk, None] == cand.top_ids[:, None, :kk]).any(axis=2).sum(axis=1)
        out[f"top{k}_agreement"] = overlap / kk
    if samplers is not None:
        out.update(sampler.chunk_columns(samplers, sampled, ref.top_ids[:, 0], cand.top_ids[:, 0]))
    return out


def compare(ref: LogitSource, cand: LogitSource, n_chunks: int | None = None, threads: int = 2,
            on_chunk: Callable[[int], None] | None = None, samplers=()) -> Comparison:
    """KLD, PPL, top-1 ... of `cand` against `ref`, streaming chunk pairs over `threads` workers.

    A live candidate (a model decoding on all cores) is compared chunk after chunk instead, with
    the kernel spread over `threads`: a kernel thread beside llama.cpp's own threads would slow
    its forward pass far more than it gains.

    samplers: qeval.compare.sampler presets, settings strings or Sampler values; each adds per-token
    columns (TVD after the sampler chain ...) computed in the same pass.
    """
    chunks = select_chunks(ref, cand, n_chunks)
    n_vocab = ref.header.n_vocab
    ref_tables, cand_tables = decode_tables(ref.lut), decode_tables(cand.lut)
    threads = max(1, threads)
    live = getattr(cand, "live", False)
    kernel_pool = ThreadPoolExecutor(max_workers=threads) if live else None
    prepared = sampler.prepare(samplers, ref.lut, cand.lut, n_vocab) if samplers else None

    buffers = threading.local()  # each worker reads chunks into its own two reused buffers

    def read(source: LogitSource, i: int, slot: str):
        if not isinstance(source, StoreReader):
            return source.read_chunk(i)
        if not hasattr(buffers, slot):
            setattr(buffers, slot, bytearray())
        return source.read_chunk(i, getattr(buffers, slot))

    def one(i: int) -> dict[str, np.ndarray]:
        return compare_chunk(read(ref, i, "ref"), read(cand, i, "cand"), ref.tokens[i], ref.header.positions,
                             ref_tables, cand_tables, n_vocab, kernel_pool, prepared)

    parts = []
    with ThreadPoolExecutor(max_workers=1 if live else threads) as pool:
        for part in bounded_map(pool, one, chunks, 1 if live else 2 * threads):
            parts.append(part)
            if on_chunk:
                on_chunk(1)
    if kernel_pool is not None:
        kernel_pool.shutdown()
    fields = (*PER_TOKEN_FIELDS, *(sampler.columns_of(prepared.samplers) if prepared else ()))
    per_token = {k: np.concatenate([p[k] for p in parts]) for k in fields}
    return Comparison(ref, cand, chunks, per_token)
