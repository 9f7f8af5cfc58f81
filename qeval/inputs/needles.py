"""Needles in a haystack: short facts planted at set depths of a long window of a corpus, a question per fact
asked after it (docs/needles.md).

A needle file is JSON lines, one object per needle: {"fact": ..., "question": ..., "answer": ...} (other keys are
ignored). The shipped suite is corpora/needles.jsonl (installed as qeval.corpora), invented facts that no corpus
holds.

A trial's window: BOS (where the vocabulary adds one), then the haystack, a stretch of the corpus's tokens starting
at a seeded offset, with one fact per depth planted in it, each at depth % of the prefix (give or take a seeded
jitter). Each question is then asked on its own after that prefix, as QUESTION then the answer's tokens
(ANSWER), teacher-forced: the continuation decoded is the question and every answer token but the last, and the
logits of its last len(answer) positions are those that predict the answer. The prefix is as long as the window
leaves after the longest continuation, so every question fits in n_ctx.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from qeval.errors import QevalError
from qeval.inputs.corpus import shipped_dir

SHIPPED_NEEDLES = "needles"  # the shipped suite's name (corpora/needles.jsonl)
FIELDS = ("fact", "question", "answer")
DEFAULT_DEPTHS = (5.0, 25.0, 50.0, 75.0, 95.0)
DEFAULT_JITTER = 2.0  # percent of the prefix each fact moves at most, either way, from its depth
MIN_HAYSTACK = 64  # tokens of corpus a window must hold besides the facts and questions
FACT = "\n{fact}\n"
QUESTION = "\n\nQuestion: {question}\nAnswer:"
ANSWER = " {answer}"


@dataclass(frozen=True)
class Needle:
    fact: str
    question: str
    answer: str


@dataclass(frozen=True)
class Planted:
    """One needle of a trial: where its fact is, and the continuation that asks for it."""

    needle: Needle
    depth: float  # as asked, percent of the prefix
    position: int  # the fact's first token in the window
    question: np.ndarray  # its question's tokens, asked after the prefix
    answer: np.ndarray  # its answer's tokens, teacher-forced after the question

    @property
    def continuation(self) -> np.ndarray:
        """What is decoded after the prefix: the question and the answer but its last token."""
        return np.concatenate([self.question, self.answer[:-1]]).astype(np.int32)

    @property
    def first_scored(self) -> int:
        """The continuation's first position whose logits predict the answer (its question's last token)."""
        return len(self.question) - 1


@dataclass(frozen=True)
class Trial:
    index: int
    offset: int  # where the haystack starts in the corpus's tokens
    prefix: np.ndarray  # int32: BOS, the haystack with the facts planted
    planted: tuple[Planted, ...]  # in depth order

    def forward_tokens(self) -> tuple[int, int]:
        """(tokens decoded with the prefix once and each question from its state, tokens one window per question
        decodes): P + sum(c_i) against sum(P + c_i)."""
        tails = sum(len(p.continuation) for p in self.planted)
        return len(self.prefix) + tails, len(self.planted) * len(self.prefix) + tails


def load_needles(spec: str | None = None) -> tuple[str, list[Needle]]:
    """(source, needles) of a needle file, or of the shipped suite for None or `needles`."""
    if spec in (None, SHIPPED_NEEDLES):
        return f"corpora/{SHIPPED_NEEDLES}.jsonl", parse_needles(
            (shipped_dir() / f"{SHIPPED_NEEDLES}.jsonl").read_text(encoding="utf-8"), "the shipped needles")
    path = Path(spec)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise QevalError(f"needle file {path} does not exist") from None
    except UnicodeDecodeError as exc:
        raise QevalError(f"needle file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise QevalError(f"cannot read needle file {path}: {exc.strerror}") from None
    return str(path), parse_needles(text, str(path))


def parse_needles(text: str, source: str) -> list[Needle]:
    """The needles of JSON-lines text (blank lines skipped); a bad line refused with its number."""
    needles = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise QevalError(f"{source} line {number}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise QevalError(f"{source} line {number}: expected an object with {', '.join(FIELDS)}")
        bad = [f for f in FIELDS if not isinstance(row.get(f), str) or not row[f].strip()]
        if bad:
            raise QevalError(f"{source} line {number}: {', '.join(bad)} must be non-empty text "
                             f"(a needle is {{\"fact\": ..., \"question\": ..., \"answer\": ...}})")
        needles.append(Needle(**{f: row[f].strip() for f in FIELDS}))
    if not needles:
        raise QevalError(f"{source} holds no needle")
    return needles


def parse_depths(text: str | None) -> tuple[float, ...]:
    """Depths in percent from "5,25,50" (None: DEFAULT_DEPTHS), ascending; each within 0-100."""
    if text is None:
        return DEFAULT_DEPTHS
    try:
        depths = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise QevalError(f"--depths {text}: expected percentages separated by commas, e.g. 5,25,50,75,95") from None
    wrong = [d for d in depths if not 0 <= d <= 100]
    if not depths or wrong:
        raise QevalError(f"--depths {text}: every depth is a percentage of the window, 0 to 100"
                         + (f" ({', '.join(f'{d:g}' for d in wrong)} is not)" if wrong else ""))
    return tuple(sorted(set(depths)))


def plant_trials(haystack: np.ndarray, tokenize: Callable[[str], np.ndarray], bos: int | None,
                 needles: list[Needle], *, depths: tuple[float, ...], n_ctx: int, trials: int, seed: int = 0,
                 jitter: float = DEFAULT_JITTER) -> list[Trial]:
    """`trials` trials for windows of n_ctx tokens (the module's docstring): trial t draws from
    default_rng([seed, t]) its needles (one per depth, none twice), their jitter and the haystack's offset in
    `haystack` (the corpus's tokens, no BOS). tokenize: text -> tokens without BOS."""
    if trials < 1:
        raise QevalError(f"--trials must be at least 1, not {trials}")
    if len(needles) < len(depths):
        raise QevalError(f"{len(depths)} depths need as many needles per trial; the needle file has {len(needles)} "
                         "(give fewer --depths, or more needles)")
    facts = [tokenize(FACT.format(fact=n.fact)) for n in needles]
    questions = [tokenize(QUESTION.format(question=n.question)) for n in needles]
    answers = [tokenize(ANSWER.format(answer=n.answer)) for n in needles]
    return [_trial(t, np.random.default_rng([seed, t]), haystack, bos, needles, facts, questions, answers, depths,
                   n_ctx, jitter) for t in range(trials)]


def _trial(index, rng, haystack, bos, needles, facts, questions, answers, depths, n_ctx, jitter) -> Trial:
    chosen = rng.choice(len(needles), size=len(depths), replace=False)
    head = [] if bos is None else [bos]
    tail = max(len(questions[i]) + len(answers[i]) - 1 for i in chosen)
    prefix_len = n_ctx - tail
    hay_len = prefix_len - len(head) - sum(len(facts[i]) for i in chosen)
    if hay_len < MIN_HAYSTACK:
        raise QevalError(f"n_ctx {n_ctx} is too small for {len(depths)} needles: their facts and the longest "
                         f"question take {n_ctx - len(head) - hay_len} tokens, leaving {max(hay_len, 0)} of the "
                         f"{MIN_HAYSTACK} haystack tokens needed at least (use a larger -c or fewer --depths)")
    if len(haystack) < hay_len:
        raise QevalError(f"the corpus tokenizes to {len(haystack)} tokens; a window of n_ctx {n_ctx} needs "
                         f"{hay_len} of them (use a longer corpus or a smaller -c)")
    offset = int(rng.integers(0, len(haystack) - hay_len + 1))
    hay = haystack[offset:offset + hay_len]
    spread = round(jitter / 100 * prefix_len)
    pieces, planted, cut, position = [np.asarray(head, np.int32)], [], 0, len(head)
    for depth, i in zip(depths, chosen):
        target = round(depth / 100 * (prefix_len - len(facts[i]))) + int(rng.integers(-spread, spread + 1))
        at = min(max(target - position + cut, cut), hay_len)  # where in the haystack: in order, never past it
        pieces += [hay[cut:at], facts[i]]
        position += at - cut
        planted.append(Planted(needle=needles[i], depth=depth, position=position, question=questions[i],
                               answer=answers[i]))
        position += len(facts[i])
        cut = at
    pieces.append(hay[cut:])
    return Trial(index=index, offset=offset, prefix=np.concatenate(pieces).astype(np.int32), planted=tuple(planted))
