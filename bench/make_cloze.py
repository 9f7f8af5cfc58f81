"""A HellaSwag-format task file from the shipped corpus, for measuring answer flips where the hub is out of reach.

    python bench/make_cloze.py --tasks 400 --out bench/runs/austen-cloze.txt

Each task is one sentence of the corpus cut after about 60 % of its words: the context is the first part,
the right ending its own rest, the three wrong endings the rests of other sentences of similar length
(llama-perplexity's HellaSwag text layout: context line, index of the right ending, four endings). Models
pick the ending they find most likely, as they do on HellaSwag; a sentence-final cloze of a novel is easier
for a small model than HellaSwag, so accuracies are higher, but flips between quants are what it is for.
Deterministic for a given corpus, --tasks and --seed.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

from qeval.inputs.corpus import load_corpus

SENTENCE = re.compile(r"[^.!?]+[.!?]")
ABBREVIATION = re.compile(r"\b(Mr|Mrs|Dr|St)\.")  # not the end of a sentence
MIN_WORDS, MAX_WORDS = 12, 40


def sentences(text: str) -> list[list[str]]:
    """Sentences of MIN_WORDS..MAX_WORDS words, as word lists (quotes and line breaks flattened)."""
    out = []
    for match in SENTENCE.finditer(ABBREVIATION.sub(r"\1\0", text.replace("\n", " "))):
        words = match.group(0).replace("\0", ".").replace('"', "").replace("_", "").split()
        if MIN_WORDS <= len(words) <= MAX_WORDS:
            out.append(words)
    return out


def cloze_tasks(text: str, n_tasks: int, seed: int) -> list[tuple[str, int, list[str]]]:
    rng = np.random.default_rng(seed)
    pool = sentences(text)
    if len(pool) < n_tasks + 3:
        raise SystemExit(f"the corpus has {len(pool)} usable sentences, fewer than {n_tasks} tasks need")
    picked = rng.choice(len(pool), size=n_tasks, replace=False)
    cut = [max(4, round(0.6 * len(words))) for words in pool]
    endings = [" ".join(words[c:]) for words, c in zip(pool, cut)]
    lengths = np.array([len(e.split()) for e in endings])
    tasks = []
    for i in picked:
        similar = np.flatnonzero((np.abs(lengths - lengths[i]) <= 2) & (np.arange(len(pool)) != i))
        wrong = [endings[j] for j in rng.choice(similar, size=3, replace=False)]
        gold = int(rng.integers(4))
        tasks.append((" ".join(pool[i][:cut[i]]), gold, wrong[:gold] + [endings[i]] + wrong[gold:]))
    return tasks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", help="a corpus as qeval --corpus takes it (default: the shipped one)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    tasks = cloze_tasks(load_corpus(args.corpus).text, args.tasks, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(f"{ctx}\n{gold}\n" + "".join(f"{e}\n" for e in ends) for ctx, gold, ends in tasks))
    print(f"wrote {len(tasks)} tasks to {args.out}")


if __name__ == "__main__":
    main()
