"""Score every choice of a task set the way llama-perplexity does (tools/perplexity/perplexity.cpp).

Per task, every choice's text is tokenized with BOS and without special-token parsing
(common_tokenize(ctx, text, true)); the tokens the choices share from the start are the common
prefix. llama-perplexity decodes the prefix once for all choices (one sequence per choice, the prefix
tokens belonging to all of them), then each choice's remaining tokens, and packs as many tasks into one
batch as its context and sequence count allow. qeval builds the very same batches (same tokens,
positions, sequence ids, output rows, task order and packing), so llama.cpp computes the same logits.
Each token's log-probability is log-softmax(logits)[token], computed in float64, and again in
llama-perplexity's float32 arithmetic (ChoiceScores.llama), on which the answer is decided; only the
rows a score needs, read in llama.cpp's logits buffer, on as many threads as the model runs on (as
llama-perplexity's compute_logprobs runs on every core). With layout "separate" every choice is decoded
alone instead (see LAYOUTS): the same tokens are scored, but the log-likelihoods no longer depend on
what else shares a decode call.

  hellaswag (hellaswag_score), mc (multiple_choice_score): a choice's score is the mean log-prob of
      its tokens after the common prefix (the first from the logits of the prefix's last token). The
      choice with the highest score is the answer (the first one on a tie).
  winogrande (winogrande_score): when both choices have more than 3 tokens after the common prefix,
      only the tokens after "text before the blank + option" count (n_base = its token count), else
      those after the common prefix; the last token is left out when more than one would count; the
      score is their mean log-prob. Answer 1 when score 1 > score 2, else 2. llama-perplexity's
      "FIXME": when the choice is not skipped, choice 2's first token is scored from the logits of
      choice 1's last token; qeval reproduces that, so its accuracy is llama-perplexity's.

Order and selection are llama-perplexity's too: HellaSwag tasks are always shuffled (std::mt19937
seeded 1, std::uniform_int_distribution as libstdc++ computes it) and `limit` of them are taken
(--hellaswag-tasks); Winogrande and multiple-choice tasks are taken in file order, or `limit` of them
drawn with mt19937(1) as --winogrande-tasks / --multiple-choice-tasks do. With the default -np 4 a
HellaSwag batch holds one task, so its logits do not depend on the order at all.

Tasks llama-perplexity would score from memory it does not own (a choice whose tokens are all in the
common prefix, choices without a common first token, a Winogrande choice with nothing left to score)
are refused with a QevalError naming the task.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numba
import numpy as np

from qeval.engine.engine import ContextShape, EngineSettings, LlamaModel
from qeval.errors import QevalError
from qeval.inputs.taskfiles import TaskItem, TaskSet

# Bump when a change here moves a stored score: task stores of another version are then refused.
SCORING_VERSION = 1

WINOGRANDE_MIN_TRAILING = 3  # k_min_trailing_ctx
MAX_TASKS_PER_BATCH = {"hellaswag": 32, "winogrande": 128, "mc": 32}
SEQS_PER_TASK_CAP = {"hellaswag": 4, "winogrande": 2, "mc": 4}  # max_seq = min(cap * max_tasks, n_seq_max)


# How choices are laid out in decode calls. In llama-perplexity's (shared prefix, several choices and tasks in
# one call over a unified KV cache), a choice's logits depend on what else is in its call, not only on its
# own tokens: measured on this llama.cpp (0c1e57098bba, CPU) with Gemma-3-270M, the mean log-prob of a
# choice moves by up to 0.1 nats per token against decoding it alone (median 0 to 2e-3 depending on the
# quant; the first sequence of a call is exact with -fa off); ggml-org/llama.cpp#24962 reports a similar
# effect. "separate" decodes every choice alone (prefix included, non-unified cache): equal to a plain
# single-sequence decode to ~1e-8, ~3.5x the decode work on HellaSwag.
LAYOUTS = ("llama", "separate")


# --------------------------------------------------------------------------------------------------
# settings
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TaskSettings:
    """llama-perplexity's task settings: -c (per sequence), -np, -b, -ub, and the KV cache/attention."""

    engine: EngineSettings = EngineSettings()
    n_ctx: int = 512  # -c; the context holds n_parallel * n_ctx tokens
    n_parallel: int = 4  # -np; llama-perplexity raises it to 4 at least for tasks
    n_batch: int = 2048  # -b
    n_ubatch: int = 512  # -ub
    # "llama": llama-perplexity's batches (shared prefix, one unified KV cache), bit for bit its numbers.
    # "separate": every choice decoded alone, in its own calls: each choice's log-likelihood is that of a
    # single-sequence decode (see LAYOUTS).
    layout: str = "llama"

    def validate(self) -> TaskSettings:
        self.engine.validate()
        if self.layout not in LAYOUTS:
            raise QevalError(f"--layout must be one of {', '.join(LAYOUTS)}, not {self.layout!r}")
        for flag, value in (("-c/--ctx", self.n_ctx), ("-np/--parallel", self.n_parallel),
                            ("-b/--batch-size", self.n_batch), ("-ub/--ubatch-size", self.n_ubatch)):
            if value < 1:
                raise QevalError(f"{flag} must be at least 1")
        return self

    @property
    def parallel(self) -> int:
        return max(4, self.n_parallel)

    @property
    def context(self) -> int:
        return self.parallel * self.n_ctx

    @property
    def batch(self) -> int:
        return min(self.n_batch, self.context)

    @property
    def ubatch(self) -> int:
        return min(self.n_ubatch, self.batch)

    def as_json(self) -> dict:
        """Everything here that can change a logit (not where it runs: -ngl, threads)."""
        return {"kv": self.engine.as_json(), "n_ctx": self.n_ctx, "n_parallel": self.parallel,
                "n_batch": self.batch, "n_ubatch": self.ubatch, "layout": self.layout,
                "kv_unified": self.layout == "llama"}


