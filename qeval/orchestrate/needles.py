"""`qeval needle`: needles at depth, the reference and every candidate over the same trials (docs/needles.md).

Every model is opened once per n_ctx (a PrefixModel each), and only when a trial of its row is still to run; each
trial's prefix is decoded once per model, each question continued after it; each candidate's answers are scored
against the reference's as they come, so no trial's logits outlive it. Each row's trials are recorded in the runs
directory as they are scored (qeval.storage.needle_trials): a run killed resumes, a run of more trials extends, and
a row already measured is read back, not decoded again. Decided early (`--early`), trials are the chunks of
qeval.compare.early: every row visits them in order (each trial is its own seeded draw), first min_chunks, then
`step` more per round until the rule stops it; the reference is decoded once per trial for the rows that need it."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qeval.compare import early as early_stop
from qeval.compare.needle_scores import ANSWER_FIELDS, answer_json, answer_of, score_answer, summarize_answers
from qeval.engine.engine import EngineSettings, check_model_file, planned_fields
from qeval.engine.modelinfo import kv_cache_gib, model_facts
from qeval.engine.prefix import PrefixModel
from qeval.errors import QevalError
from qeval.identity import digest, model_identity, needle_row_identity
from qeval.inputs.corpus import load_corpus
from qeval.inputs.needles import load_needles, plant_trials
from qeval.orchestrate.matrix import decide_in_rounds
from qeval.storage.needle_trials import NeedleTrials, TrialRecord, trials_path


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
    directory: Path  # the runs directory the trials are recorded in
    needles: str | None = None  # a needle file; None: the shipped suite
    corpus: str | None = None
    seed: int = 0
    jitter: float = 2.0
    early: early_stop.EarlySettings | None = None  # decide the rows early, trials as the chunks


def check_request(request: NeedleRequest) -> None:
    """What a needle request cannot mean, refused (QevalError)."""
    if request.early is not None and request.early.seed:
        raise QevalError("--early-seed: a needle run visits its trials in order, each its own seeded draw (--seed)")


def run_needles(request: NeedleRequest, say=lambda line: None) -> dict:
    check_request(request)
    source, needles = load_needles(request.needles)
    corpus = load_corpus(request.corpus)
    out = {"reference": request.reference.label, "needles": {"source": source, "count": len(needles)},
           "corpus": corpus.name, "depths": list(request.depths), "trials": request.trials, "seed": request.seed,
           "early": None if request.early is None else request.early.rule.to_json(), "contexts": []}
    design = {"needles_sha256": digest([dataclasses.asdict(n) for n in needles]), "corpus": corpus.identity(),
              "depths": list(request.depths), "seed": request.seed, "jitter": request.jitter}
    facts = {r.model: model_facts(check_model_file(r.model)) for r in (request.reference, *request.candidates)}
    for n_ctx in request.contexts:
        out["contexts"].append(_one_context(request, needles, corpus, {**design, "n_ctx": n_ctx}, facts, say))
    return out


def _run_identity(run: Run, facts: dict, n_ctx: int) -> dict:
    """What decides a run's logits: its model and what llama.cpp computes them with (as a store's producer), with
    the batch sizes a PrefixModel decodes in."""
    n_batch, n_ubatch = PrefixModel.batch_sizes(run.settings, n_ctx)
    return {"model": model_identity(facts, "qeval", ""),
            **planned_fields(facts, run.settings, n_ctx), "n_batch": n_batch, "n_ubatch": n_ubatch}


def _one_context(request, needles, corpus, design, facts, say) -> dict:
    n_ctx = design["n_ctx"]
    runs = (request.reference, *request.candidates)
    identities = [_run_identity(r, facts[r.model], n_ctx) for r in runs]
    files: dict[Path, NeedleTrials] = {}  # rows of one identity (a candidate given twice) share a file
    rows = []
    for k, identity in enumerate(identities):
        row = needle_row_identity(identities[0], identity if k else None, design)
        path = trials_path(request.directory, row)
        if path not in files:
            files[path] = NeedleTrials(path, row, ANSWER_FIELDS)
        rows.append(files[path])
    with contextlib.ExitStack() as stack:
        models: dict[int, PrefixModel] = {}

        def model(k: int) -> PrefixModel:
            if k not in models:
                models[k] = stack.enter_context(PrefixModel(runs[k].model, runs[k].settings, n_ctx))
                if k and models[k].tokenizer_fingerprint() != models[0].tokenizer_fingerprint():
                    raise QevalError(f"{runs[k].label} has another tokenizer than the reference: its answers cannot "
                                     "be compared token by token")
                rows[k].start(models[k].allocated)
            return models[k]

        ref = model(0)
        trials = plant_trials(ref.tokenize(corpus.text, add_special=False), lambda t: ref.tokenize(t, False),
                              ref.bos if ref.add_bos else None, needles, depths=request.depths, n_ctx=n_ctx,
                              trials=request.trials, seed=request.seed, jitter=request.jitter)

        def run_trial(trial, needed: list[int]) -> None:
            """The trial for the candidates `needed` (indices into runs), the reference decoded once."""
            say(f"n_ctx {n_ctx}: trial {trial.index + 1}/{len(trials)}")
            ref_answers, seconds, tokens = _answers(ref, trial)
            if trial.index not in rows[0].recorded:
                _record(rows[0], trial, ref_answers, ref_answers, seconds, tokens)
            for k in needed:
                if trial.index not in rows[k].recorded:  # a candidate given twice: its file is recorded once
                    _record(rows[k], trial, ref_answers, *_answers(model(k), trial))

        def held(k: int) -> list[int]:
            return early_stop.held_prefix(range(len(trials)), rows[k].recorded)

        candidates = range(1, len(runs))
        decided = None
        if request.early is None:
            for trial in trials:
                needed = [k for k in candidates if trial.index not in rows[k].recorded]
                if needed or trial.index not in rows[0].recorded:
                    run_trial(trial, needed)
            used = [list(range(len(trials))) for _ in rows]
        else:
            def run_round(targets: dict[int, int]) -> None:
                for trial in trials:
                    needed = [k + 1 for k, target in targets.items() if len(held(k + 1)) == trial.index < target]
                    if needed:
                        run_trial(trial, needed)

            def decisions() -> list[early_stop.Decision]:
                """One per candidate; a candidate given twice is one row of the board (one label, one file)."""
                first: dict[str, int] = {}
                for k in candidates:
                    first.setdefault(runs[k].label, k)
                decided = early_stop.decide([_trial_chunks(runs[k], rows[k], held(k), facts[runs[k].model], n_ctx,
                                                           identities[k] == identities[0]) for k in first.values()],
                                            len(trials), request.early.rule)
                by_label = {d.label: d for d in decided}
                return [by_label[runs[k].label] for k in candidates]

            decide_in_rounds(request.early, list(range(len(candidates))), run_round, decisions)
            decided = decisions()
            used = [sorted({t for k in candidates for t in held(k)}), *(held(k) for k in candidates)]
        used = [{t: row.recorded[t] for t in u} for row, u in zip(rows, used)]
        cost = np.array([t.forward_tokens() for t in trials], np.float64).mean(axis=0)
        return {"n_ctx": n_ctx, "prefix_tokens": float(np.mean([len(t.prefix) for t in trials])),
                "forward_tokens_per_trial": {"prefix_once": cost[0], "naive": cost[1], "ratio": cost[1] / cost[0]},
                "reference": _row(runs[0], facts, rows[0], used[0]),
                "candidates": [{**_row(r, facts, row, u), **({"early": d.to_json()} if decided else {})}
                               for r, row, u, d in zip(runs[1:], rows[1:], used[1:], decided or [None] * len(rows))]}


def _trial_chunks(run: Run, row: NeedleTrials, held: list[int], facts: dict, n_ctx: int,
                  control: bool) -> early_stop.PairChunks:
    """A candidate's row for the early rule: its held trials in order, each with its answers' KLD sum and count; on
    the board's Pareto axes (a KV cache's row by model plus cache at n_ctx, a model's by its size)."""
    answers = [[answer_of(a)[1] for a in row.recorded[t].answers] for t in held]
    size = facts.get("size_gib")
    kv = kv_cache_gib(facts, run.settings.type_k, run.settings.type_v, n_ctx)
    return early_stop.PairChunks(label=run.label, chunks=np.array(held, dtype=np.int64),
                                 sums=np.array([sum(s.kld for s in a) for a in answers], dtype=np.float64),
                                 tokens=np.array([len(a) for a in answers], dtype=np.int64), size_gib=size,
                                 memory_gib=None if size is None or kv is None else size + kv,
                                 kv_quant=(run.settings.type_k, run.settings.type_v) != ("f16", "f16"),
                                 control=control)


