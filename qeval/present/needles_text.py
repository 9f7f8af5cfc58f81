"""`qeval needle`'s text: per n_ctx, the cost, then each candidate's table by depth beside the reference's
accuracy."""

from __future__ import annotations

from qeval.present.markdown import markdown_table


def share(p: dict) -> str:
    return f"{100 * p['p']:.0f} % [{100 * p['lo']:.0f}, {100 * p['hi']:.0f}] ({p['hits']}/{p['n']})"


def _cells(depth: str, d: dict, ref_accuracy: dict) -> list[str]:
    return [depth, share(d["agreement"]), f"{100 * d['same_top1']['p']:.1f} %",
            f"{d['kld']['mean']:.6f} ± {d['kld']['se']:.6f}",
            f"{d['logprob_delta']['mean']:+.4f} ± {d['logprob_delta']['se']:.4f}", share(ref_accuracy),
            share(d["cand_accuracy"])]


def _spent(row: dict) -> str:
    """A row's decode time, and how many of its trials an earlier run recorded (their time included)."""
    read_back = row["trials_read_back"]
    return f"{row['seconds']:.1f} s" + (f", {read_back} trials read back from {row['trials_file']}" if read_back else "")


def _stopped(row: dict, result: dict) -> str:
    """Where --early stopped a row: after how many trials, why, and its answer KLD's interval at that look."""
    early = row.get("early")
    if early is None:
        return ""
    est = early["estimate"]
    return (f"; --early: {early['n_chunks']} of {result['trials']} trials, {early['reason']}, answer KLD "
            f"[{est['low']:.6f}, {est['high']:.6f}] at {100 * est['confidence']:.1f} %")


def needles_text(result: dict) -> str:
    lines = [f"needles: {result['needles']['source']} ({result['needles']['count']}), corpus {result['corpus']}, "
             f"{result['trials']} trials, seed {result['seed']}; reference {result['reference']}"]
    for block in result["contexts"]:
        cost, ref = block["forward_tokens_per_trial"], block["reference"]
        lines += ["", f"n_ctx {block['n_ctx']}: prefix {block['prefix_tokens']:.0f} tokens; forward tokens per trial "
                      f"{cost['prefix_once']:.0f} (prefix once) vs {cost['naive']:.0f} (a window per question): "
                      f"{cost['ratio']:.2f}x; reference {_spent(ref)}, KV {ref['kv_allocated']}"]
        accuracy = {d["depth"]: d["ref_accuracy"] for d in ref["depths"]}
        for cand in block["candidates"]:  # the reference's accuracy over the candidate's own trials (--early: fewer)
            rows = [_cells(f"{d['depth']:g} %", d, d["ref_accuracy"]) for d in cand["depths"]]
            rows.append(_cells("all", cand["all"], cand["all"]["ref_accuracy"]))
            lines += ["", f"{cand['label']} (KV {cand['kv_allocated']}, {_spent(cand)}){_stopped(cand, result)}",
                      markdown_table(["depth", "agreement [95 % Wilson]", "same top-1", "answer KLD",
                                      "Δ log p(answer)", "reference accuracy", "candidate accuracy"], rows)]
        if not block["candidates"]:
            lines.append(markdown_table(["depth", "reference accuracy"], [[f"{d['depth']:g} %", share(a)]
                                                                          for d, a in zip(ref["depths"], accuracy.values())]))
    return "\n".join(lines)