# --------------------------------------------------------------------------------------------------
# llama-perplexity's task order (mt19937 and libstdc++'s uniform_int_distribution)
# --------------------------------------------------------------------------------------------------
def mt19937(seed: int = 1) -> random.Random:
    """std::mt19937(seed): Python's generator is the same MT19937, seeded here as C++ seeds it."""
    mt = [seed & 0xFFFFFFFF]
    for i in range(1, 624):
        mt.append((1812433253 * (mt[-1] ^ (mt[-1] >> 30)) + i) & 0xFFFFFFFF)
    rng = random.Random()
    rng.setstate((3, tuple(mt) + (624,), None))
    return rng


def uniform_below(rng: random.Random, n: int) -> int:
    """std::uniform_int_distribution<size_t>(0, n-1)(mt19937) as libstdc++ (GCC 11+) computes it:
    Lemire's nearly divisionless method on 32-bit draws."""
    if not 1 <= n <= 0xFFFFFFFF:
        raise ValueError("n out of range")
    product = rng.getrandbits(32) * n
    low = product & 0xFFFFFFFF
    if low < n:
        threshold = (0x100000000 - n) % n
        while low < threshold:
            product = rng.getrandbits(32) * n
            low = product & 0xFFFFFFFF
    return product >> 32


def task_order(kind: str, n_items: int, limit: int | None) -> list[int]:
    """The item indices llama-perplexity scores, in its order, with --*-tasks `limit` (None: all)."""
    if limit is not None and limit < 1:
        raise QevalError("--limit must be at least 1")
    count = n_items if limit is None else min(limit, n_items)
    rng = mt19937(1)
    if kind == "hellaswag":  # always shuffled (randomize_tasks = true)
        remaining = list(range(n_items))
        return [remaining.pop(uniform_below(rng, len(remaining))) for _ in range(count)]
    if count >= n_items:
        return list(range(n_items))
    scale = np.float32(1.0) / (np.float32(1.0) + np.float32(0xFFFFFFFF))  # 2^-32
    aux, out = list(range(n_items)), []
    for _ in range(count):
        j = int(np.float32(np.float32(scale * np.float32(rng.getrandbits(32))) * np.float32(len(aux))))
        j = min(j, len(aux) - 1)  # float rounding can reach len(aux), where llama.cpp reads past its end
        out.append(aux[j])
        aux[j] = aux[-1]
        aux.pop()
    return out


# --------------------------------------------------------------------------------------------------
# plans: what is decoded and which log-probs make each choice's score
# --------------------------------------------------------------------------------------------------
Row = tuple[int, int]  # (sequence: choice index, or -1 for the common prefix; position)


