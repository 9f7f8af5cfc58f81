"""A needle's answer scored against the reference run: only the answer's tokens, teacher-forced (docs/needles.md).

Per answer (float64 over the full vocabulary): KLD(reference || candidate) averaged over its tokens, both runs'
log-probability of the true answer, same-top-1 on every token, a flip where the candidate's argmax answer (argmax
at every answer position, as a sequence) differs from the reference's, and whether each run's argmax answer is the
true one. Per depth: agreement (answers that did not flip) and accuracies with Wilson intervals, KLD and the
log-probability change as mean ± SE over the answers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from qeval.compare.stats import mean_se, wilson_interval


@dataclass(frozen=True, kw_only=True)
class AnswerScore:
    kld: float  # mean over the answer's tokens
    ref_logprob: float  # log p(answer) under the reference (sum over its tokens)
    cand_logprob: float
    same_top1: int  # answer tokens whose argmax is the same in both runs
    tokens: int
    flip: bool
    ref_correct: bool
    cand_correct: bool


ANSWER_FIELDS = {f.name: {"float": float, "int": int, "bool": bool}[f.type] for f in fields(AnswerScore)}


def answer_json(depth: float, score: AnswerScore) -> dict:
    """A planted needle's answer as qeval.storage.needle_trials keeps it."""
    return {"depth": depth, **asdict(score)}


def answer_of(row: dict) -> tuple[float, AnswerScore]:
    """(depth, score) of a kept answer (its fields checked against ANSWER_FIELDS on read)."""
    return row["depth"], AnswerScore(**{name: row[name] for name in ANSWER_FIELDS})


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


def score_answer(ref_logits: np.ndarray, cand_logits: np.ndarray, answer: np.ndarray) -> AnswerScore:
    """ref_logits, cand_logits: [len(answer), n_vocab], row j the logits that predict answer[j]."""
    p, q = log_softmax(ref_logits), log_softmax(cand_logits)
    rows = np.arange(len(answer))
    kld = np.where(p > -np.inf, np.exp(p) * (p - q), 0.0).sum(axis=-1)
    ref_top, cand_top = p.argmax(axis=-1), q.argmax(axis=-1)
    return AnswerScore(kld=float(kld.mean()), ref_logprob=float(p[rows, answer].sum()),
                       cand_logprob=float(q[rows, answer].sum()), same_top1=int((ref_top == cand_top).sum()),
                       tokens=len(answer), flip=not np.array_equal(ref_top, cand_top),
                       ref_correct=np.array_equal(ref_top, answer), cand_correct=np.array_equal(cand_top, answer))


def proportion(hits: int, n: int) -> dict:
    lo, hi = wilson_interval(hits, n)
    return {"hits": hits, "n": n, "p": hits / n if n else float("nan"), "lo": lo, "hi": hi}


def summarize_answers(scores: list[AnswerScore]) -> dict:
    """One depth's (or every depth's) answers, with intervals."""
    n = len(scores)
    kld, kld_se = mean_se(np.array([s.kld for s in scores]))
    delta, delta_se = mean_se(np.array([s.cand_logprob - s.ref_logprob for s in scores]))
    return {"answers": n, "agreement": proportion(sum(not s.flip for s in scores), n),
            "same_top1": proportion(sum(s.same_top1 for s in scores), sum(s.tokens for s in scores)),
            "kld": {"mean": kld, "se": kld_se}, "logprob_delta": {"mean": delta, "se": delta_se},
            "ref_accuracy": proportion(sum(s.ref_correct for s in scores), n),
            "cand_accuracy": proportion(sum(s.cand_correct for s in scores), n)}
