"""Does rendering as a chat change the damage? The shipped conversation suite scored with --score assistant twice:
rendered with the Gemma-3 turn-format template (chat) and with `--chat-template plain` (the same texts, no turn
markup), per segment and per category, for every candidate both runs directories hold (issue 18).

    qeval matrix --ref Q8_0=Q8_0.gguf -m Q4_K_M=... -m Q2_K=... --kv f16 --corpus conversations \
        --score assistant -c 2048 --chat-template corpora/conversations/gemma3-chat-template.jinja --runs-dir chat
    qeval matrix --ref Q8_0=Q8_0.gguf -m Q8_0=Q8_0.gguf --kv q4_0 --no-control ... --runs-dir chat
    (the same two with --chat-template plain --runs-dir plain)
    python bench/bench_conversations.py chat plain --out bench/results/conversations-gemma3-270m.json

At -c 2048 every conversation is one window in both renderings, in the same order, and the assistant's scored
tokens are the same token ids in the same order (checked here, refused otherwise), so the two runs pair token by
token: the table gives each side's mean KLD ± SE, 99.9 % KLD and same top-1, and the paired difference chat −
plain with its SE clustered by conversation (tokens of one conversation are not independent).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from common import cpu_name

from qeval.compare.depth import cluster_se
from qeval.present import results


def load(directory: Path) -> dict[str, results.Result]:
    """Candidate label -> its saved result with per-token values (the control left out)."""
    found = {}
    for path in sorted((directory / "results").glob("*.vs.*.json")):
        res = results.load_result(path, with_per_token=True)
        if res.label != "control":
            found[res.label] = res
    return found


def figures(n: int, blocks: dict) -> dict:
    k, top1 = blocks["kld"], blocks["same_top1"]
    return {"n": n, "kld_mean": k["mean"], "kld_se": k["se"], "kld_999": k["ladder"]["99.9%"],
            "same_top1": top1["fraction"], "same_top1_se": top1["se"]}


def paired(chat: results.Result, plain: results.Result, keep=slice(None)) -> dict:
    """chat − plain over the same tokens (`keep`: one group's), SE clustered by conversation (window)."""
    a, b = chat.per_token, plain.per_token
    if not all(np.array_equal(a[k], b[k]) for k in ("token", "chunk", "segment", "category")):
        raise SystemExit(f"{chat.label}: the two renderings do not score the same tokens in the same order")
    diff = a["kld"][keep].astype(np.float64) - b["kld"][keep]
    return {"kld_diff": float(diff.mean()), "kld_diff_se": cluster_se(diff, a["chunk"][keep])}


def rows(chat: dict[str, results.Result], plain: dict[str, results.Result]) -> list[dict]:
    out = []
    for label in sorted(chat.keys() & plain.keys(), key=lambda k: chat[k].summary.figures.kld["mean"]):
        c, p = chat[label], plain[label]
        for grouping, column, names in (("by_segment", "segment", "segments"), ("by_category", "category",
                                                                                 "categories")):
            plain_groups = {g.name: g for g in getattr(p.summary, grouping)}
            for group in getattr(c.summary, grouping):
                other = plain_groups[group.name]
                keep = c.per_token[column] == c.summary.labels[names].index(group.name)
                out.append({"candidate": label, column: group.name, "chat": figures(group.n, group.figures.blocks),
                            "plain": figures(other.n, other.figures.blocks), **paired(c, p, keep)})
        whole = [figures(r.summary.figures.scored_tokens, r.summary.figures.blocks) for r in (c, p)]
        out.append({"candidate": label, "all": True, "chat": whole[0], "plain": whole[1], **paired(c, p)})
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| candidate | tokens | n | chat mean KLD ± SE | chat 99.9 % | chat top-1 % | plain mean KLD ± SE | "
             "plain 99.9 % | plain top-1 % | chat − plain ± SE |", "|" + "---|" * 10]
    for r in table:
        group = "all" if r.get("all") else r.get("segment") or f"category {r.get('category')}"
        c, p = r["chat"], r["plain"]
        lines.append(f"| {r['candidate']} | {group} | {c['n']} | {c['kld_mean']:.5f} ± {c['kld_se']:.5f} | "
                     f"{c['kld_999']:.4f} | {100 * c['same_top1']:.2f} | {p['kld_mean']:.5f} ± {p['kld_se']:.5f} | "
                     f"{p['kld_999']:.4f} | {100 * p['same_top1']:.2f} | "
                     f"{r['kld_diff']:+.5f} ± {r['kld_diff_se']:.5f}{_sigma(r)} |")
    return "\n".join(lines)


def _sigma(r: dict) -> str:
    se = r["kld_diff_se"]
    return "" if not se or math.isnan(se) else f" ({r['kld_diff'] / se:+.1f} SE)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("chat", type=Path)
    ap.add_argument("plain", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    table = rows(load(args.chat), load(args.plain))
    text = markdown(table)
    print(text)
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu_name(), "rows": table, "markdown": text}, indent=1) + "\n")


if __name__ == "__main__":
    main()
