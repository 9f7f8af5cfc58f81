"""Streaming comparison of a candidate against a reference, chunk pair by chunk pair.

Memory stays at a few chunks whatever the chunk count: each worker holds one compressed chunk of
each side and one block of decoded code planes. Per-token results (a handful of floats per scored
token) are kept for percentiles and for `--per-token`.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np

from qeval.compare import depth, metric_registry, sampler, stats
from qeval.compare.kernels import (
    BOUND_FWD,
    BOUND_REV,
    N_SUMS,
    Z_Q_EXACT,
    decode_tables,
    evaluation_error,
    kld_from_sums,
    pair_sums,
    pair_sums_logits,
    pair_sums_replayed,
    pair_sums_replayed_coded,
)
from qeval.errors import MismatchError, QevalError, StoreFormatError
from qeval.identity import window_labels_identity
from qeval.pool import bounded_map
from qeval.storage.codec import BadLogits, top_k_ids
from qeval.storage.error_record import BandWeights
from qeval.storage.scoring import WindowLabels
from qeval.storage.store import TOP_K, ChunkData, StoreHeader, StoreReader

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


# Per-token columns, in this order, in Comparison.per_token and --per-token files. kld_bound and kld_reverse_bound:
# the certified bound on |KLD computed - KLD of the exact logits| of docs/error-bound.md, NaN where a store does
# not record its error (every other column is then exact: the stores keep exact scalars and top ids). p_ref_top1:
# the reference's top-1 probability max_i p_ref(i), exp of the log-probability of its argmax the store keeps per
# scored token (exact from the float32 logits; the by-confidence figures, qeval.compare.depth.by_confidence).
PER_TOKEN_FIELDS = ("chunk", "position", "token", "kld", "kld_reverse", "nll_ref", "nll_cand", "p_ref",
                    "p_cand", "same_top1", "top5_agreement", "top10_agreement", "kld_bound", "kld_reverse_bound",
                    "p_ref_top1")
# Then, in a comparison of conversation windows (--score assistant), each token's group: an index into the
# reference's WindowLabels.segments and .categories (qeval.compare.depth groups them).
GROUP_FIELDS = ("segment", "category")


@dataclass(kw_only=True)
class Comparison:
    ref: LogitSource
    cand: LogitSource
    chunks: list[int]
    per_token: dict[str, np.ndarray]
    label_names: dict | None = None  # conversations: {"segments", "categories"} the GROUP_FIELDS codes index
    early: dict | None = None  # a board decided early: `chunks` are the sample it visited (identity.ComparisonRequest)

    @property
    def scored_tokens(self) -> int:
        return len(self.per_token["kld"])

    def summary(self, bands: list[tuple[int, int]] | None = None,
                buckets: list[tuple[float, float]] | None = None) -> dict:
        """llama-perplexity's statistics blocks (what its text layout prints), "metrics": every metric of
        qeval.compare.metric_registry under its one name, "by_depth": the same per band of logit
        position (qeval.compare.depth; default bands: powers of 4 from 512) and "by_confidence": per bucket of
        the reference's top-1 probability (default buckets: depth.DEFAULT_CONFIDENCE_EDGES; left out where the
        per-token rows lack that column: a result saved before qeval kept it)."""
        if bands is None:
            bands = depth.parse_bands(None, self.ref.header.n_ctx)
        confidence = depth.by_confidence(self.per_token, buckets or depth.parse_confidence_buckets(None),
                                         summarize_tokens)
        return {"chunks": len(self.chunks), **summarize_tokens(self.per_token),
                "by_depth": depth.by_depth(self.per_token, bands, summarize_tokens),
                **({"by_confidence": confidence} if confidence is not None else {}),
                **depth.by_labels(self.per_token, self.label_names, summarize_tokens),
                **({"labels": self.label_names} if self.label_names else {})}


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
    if window_labels_identity(rh, stop) != window_labels_identity(ch, stop):
        raise MismatchError("the stores score other tokens of the same conversations (their per-token labels "
                            "differ: another labelling of the assistant's text)")
    return chunks


def check_same_tokens(ref_tokens: np.ndarray, cand_tokens: np.ndarray, n_ctx: int) -> None:
    diff = np.flatnonzero(ref_tokens.ravel() != cand_tokens.ravel())
    if len(diff):
        pos = int(diff[0])
        raise MismatchError(
            f"token ids differ at position {pos} (chunk {pos // n_ctx}, offset {pos % n_ctx}): reference "
            f"{int(ref_tokens.ravel()[pos])}, candidate {int(cand_tokens.ravel()[pos])} "
            f"({len(diff)} positions differ in all) - the runs used different corpora or tokenizers")


class KernelRunner:
    """Kernel calls on a pool's threads (or inline without one), at most two per thread in flight so that
    memory stays bounded; drain() waits for all, before the buffers they read are reused."""

    def __init__(self, pool: ThreadPoolExecutor | None):
        self.pool = pool
        self.in_flight = 2 * pool._max_workers if pool else 0
        self._pending: list = []

    def submit(self, fn, *args) -> None:
        if self.pool is None:
            fn(*args)
            return
        self._pending.append(self.pool.submit(fn, *args))
        if len(self._pending) >= self.in_flight:
            self._result(self._pending.pop(0))

    def drain(self) -> None:
        while self._pending:
            self._result(self._pending.pop(0))

    def _result(self, future) -> None:
        """The task's outcome; when it failed, the others are waited for first: none may go on reading a
        buffer (a live model's logits, a decompressed block) that the caller frees or reuses."""
        try:
            future.result()
        except BaseException:
            wait(self._pending)
            self._pending = []
            raise


def band_weights(chunk, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """error_record.BandWeights of rows [start, stop) of a chunk: (per band [3, rows, K], per token [2, rows])."""
    w = BandWeights.of(chunk.error_rows(start, stop))
    return w.bands, w.tokens


def plane_sums(ref: ChunkData, cand: ChunkData, ref_tables, cand_tables, n_vocab: int, sums: np.ndarray,
               runner: KernelRunner, samplers: sampler.Prepared | None, sampled: np.ndarray | None,
               bands: tuple[np.ndarray, np.ndarray] | None) -> None:
    """Fused sums of two coded chunks into `sums`, block by block as both are decompressed; with `bands` (each
    side's band of each code), the bound's columns too."""
    def kernels(planes_ref, planes_cand, rows: slice, weights) -> None:
        if bands is None:
            pair_sums(planes_ref, planes_cand, *ref_tables, *cand_tables, sums[rows])
        else:
            (ref_w, ref_t), (cand_w, cand_t) = weights
            pair_sums(planes_ref, planes_cand, *ref_tables, *cand_tables, sums[rows], *bands, ref_w, cand_w, ref_t,
                      cand_t)
        if samplers is not None:  # after pair_sums: it reads the rows' total masses
            sampler.run_block(samplers, planes_ref, planes_cand, sums[rows], sampled[rows])

    buffers = runner.in_flight + 2  # a decompressed block must outlive the kernel tasks that read it
    # strict: both streams run to their end (a live candidate fills in its scalars there)
    for (start, planes_ref), (_, planes_cand) in zip(ref.iter_planes(n_vocab, BLOCK_TOKENS, buffers),
                                                     cand.iter_planes(n_vocab, BLOCK_TOKENS, buffers),
                                                     strict=True):
        stop = start + len(planes_ref)
        weights = (band_weights(ref, start, stop), band_weights(cand, start, stop)) if bands else None
        runner.submit(kernels, planes_ref, planes_cand, slice(start, stop), weights)
    runner.drain()


def row_plane_sums(ref: ChunkData, cand: ChunkData, ref_tables, cand_tables, n_vocab: int, sums: np.ndarray,
                   bands: tuple[np.ndarray, np.ndarray] | None) -> None:
    """Fused sums of a reference that reads uncoded (a version 6 hidden store: ref.iter_rows gives its replayed rows
    as float32, at the speed of the replay that hashes as the capture's) against a coded candidate, row by row: a
    replayed row through pair_sums_replayed_coded, a coded one (a logits piece of an auto store) through pair_sums.
    With `bands`, the bound's columns too, from each row's records."""
    scratch = np.empty((2, n_vocab), dtype=np.float64)
    ref_rows = ref.iter_rows(n_vocab)
    for start, planes_cand in cand.iter_planes(n_vocab, BLOCK_TOKENS):
        cand_w = band_weights(cand, start, start + len(planes_cand)) if bands else None
        for k in range(len(planes_cand)):
            r, ref_row, record = next(ref_rows)
            try:
                _row_sums(ref_row, planes_cand[k], k, record, cand_w, ref_tables, cand_tables, sums[r], scratch,
                          bands)
            except BadLogits as exc:
                raise StoreFormatError(f"chunk {ref.index}: {exc}") from None  # a replay gave no valid row
    if next(ref_rows, None) is not None:
        raise MismatchError(f"chunk {ref.index}: the candidate holds fewer rows than the reference")


def _row_sums(ref_row, cand_planes, k, record, cand_w, ref_tables, cand_tables, out, scratch, bands) -> None:
    """One row of row_plane_sums: row k of the candidate's block (its weights cand_w) against the reference's."""
    ref_w = BandWeights.of(record) if bands else None
    if ref_row.dtype == np.float32:
        if bands is None:
            pair_sums_replayed_coded(ref_row, cand_planes, *cand_tables, out, scratch)
        else:
            pair_sums_replayed_coded(ref_row, cand_planes, *cand_tables, out, scratch, bands[1], ref_w.bands[:, 0],
                                     ref_w.tokens[:, 0], cand_w[0][:, k], cand_w[1][:, k])
        return
    rows = out[None]
    if bands is None:
        pair_sums(ref_row[None], cand_planes[None], *ref_tables, *cand_tables, rows)
    else:
        pair_sums(ref_row[None], cand_planes[None], *ref_tables, *cand_tables, rows, *bands, ref_w.bands,
                  cand_w[0][:, k:k + 1], ref_w.tokens, cand_w[1][:, k:k + 1])


def logit_sums(ref: ChunkData, cand, targets: np.ndarray, ref_tables, n_vocab: int, sums: np.ndarray,
               runner: KernelRunner, ref_bands: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Fused sums of a reference chunk against a live candidate's float32 rows (cand.iter_logits), row by row, the
    reference read as ref.iter_rows gives it: coded (pair_sums_logits) or, a hidden piece that can, its replayed
    rows uncoded (pair_sums_replayed); the candidate's (logprob_target, top_ids), which no store holds for it:
    exact, from its float32 logits in float64. With `ref_bands` (the reference's band of each code), the bound's
    columns too."""
    n = len(targets)
    logprob_target = np.empty(n, dtype=np.float64)
    top_ids = np.empty((n, min(TOP_K, n_vocab)), dtype=np.int32)
    scratch = threading.local()  # each kernel thread's rows x - max and exp(x - max)

    def kernel(ref_row: np.ndarray, logits: np.ndarray, r: int, weights) -> None:
        if getattr(scratch, "rows", None) is None:
            scratch.rows = np.empty((4, n_vocab), dtype=np.float64)
        try:
            if ref_row.dtype == np.float32:
                pair_sums_replayed(ref_row, logits, sums[r], scratch.rows, *weights)
                cand_raw = scratch.rows[2]
            else:
                pair_sums_logits(ref_row, logits, *ref_tables, sums[r], scratch.rows[:2], ref_bands, *weights)
                cand_raw = scratch.rows[0]
        except BadLogits as exc:
            raise QevalError(f"chunk {ref.index}: the candidate model produced invalid logits ({exc}); the model "
                             "file or this llama.cpp build is broken for these settings") from None
        logprob_target[r] = cand_raw[targets[r]] - np.log(sums[r, Z_Q_EXACT])
        top_ids[r] = top_k_ids(logits)

    ref_rows = ref.iter_rows(n_vocab, runner.in_flight + 2)  # a row must outlive the task that reads it
    for start, rows, ends_call in cand.iter_logits():
        for k in range(len(rows)):
            r, ref_row, record = next(ref_rows)
            weights = (None, None)
            if ref_bands is not None and record is not None:  # the row's: per band [3, K], per token [1, 2]
                w = BandWeights.of(record)
                weights = (w.bands[:, 0], w.tokens.T)
            runner.submit(kernel, ref_row, rows[k], r, weights)
        if ends_call:  # the candidate's next rows come from a new decode call, which overwrites these
            runner.drain()
    runner.drain()
    if next(ref_rows, None) is not None:  # (running the reference to its end also reads its scalars)
        raise MismatchError(f"chunk {ref.index}: the live candidate gave fewer rows than the reference holds")
    return logprob_target, top_ids


def compare_chunk(ref: ChunkData, cand, tokens: np.ndarray, positions: np.ndarray, ref_tables,
                  cand_tables, n_vocab: int, kernel_pool: ThreadPoolExecutor | None = None,
                  samplers: sampler.Prepared | None = None, labels: WindowLabels | None = None,
                  bands: tuple[np.ndarray, np.ndarray | None] | None = None) -> dict[str, np.ndarray]:
    """Per-token metrics of one chunk pair. `tokens` is the chunk's n_ctx token ids, `positions` its scored
    logit positions (header.positions_of). `cand` is coded (a ChunkData, or read like one) or a live
    candidate's float32 rows (LiveLogitsChunk: has iter_logits). `labels`: a conversation capture's, adding
    the GROUP_FIELDS columns.

    With `kernel_pool`, token blocks go to its threads as they are decompressed (at most two
    blocks per thread in flight, so memory stays bounded). `samplers` (sampler.prepare) adds their
    per-token columns, computed on the same decompressed blocks (coded candidates only). `bands`: error_bands (None,
    or a coded candidate's None: the bound columns are NaN, "not recorded").
    """
    n = ref.n_tokens
    if cand.n_tokens != n:
        raise MismatchError(f"chunk {ref.index}: {n} scored tokens in the reference, {cand.n_tokens} in the candidate")
    sums = np.full((n, N_SUMS), np.nan)
    runner = KernelRunner(kernel_pool)
    sampled = samplers.new_output(n) if samplers is not None else None
    targets = tokens[positions + 1]
    live = hasattr(cand, "iter_logits")
    bounded = bands is not None and (live or bands[1] is not None)
    if live:
        if samplers is not None and samplers.kernel:
            raise ValueError("samplers read coded rows: open the live candidate with coded=True")
        cand_logprob_target, cand_top_ids = logit_sums(ref, cand, targets, ref_tables, n_vocab, sums, runner,
                                                       bands and bands[0])
    elif samplers is None and getattr(ref, "reads_uncoded", False):
        row_plane_sums(ref, cand, ref_tables, cand_tables, n_vocab, sums, bands if bounded else None)
        cand_logprob_target, cand_top_ids = cand.logprob_target, cand.top_ids
    else:
        plane_sums(ref, cand, ref_tables, cand_tables, n_vocab, sums, runner, samplers, sampled,
                   bands if bounded else None)
        cand_logprob_target, cand_top_ids = cand.logprob_target, cand.top_ids
    kld, kld_reverse = kld_from_sums(sums)
    if bounded:  # the stored forms' share, and what evaluating the KLD in float64 may add
        kld_bound, kld_reverse_bound = (sums[:, col] + ev for col, ev in zip((BOUND_FWD, BOUND_REV),
                                                                             evaluation_error(sums, n_vocab)))
    else:
        kld_bound = kld_reverse_bound = np.full(n, np.nan)
    out = {
        "chunk": np.full(n, ref.index, dtype=np.int32),
        "position": positions.astype(np.int32),  # the logit position: the context holds position + 1 tokens
        "token": targets.astype(np.int32),
        "kld": kld,
        "kld_reverse": kld_reverse,
        "nll_ref": -ref.logprob_target,
        "nll_cand": -cand_logprob_target,
        "p_ref": np.exp(ref.logprob_target),
        "p_cand": np.exp(cand_logprob_target),
        "same_top1": ref.top_ids[:, 0] == cand_top_ids[:, 0],
    }
    for k in TOPK_AGREEMENT:
        kk = min(k, ref.top_ids.shape[1], cand_top_ids.shape[1])  # tiny vocabs keep fewer ids
        overlap = (ref.top_ids[:, :kk, None] == cand_top_ids[:, None, :kk]).any(axis=2).sum(axis=1)
        out[f"top{k}_agreement"] = overlap / kk
    out.update(kld_bound=kld_bound, kld_reverse_bound=kld_reverse_bound, p_ref_top1=top1_probability(ref))
    if labels is not None:
        out["segment"] = labels.segment_codes(ref.index, positions, len(tokens)).astype(np.int16) - 1
        out["category"] = np.full(n, labels.category_of[ref.index], dtype=np.int16)
    if samplers is not None:
        out.update(sampler.chunk_columns(samplers, sampled, ref.top_ids[:, 0], cand_top_ids[:, 0]))
    return out


def top1_probability(ref: ChunkData) -> np.ndarray:
    """The reference's top-1 probability max_i p_ref(i) of each scored token of a chunk (the p_ref_top1 column)."""
    return np.exp(ref.logprob_max)


def with_top1(ref: LogitSource, index: int, columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A whole chunk's per-token columns with p_ref_top1, read from the reference where they lack it (a chunk
    compared by a qeval from before it kept the column: a matrix pair's checkpoint or saved result)."""
    if "p_ref_top1" in columns:
        return columns
    top1 = top1_probability(ref.read_chunk(index))
    if len(top1) != len(columns["kld"]):
        raise MismatchError(f"chunk {index}: {len(columns['kld'])} per-token rows, {len(top1)} in the reference")
    return {**columns, "p_ref_top1": top1}


def compare(ref: LogitSource, cand: LogitSource, n_chunks: int | None = None, threads: int = 2,
            on_chunk: Callable[[int], None] | None = None, samplers=(), order: Sequence[int] | None = None,
            after_chunk: Callable[[int, dict[str, np.ndarray]], bool | None] | None = None) -> Comparison:
    """KLD, PPL, top-1 ... of `cand` against `ref`, streaming chunk pairs over `threads` workers.

    A live candidate (a model decoding on all cores) is compared chunk after chunk instead, with
    the kernel spread over `threads`: a kernel thread beside llama.cpp's own threads would slow
    its forward pass far more than it gains.

    samplers: qeval.compare.sampler presets, settings strings or Sampler values; each adds per-token
    columns (TVD after the sampler chain ...) computed in the same pass.
    order: the chunks compared, in this order (default: every one of the first n_chunks, in order); a live
    candidate must be decoding the same ones (qeval.capture.capture.LiveSource.produce).
    after_chunk(index, columns): called in order, in this thread, as each chunk's per-token columns are done
    (a matrix pair checkpoints them); returning True stops the comparison after that chunk (the Comparison then
    holds the chunks done), so a caller can stop a pair as soon as it knows enough.
    """
    chunks = select_chunks(ref, cand, n_chunks)
    if order is not None:
        outside = sorted(set(order) - set(chunks))
        if outside:
            raise QevalError(f"chunk {outside[0]} is not among the {len(chunks)} chunks compared")
        chunks = list(order)
    n_vocab = ref.header.n_vocab
    ref_tables, cand_tables = decode_tables(ref.lut), decode_tables(cand.lut)
    threads = max(1, threads)
    live = getattr(cand, "live", False)
    bands = error_bands(ref, cand)
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
        return compare_chunk(read(ref, i, "ref"), read(cand, i, "cand"), ref.tokens[i], ref.header.positions_of(i),
                             ref_tables, cand_tables, n_vocab, kernel_pool, prepared, ref.header.window_labels, bands)

    parts = []
    try:
        # a live candidate: one chunk in flight, so that stopping after one decodes no further window
        with ThreadPoolExecutor(max_workers=1 if live else threads) as pool:
            for part in bounded_map(pool, one, chunks, 1 if live else 2 * threads):
                parts.append(part)
                if on_chunk:
                    on_chunk(1)
                if after_chunk is not None and after_chunk(chunks[len(parts) - 1], part):
                    break
    finally:  # also on an error: no kernel may outlive the live model whose logits it reads
        if kernel_pool is not None:
            kernel_pool.shutdown(wait=True, cancel_futures=True)
    return comparison_of(ref, cand, chunks[:len(parts)], parts)


def error_bands(ref: LogitSource, cand: LogitSource) -> tuple[np.ndarray, np.ndarray | None] | None:
    """(the reference's, the candidate's) band of each code, for the bound: None when the reference records no
    error (no bound), the candidate's None when it records none (a coded chunk of it is then not bounded; a live
    candidate read as float32 logits needs none: its own error is the kernel's to bound)."""
    def bands_of(source: LogitSource) -> np.ndarray | None:
        b = source.header.error_bands
        return None if b is None else b.band_of(source.lut)

    ref_bands = bands_of(ref)
    return None if ref_bands is None else (ref_bands, bands_of(cand))


def comparison_of(ref: LogitSource, cand: LogitSource, chunks: list[int], parts: list[dict[str, np.ndarray]],
                  early: dict | None = None) -> Comparison:
    """The Comparison of `chunks` from their per-token columns (compare_chunk's, one dict per chunk, in the same
    order): computed now, or read back from a pair's checkpoint (qeval.storage.checkpoint). early: the record of
    a board decided early whose sample `chunks` are (Comparison.early)."""
    if not parts:
        raise ValueError("a comparison needs at least one chunk")
    parts = [with_top1(ref, c, p) for c, p in zip(chunks, parts)]
    per_token = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    labels = ref.header.window_labels
    return Comparison(ref=ref, cand=cand, chunks=list(chunks), per_token=per_token,
                      label_names=labels.names() if labels is not None else None, early=early)