@dataclass
class ItemPlan:
    item: TaskItem
    seqs: list[np.ndarray]
    prefix: int  # tokens common to every choice
    outputs: list[list[int]]  # per choice: positions whose logits are requested
    terms: list[list[tuple[Row, int]]]  # per choice: (logits row, token) pairs whose log-probs are averaged

    @property
    def required(self) -> int:
        return self.prefix + sum(len(s) - self.prefix for s in self.seqs)


def common_prefix(seqs: list[np.ndarray]) -> int:
    n = min(len(s) for s in seqs)
    first = seqs[0][:n]
    same = np.ones(n, dtype=bool)
    for s in seqs[1:]:
        same &= s[:n] == first
    bad = np.flatnonzero(~same)
    return int(bad[0]) if len(bad) else n


def plan_item(kind: str, item: TaskItem, tokenize: Callable[[str], np.ndarray], where: str,
              layout: str = "llama", max_len: int | None = None) -> ItemPlan:
    """What to decode for one task and which log-probs make each choice's score: llama-perplexity's rules.
    Layout "separate" scores the same tokens, each choice decoded whole as its own sequence (its own rows
    throughout: no shared prefix row, and no FIXME row for Winogrande)."""
    seqs = [np.asarray(tokenize(t), dtype=np.int32) for t in item.texts(kind)]
    cp = common_prefix(seqs)
    what = f"{where}: task {item.index} ({item.where})"
    if cp == 0:
        raise QevalError(f"{what}: its choices share no first token (no BOS?); llama-perplexity cannot score it")
    for s, seq in enumerate(seqs):
        if len(seq) == cp:
            raise QevalError(f"{what}: choice {s} tokenizes into the tokens every choice starts with, so it has no "
                             "token of its own to score (llama-perplexity would read past its end)")
        if layout == "separate" and max_len is not None and len(seq) > max_len:
            raise QevalError(f"{what}: choice {s} has {len(seq)} tokens, more than -c {max_len}")
    separate = layout == "separate"

    def row(s: int, j: int) -> Row:
        """The logits that predict token j + 1 of choice s."""
        if j >= cp or separate:
            return (s, j)
        if s == 0 or kind != "winogrande":
            return (-1, cp - 1)  # the prefix's last token, shared
        return (0, len(seqs[0]) - 1)  # perplexity.cpp's FIXME: choice 2 reads choice 1's last row

    spans = []  # per choice: the positions j whose logits score token j + 1
    if kind != "winogrande":
        spans = [range(cp - 1, len(seq) - 1) for seq in seqs]
    else:
        skip = all(len(seq) - cp > WINOGRANDE_MIN_TRAILING for seq in seqs)
        for s, seq in enumerate(seqs):
            base = len(tokenize(item.context + item.choices[s])) if skip else cp
            last = 1 if len(seq) - base > 1 else 0
            if base < cp or len(seq) - base - last < 1:
                raise QevalError(f"{what}: option {s + 1} leaves no tokens to score after the blank "
                                 f"({len(seq)} tokens, {base} before the text that follows it, {cp} shared)")
            spans.append(range(base - 1, len(seq) - 1 - last))
    terms = [[(row(s, j), int(seqs[s][j + 1])) for j in span] for s, span in enumerate(spans)]
    if separate:
        outputs = [list(span) for span in spans]
        return ItemPlan(item=item, seqs=seqs, prefix=0, outputs=outputs, terms=terms)
    if kind != "winogrande":  # logits of every choice token but the last (and of the prefix's last)
        outputs = [list(range(cp, len(seq) - 1)) for seq in seqs]
    else:  # winogrande asks for every token after the prefix
        outputs = [list(range(cp, len(seq))) for seq in seqs]
    return ItemPlan(item=item, seqs=seqs, prefix=cp, outputs=outputs, terms=terms)


