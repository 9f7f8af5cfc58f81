"""Answer flips between a reference and a candidate on the same tasks ("Accuracy is Not All You Need",
Dutta et al., NeurIPS 2024): a quant can keep its accuracy while many answers change.

From the per-task answers of two task stores (qeval.storage.taskstore), without running a model:

  accuracy      per model, with llama-perplexity's standard error sqrt(p (1 - p) / (n - 1))
  flips         correct -> wrong and wrong -> correct, counts and % of tasks; answers changed at all
                (a HellaSwag answer can move from one wrong ending to another)
  McNemar       exact two-sided test on the discordant pairs: is the accuracy change more than chance?
                p = min(1, 2 P[X <= min(b, c)]), X ~ Binomial(b + c, 1/2) (scipy.stats.binomtest)
  margin bins   tasks ranked by the reference's margin (its answer's score minus the best other score)
                and cut into equal-count bins: flip rate per bin (the paper: low-margin tasks flip)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qeval.errors import MismatchError, QevalError
from qeval.identity import short
from qeval.storage.taskstore import TaskStore, margin

DIRECTIONS = {(True, False): "correct→wrong", (False, True): "wrong→correct"}


@dataclass(frozen=True)
class PairedTasks:
    """The tasks two stores share, by task index, with both models' answers."""

    index: np.ndarray  # int64 [n]
    gold: np.ndarray  # first correct choice
    ref_pred: np.ndarray
    cand_pred: np.ndarray
    ref_correct: np.ndarray  # bool
    cand_correct: np.ndarray
    ref_margin: np.ndarray  # float64
    cand_margin: np.ndarray

    @property
    def n(self) -> int:
        return len(self.index)


def pair_records(ref: dict, cand: dict) -> PairedTasks:
    """ref, cand: task index -> record (taskstore.make_record). Tasks in both, ascending."""
    common = sorted(set(ref) & set(cand))
    if not common:
        raise MismatchError("the two stores share no task")
    cols: dict[str, list] = {k: [] for k in PairedTasks.__dataclass_fields__}
    for i in common:
        r, c = ref[i], cand[i]
        if r["labels"] != c["labels"]:
            raise MismatchError(f"task {i} has labels {r['labels']} in the reference and {c['labels']} in the "
                                "candidate: not the same task set")
        cols["index"].append(i)
        cols["gold"].append(r["labels"].index(1))
        for side, rec in (("ref", r), ("cand", c)):
            cols[f"{side}_pred"].append(rec["pred"])
            cols[f"{side}_correct"].append(rec["labels"][rec["pred"]] == 1)
            cols[f"{side}_margin"].append(margin(rec["llama"], rec["pred"]))
    types = {"ref_correct": bool, "cand_correct": bool, "ref_margin": np.float64, "cand_margin": np.float64}
    return PairedTasks(**{k: np.asarray(v, dtype=types.get(k, np.int64)) for k, v in cols.items()})


def accuracy(correct: np.ndarray) -> dict:
    """Accuracy in %, with llama-perplexity's standard error (its Winogrande and multiple-choice lines)."""
    n = len(correct)
    k = int(np.sum(correct))
    p = k / n
    se = math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else None
    return {"correct": k, "n": n, "accuracy_pct": 100 * p, "se_pct": None if se is None else 100 * se}


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value for b and c discordant pairs (binomial test at 1/2)."""
    if b < 0 or c < 0:
        raise ValueError("counts must be >= 0")
    from scipy.stats import binomtest  # noqa: PLC0415 - scipy.stats costs ~1 s to import; only flips need it

    return 1.0 if b + c == 0 else float(binomtest(b, b + c, 0.5).pvalue)


def margin_bins(paired: PairedTasks, bins: int) -> list[dict]:
    """Tasks ranked by the reference's margin (ties by task index), cut into `bins` equal-count bins."""
    if bins < 1:
        raise QevalError("--bins must be at least 1")
    order = np.lexsort((paired.index, paired.ref_margin))
    flipped = paired.ref_correct != paired.cand_correct
    changed = paired.ref_pred != paired.cand_pred
    out = []
    for part in np.array_split(order, min(bins, paired.n)):
        m = paired.ref_margin[part]
        c2w = int(np.sum(paired.ref_correct[part] & ~paired.cand_correct[part]))
        w2c = int(np.sum(~paired.ref_correct[part] & paired.cand_correct[part]))
        out.append({"n": len(part), "margin_min": float(m.min()), "margin_max": float(m.max()),
                    "flips": int(np.sum(flipped[part])), "correct_to_wrong": c2w, "wrong_to_correct": w2c,
                    "flip_rate_pct": 100 * float(np.mean(flipped[part])),
                    "changed_rate_pct": 100 * float(np.mean(changed[part]))})
    return out