def _answers(model: PrefixModel, trial) -> tuple[list[np.ndarray], float, int]:
    """The logits of every planted needle's answer after the trial's prefix, and the seconds and forward tokens
    that took."""
    start, decoded = time.perf_counter(), model.decoded
    state = model.decode_prefix(trial.prefix)
    answers = [model.continue_from(state, len(trial.prefix), p.continuation, p.first_scored) for p in trial.planted]
    return answers, time.perf_counter() - start, model.decoded - decoded


def _record(row: NeedleTrials, trial, ref_answers, answers, seconds: float, tokens: int) -> None:
    row.append(TrialRecord(trial=trial.index, seconds=seconds, forward_tokens=tokens, answers=tuple(
        answer_json(p.depth, score_answer(r, a, p.answer)) for p, r, a in zip(trial.planted, ref_answers, answers))))


def _row(run: Run, facts: dict, row: NeedleTrials, used: dict[int, TrialRecord]) -> dict:
    by_depth: dict[float, list] = {}
    for record in used.values():
        for depth, score in map(answer_of, record.answers):
            by_depth.setdefault(depth, []).append(score)
    every = [s for scores in by_depth.values() for s in scores]
    return {"label": run.label, "model": run.model, "fingerprint": facts[run.model]["fingerprint"],
            "kv": run.settings.as_json(), "kv_allocated": row.kv_allocated,
            "seconds": sum(r.seconds for r in used.values()),
            "forward_tokens": sum(r.forward_tokens for r in used.values()),
            "trials_file": str(row.path), "trials_read_back": len(used.keys() & row.read_back),
            "depths": [{"depth": d, **summarize_answers(s)} for d, s in sorted(by_depth.items())],
            "all": summarize_answers(every)}