def pack(kind: str, plans: list[ItemPlan], n_ctx: int, n_seq_max: int, where: str = "") -> list[list[int]]:
    """Consecutive plans decoded in one batch, as llama-perplexity packs them into its n_ctx context."""
    max_seq = min(SEQS_PER_TASK_CAP[kind] * MAX_TASKS_PER_BATCH[kind], n_seq_max)
    groups, i0 = [], 0
    while i0 < len(plans):
        n_cur, i1, s0 = 0, i0, 0
        while n_cur + plans[i1].required <= n_ctx:
            n_choices = len(plans[i1].seqs)
            if s0 + n_choices > max_seq:
                if s0 == 0:
                    raise QevalError(f"{where}: task {plans[i1].item.index} has {n_choices} choices; give -np "
                                     f"{n_choices} or more (one sequence per choice)")
                break
            s0 += n_choices
            n_cur += plans[i1].required
            i1 += 1
            if i1 == len(plans):
                break
        if i0 == i1:
            raise QevalError(f"{where}: task {plans[i0].item.index} needs {plans[i0].required} tokens, more than "
                             f"the context of {n_ctx} (-np x -c): raise -c")
        groups.append(list(range(i0, i1)))
        i0 = i1
    return groups


# --------------------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChoiceScores:
    """Per-choice log-likelihoods of one task.

    sums / counts: exact (float64) sums of the scored tokens' log-probs and how many there are.
    llama: each choice's score as llama-perplexity computes it, in its arithmetic (float32 log-softmax
    with a sequential float32 sum over the vocab; float or double accumulation as the task's code
    has it): what the answer is decided on, so that accuracies equal llama-perplexity's even on near
    ties. The two differ by ~1e-4 (float32 summation over a 262K vocab loses the far tail).
    """

    index: int
    sums: tuple[float, ...]
    counts: tuple[int, ...]
    llama: tuple[float, ...]
    labels: tuple[int, ...]

    @property
    def means(self) -> tuple[float, ...]:
        return tuple(s / n for s, n in zip(self.sums, self.counts))


def llama_score(kind: str, values: list[tuple[float, float, float]]) -> float:
    """One choice's score in llama-perplexity's arithmetic from (exact, logprob32, softmax32) per token."""
    if kind == "hellaswag":  # double accumulator (hs_data_t::ending_logprob), divided by a size_t
        acc = float(values[0][2])
        for v in values[1:]:
            acc += float(v[1])
        return acc / len(values)
    f32 = np.float32
    if kind == "mc":  # float log_prob, float division by the count
        acc = f32(values[0][2])
        for v in values[1:]:
            acc = f32(acc + f32(v[1]))
        return float(f32(acc / f32(len(values))))
    acc = f32(0.0)  # winogrande: float score_1st / score_2nd
    for v in values:
        acc = f32(acc + f32(v[1]))
    return float(f32(acc / f32(len(values))))


def score_items(kind: str, plans: list[ItemPlan], group: list[int], row_logprobs: Callable) -> list[ChoiceScores]:
    """ChoiceScores of the plans in `group` from row_logprobs(local item, row) -> {token: (exact, logprob32,
    softmax32)} (see log_softmax_at)."""
    out = []
    for local, i in enumerate(group):
        p = plans[i]
        sums, counts, llama = [], [], []
        for terms in p.terms:
            values = [row_logprobs(local, row)[tok] for row, tok in terms]
            sums.append(float(np.sum(np.asarray([v[0] for v in values], dtype=np.float64))))
            counts.append(len(values))
            llama.append(llama_score(kind, values))
        out.append(ChoiceScores(index=p.item.index, sums=tuple(sums), counts=tuple(counts), llama=tuple(llama),
                                labels=p.item.labels))
    return out


ROWS_PER_PASS = 4  # rows summed side by side: four independent chains of additions hide the adder's latency


@numba.njit(nogil=True, cache=True)
def _sequential_sums(e, sums32, sums64):  # pragma: no cover - compiled
    """Sum each row of e [ROWS_PER_PASS, V] (float32 exponentials) one element after the other from the first,
    in float32 (compute_logprobs' loop) and in float64 (softmax()): the order of np.add.accumulate, so bit
    for bit its last element. No fastmath: the additions must not be reordered."""
    n = e.shape[1]
    a0 = a1 = a2 = a3 = np.float32(0.0)
    b0 = b1 = b2 = b3 = 0.0
    for j in range(n):
        v0, v1, v2, v3 = e[0, j], e[1, j], e[2, j], e[3, j]
        a0 += v0
        a1 += v1
        a2 += v2
        a3 += v3
        b0 += v0
        b1 += v1
        b2 += v2
        b3 += v3
    sums32[0], sums32[1], sums32[2], sums32[3] = a0, a1, a2, a3
    sums64[0], sums64[1], sums64[2], sums64[3] = b0, b1, b2, b3