def flips(paired: PairedTasks, bins: int = 4) -> dict:
    n = paired.n
    rc, cc = paired.ref_correct, paired.cand_correct
    c2w = int(np.sum(rc & ~cc))
    w2c = int(np.sum(~rc & cc))
    changed = int(np.sum(paired.ref_pred != paired.cand_pred))
    diff = cc.astype(np.float64) - rc.astype(np.float64)
    flipped = rc != cc
    listed = [{"index": int(paired.index[k]), "gold": int(paired.gold[k]), "ref_answer": int(paired.ref_pred[k]),
               "cand_answer": int(paired.cand_pred[k]), "direction": DIRECTIONS[(bool(rc[k]), bool(cc[k]))],
               "ref_margin": float(paired.ref_margin[k]), "cand_margin": float(paired.cand_margin[k])}
              for k in np.flatnonzero(flipped)]
    median = (lambda x: float(np.median(x)) if len(x) else None)
    return {
        "n_tasks": n,
        "reference": accuracy(rc),
        "candidate": accuracy(cc),
        "delta_accuracy_pct": 100 * float(diff.mean()),
        "delta_se_pct": 100 * float(diff.std(ddof=1) / math.sqrt(n)) if n > 1 else None,
        "correct_to_wrong": c2w,
        "wrong_to_correct": w2c,
        "flips": c2w + w2c,
        "correct_to_wrong_pct": 100 * c2w / n,
        "wrong_to_correct_pct": 100 * w2c / n,
        "flips_pct": 100 * (c2w + w2c) / n,
        "answers_changed": changed,
        "answers_changed_pct": 100 * changed / n,
        "mcnemar_p": mcnemar_exact(c2w, w2c),
        "ref_margin_median_flipped": median(paired.ref_margin[flipped]),
        "ref_margin_median_kept": median(paired.ref_margin[~flipped]),
        "margin_bins": margin_bins(paired, bins),
        "flipped": listed,
    }


def describe(store: TaskStore) -> dict:
    """Who a task store's answers are: label, file, model and the settings they were scored with."""
    h = store.header
    return {"label": store.label, "path": str(store.path), "model": h.get("model", {}).get("file_name"),
            "fingerprint": store.identity.get("model", {}).get("fingerprint"), **store.identity["settings"]}


def between(ref: TaskStore, cand: TaskStore, bins: int = 4) -> dict:
    """Accuracy of both, flips, McNemar and flips by margin between two complete task stores of one task set,
    scored alike; refuses anything else."""
    for s in (ref, cand):
        if not s.complete:
            raise QevalError(f"{s.path} is incomplete ({len(s.records)} of {s.n_selected} tasks): finish it with "
                             "qeval tasks capture (same arguments)")
    ta, tb = ref.identity["task"], cand.identity["task"]
    if (ta["format"], ta["sha256"]) != (tb["format"], tb["sha256"]):
        raise MismatchError(f"the stores hold different task sets: {ta['format']} {short(ta['sha256'])} "
                            f"({ref.path}) vs {tb['format']} {short(tb['sha256'])} ({cand.path})")
    if ref.identity["scoring_version"] != cand.identity["scoring_version"]:
        raise MismatchError(f"the stores were scored by different qeval scoring versions "
                            f"({ref.identity['scoring_version']} vs {cand.identity['scoring_version']}): "
                            "recapture one")
    la, lb = (s.identity["settings"].get("layout", "llama") for s in (ref, cand))
    if la != lb:
        raise MismatchError(f"the stores were scored with different layouts ({la} for {ref.path}, {lb} for "
                            f"{cand.path}): capture both with the same --layout")
    result = flips(pair_records(ref.records, cand.records), bins)
    return {"task": ref.header.get("task", {}), "ref": describe(ref), "cand": describe(cand),
            "ref_tasks": len(ref.records), "cand_tasks": len(cand.records), **result}
