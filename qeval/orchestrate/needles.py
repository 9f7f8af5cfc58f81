"""`qeval needle`: needles at depth, the reference and every candidate over the same trials (docs/needles.md).

Every model is opened once per n_ctx (a PrefixModel each); each trial's prefix is decoded once per model, each
question continued after it; each candidate's answers are scored against the reference's as they come, so no
trial's logits outlive it."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qeval.compare.needle_scores import score_answer, summarize_answers
from qeval.engine.engine import EngineSettings
from qeval.engine.modelinfo import content_fingerprint
from qeval.engine.prefix import PrefixModel
from qeval.errors import QevalError
from qeval.inputs.corpus import load_corpus
from qeval.inputs.needles import load_needles, plant_trials


@dataclass(frozen=True, kw_only=True)
class Run:
    label: str
    model: str  # GGUF path
    settings: EngineSettings


@dataclass(frozen=True, kw_only=True)
class NeedleRequest:
    reference: Run
    candidates: tuple[Run, ...]
    contexts: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int
    needles: str | None = None  # a needle file; None: the shipped suite
    corpus: str | None = None
    seed: int = 0
    jitter: float = 2.0


def run_needles(request: NeedleRequest, say=lambda line: None) -> dict:
    source, needles = load_needles(request.needles)
    corpus = load_corpus(request.corpus)
    out = {"reference": request.reference.label, "needles": {"source": source, "count": len(needles)},
           "corpus": corpus.name, "depths": list(request.depths), "trials": request.trials, "seed": request.seed,
           "contexts": []}
    for n_ctx in request.contexts:
        out["contexts"].append(_one_context(request, needles, corpus, n_ctx, say))
    return out


def _one_context(request, needles, corpus, n_ctx, say) -> dict:
    runs = (request.reference, *request.candidates)
    with contextlib.ExitStack() as stack:
        models = [stack.enter_context(PrefixModel(r.model, r.settings, n_ctx)) for r in runs]
        ref = models[0]
        for run, model in zip(runs[1:], models[1:]):
            if model.tokenizer_fingerprint() != ref.tokenizer_fingerprint():
                raise QevalError(f"{run.label} has another tokenizer than the reference: its answers cannot be "
                                 "compared token by token")
        trials = plant_trials(ref.tokenize(corpus.text, add_special=False), lambda t: ref.tokenize(t, False),
                              ref.bos if ref.add_bos else None, needles, depths=request.depths, n_ctx=n_ctx,
                              trials=request.trials, seed=request.seed, jitter=request.jitter)
        scores = [defaultdict(list) for _ in request.candidates]
        ref_scores = defaultdict(list)
        seconds = [0.0] * len(models)
        for trial in trials:
            say(f"n_ctx {n_ctx}: trial {trial.index + 1}/{len(trials)}")
            answers = []
            for k, model in enumerate(models):
                start = time.perf_counter()
                state = model.decode_prefix(trial.prefix)
                answers.append([model.continue_from(state, len(trial.prefix), p.continuation, p.first_scored)
                                for p in trial.planted])
                seconds[k] += time.perf_counter() - start
            for p, ref_logits in zip(trial.planted, answers[0]):
                ref_scores[p.depth].append(score_answer(ref_logits, ref_logits, p.answer))
                for k, cand in enumerate(answers[1:]):
                    scores[k][p.depth].append(score_answer(ref_logits, cand[trial.planted.index(p)], p.answer))
        cost = np.array([t.forward_tokens() for t in trials], np.float64).mean(axis=0)
        return {"n_ctx": n_ctx, "prefix_tokens": float(np.mean([len(t.prefix) for t in trials])),
                "forward_tokens_per_trial": {"prefix_once": cost[0], "naive": cost[1], "ratio": cost[1] / cost[0]},
                "reference": _row(request.reference, models[0], seconds[0], ref_scores),
                "candidates": [_row(r, m, s, sc) for r, m, s, sc in zip(request.candidates, models[1:], seconds[1:],
                                                                          scores)]}


def _row(run: Run, model: PrefixModel, seconds: float, by_depth: dict) -> dict:
    every = [s for scores in by_depth.values() for s in scores]
    return {"label": run.label, "model": run.model, "fingerprint": content_fingerprint(Path(run.model)),
            "kv": run.settings.as_json(), "kv_allocated": model.allocated,
            "seconds": seconds, "forward_tokens": model.decoded,
            "depths": [{"depth": d, **summarize_answers(s)} for d, s in sorted(by_depth.items())],
            "all": summarize_answers(every)}