_exp_buffers = threading.local()  # each scoring thread's [ROWS_PER_PASS, V] exponentials, reused across calls


def _exp_buffer(n_vocab: int) -> np.ndarray:
    buf = getattr(_exp_buffers, "buf", None)
    if buf is None or buf.shape[1] != n_vocab:
        buf = _exp_buffers.buf = np.empty((ROWS_PER_PASS, n_vocab), dtype=np.float32)
    return buf


def _log_softmax_pass(rows: np.ndarray, picked: list[int], targets: list[list[int]]
                      ) -> list[list[tuple[float, float, float]]]:
    """log_softmax_at's values for up to ROWS_PER_PASS rows `picked` of `rows`."""
    e = _exp_buffer(rows.shape[1])
    sums32 = np.empty(ROWS_PER_PASS, dtype=np.float32)
    sums64 = np.empty(ROWS_PER_PASS, dtype=np.float64)
    maxima, e_at = [], []
    for k, r in enumerate(picked):
        mx = rows[r].max()
        np.exp(np.subtract(rows[r], mx, out=e[k]), out=e[k])  # float32, as expf
        maxima.append(mx)
        e_at.append(e[k, targets[r]])  # read now: the buffer is the next pass's
    _sequential_sums(e, sums32, sums64)  # rows of e past len(picked) hold stale values, their sums unused
    f32 = np.float32
    out = []
    for k, r in enumerate(picked):
        row, mx, sum32, sum64 = rows[r], maxima[k], sums32[k], sums64[k]
        log64 = float(np.log(sum64))
        vals = []
        for tok, e_tok in zip(targets[r], e_at[k]):
            exact = float(row[tok]) - float(mx) - log64
            logprob32 = f32(f32(row[tok] - mx) - np.log(sum32))
            softmax32 = np.log(f32(e_tok / sum64))
            vals.append((exact, float(logprob32), float(softmax32)))
        out.append(vals)
    return out


def log_softmax_at(rows: np.ndarray, targets: list[list[int]], pool: ThreadPoolExecutor | None = None
                   ) -> list[list[tuple[float, float, float]]]:
    """Per float32 logits row [V] and target token: (log-softmax with a float64 sum, llama-perplexity's
    compute_logprobs value, its softmax()-then-log value), the last two in its float32 arithmetic.
    The first sums the float32 exponentials in float64: within ~1e-7 of an all-float64 log-softmax.
    Rows without targets are skipped (an empty list), so `rows` can be llama.cpp's logits as they are;
    passes of ROWS_PER_PASS rows run on `pool` (numpy and the summing kernel release the GIL)."""
    wanted = [r for r, tokens in enumerate(targets) if tokens]
    passes = [wanted[a:a + ROWS_PER_PASS] for a in range(0, len(wanted), ROWS_PER_PASS)]
    run = pool.map if pool is not None else map
    out: list[list[tuple[float, float, float]]] = [[] for _ in targets]
    for picked, values in zip(passes, run(lambda picked: _log_softmax_pass(rows, picked, targets), passes)):
        for r, vals in zip(picked, values):
            out[r] = vals
    return out


# --------------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------------
@dataclass
class _Token:
    token: int
    pos: int
    seqs: tuple[int, ...]
    output: bool
    key: tuple[int, int, int] = field(default=(0, 0, 0))  # (local item, sequence or -1, position)


class TaskModel(LlamaModel):
    """A GGUF model with llama-perplexity's task context: n_parallel sequences over one unified KV
    cache of n_parallel x n_ctx cells."""

    def __init__(self, model_path: str | os.PathLike, settings: TaskSettings = TaskSettings()):
        s, e = settings.validate(), settings.engine
        self.task_settings = s
        self._scorers: ThreadPoolExecutor | None = None
        super().__init__(model_path, e, ContextShape(
            n_ctx_seq=s.n_ctx, n_seq=s.parallel, n_batch=s.batch, n_ubatch=s.ubatch, kv_unified=s.layout == "llama",
            described=f"(n_ctx {s.context}, -np {s.parallel}, KV {e.type_k}/{e.type_v}, flash attention "
                      f"{e.flash_attn})"))
        self.n_ctx = int(self._lc.llama_n_ctx(self.ctx))  # what llama-perplexity packs into
        self.n_seq_max = int(self._lc.llama_n_seq_max(self.ctx))
        self.n_batch = s.batch
        # log-softmax between decodes on as many threads as the model (llama-perplexity uses every core)
        self._scorers = ThreadPoolExecutor(max_workers=self.n_threads, thread_name_prefix="qeval-logsoftmax")

    # -- decoding --------------------------------------------------------------------------------
    @staticmethod
    def batch_tokens(kind: str, plans: list[ItemPlan], group: list[int]) -> list[_Token]:
        """The tokens of one llama-perplexity batch, in its order."""
        toks: list[_Token] = []
        s0 = 0
        for local, i in enumerate(group):
            p = plans[i]
            n = len(p.seqs)
            ids = tuple(range(s0, s0 + n))
            for j in range(p.prefix):
                toks.append(_Token(token=int(p.seqs[0][j]), pos=j, seqs=ids, output=j == p.prefix - 1, key=(local, -1,
                                                                                                            j)))
            for s, seq in enumerate(p.seqs):
                wanted = set(p.outputs[s])
                for j in range(p.prefix, len(seq)):
                    toks.append(_Token(token=int(seq[j]), pos=j, seqs=(s0 + s,), output=j in wanted, key=(local, s, j)))
            s0 += n
        return toks

    def decode_group(self, kind: str, plans: list[ItemPlan], group: list[int]) -> list[ChoiceScores]:
        toks = self.batch_tokens(kind, plans, group)
        needed: dict[tuple[int, int, int], set[int]] = {}
        for local, i in enumerate(group):
            for terms in plans[i].terms:
                for (seq, pos), tok in terms:
                    needed.setdefault((local, seq, pos), set()).add(tok)
        logprobs: dict[tuple[int, int, int], dict[int, float]] = {}
        if self.task_settings.layout == "separate":  # each choice alone in its decode calls, as sequence 0
            runs: dict[tuple[int, int], list[_Token]] = {}
            for t in toks:
                runs.setdefault(t.key[:2], []).append(_Token(token=t.token, pos=t.pos, seqs=(0,), output=t.output,
                                                             key=t.key))
            batches = list(runs.values())
        else:
            batches = [toks]
        for batch in batches:
            self._decode_batch(batch, needed, logprobs)
        return score_items(kind, plans, group, lambda local, row: logprobs[(local, *row)])

    def _decode_batch(self, toks: list[_Token], needed: dict, logprobs: dict) -> None:
        """One llama-perplexity batch: memory cleared, decoded in pieces of n_batch tokens (decode_helper)."""
        self.clear_memory()
        for a in range(0, len(toks), self.n_batch):
            piece = toks[a:a + self.n_batch]
            b = self._batch
            for k, t in enumerate(piece):
                b.token[k] = t.token
                b.pos[k] = t.pos
                b.n_seq_id[k] = len(t.seqs)
                for m, sid in enumerate(t.seqs):
                    b.seq_id[k][m] = sid
                b.logits[k] = 1 if t.output else 0
            b.n_tokens = len(piece)
            self.decode()
            out_keys = [t.key for t in piece if t.output]
            if not out_keys:
                continue
            logits = self.output_logits(len(out_keys))  # read in place: valid until the next decode
            targets = [sorted(needed.get(key, ())) for key in out_keys]
            for key, tg, lp in zip(out_keys, targets, log_softmax_at(logits, targets, self._scorers)):
                if tg:
                    logprobs[key] = dict(zip(tg, lp))

    def close(self) -> None:
        if self._scorers is not None:
            self._scorers.shutdown()
            self._scorers = None
        super().close()


def plan_tasks(model: TaskModel, tasks: TaskSet, order: list[int]) -> list[ItemPlan]:
    s = model.task_settings
    return [plan_item(tasks.kind, tasks.items[i], model.tokenize, tasks.source, s.layout, s.n_ctx) for i in order]
