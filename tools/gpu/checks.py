"""The GPU kit's checks (run.sh runs this after the build): qeval against llama.cpp's own tools from the same build,
on each model pair the kit carries, every result into one folder with summary.json.

    python tools/gpu/checks.py --kit .gpukit/kit --bin BUILD/bin --ngl 99 --out OUT [--chunks 4] [--rounds 2]

Per pair (models-*/: the reference, carried as reference.gguf.zst, and the candidate derived from it here):
1. parity: `qeval capture` of the reference and `qeval kld` of the candidate (live) against llama-perplexity's
   --kl-divergence-base / --kl-divergence: PPL, mean KLD, same top-1;
2. speed: `qeval deploy` against llama-bench (pp and tg, same -ngl), runs alternated; memory lines as qeval reads
   them (per device buffer);
3. the hidden form: a capture with --reference-form auto: what auto decided (and why), and the replay's measured
   KL per token against the logits of this run, with the head's input read both ways (in llama.cpp's graph, and
   as its embeddings output);
4. GPU-sized batches: capture time at -b/-ub 2048 against llama-perplexity's at the same batches (alternated).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import numpy as np
import zstandard

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from bench_vs_llamacpp import alternate
from common import cpu_name, llama_numbers, timed

from qeval.inputs.corpus import load_corpus
from qeval.orchestrate import demo
from qeval.storage.hidden_form import AUTO_REPLAY_KL
from qeval.storage.store import StoreReader

QEVAL = [sys.executable, "-m", "qeval"]
N_CTX = 512
BIG_BATCH = 2048
CHECKS = ("parity", "hidden", "speed", "big_batches")  # most wanted first: a call stopped at its limit keeps those
PACKED_REFERENCE, CANDIDATE_FTYPE = "reference.gguf.zst", demo.DERIVED_FTYPES["Q4_0"]  # as tools/gpu/models.py packs


def qeval_json(*args: str) -> dict:
    proc = subprocess.run([*QEVAL, *args, "--json"], capture_output=True, text=True, check=False)
    if proc.returncode not in (0, 2) or "{" not in proc.stdout:
        raise RuntimeError(f"qeval {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1])


class Pair:
    """One model pair's checks, its files under out/<name>/."""

    def __init__(self, folder: Path, args: argparse.Namespace, corpus: Path):
        self.name = folder.name.removeprefix("models-")
        self.ref, self.cand = folder / "reference.gguf", folder / "candidate.gguf"
        self.args, self.corpus = args, corpus
        self.work = args.out / self.name
        self.runs = self.work / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        self.lp, self.lb = str(args.bin / "llama-perplexity"), str(args.bin / "llama-bench")
        self.ngl = ["-ngl", str(args.ngl)]

    def common(self, batch: int | None = None) -> list[str]:
        sizes = ["-b", str(batch), "-ub", str(batch)] if batch else []
        return ["-f", str(self.corpus), "-c", str(N_CTX), "--chunks", str(self.args.chunks), *self.ngl, *sizes]

    def qeval_capture(self, label: str, batch: int | None = None, form: str = "logits") -> dict:
        (self.runs / f"{label}.qeval").unlink(missing_ok=True)
        wall, rss, _ = timed([*QEVAL, "capture", str(self.ref), "--label", label, "--corpus", str(self.corpus),
                              "-c", str(N_CTX), "--chunks", str(self.args.chunks), *self.ngl,
                              *(["-b", str(batch), "-ub", str(batch)] if batch else []),
                              "--reference-form", form, "--runs-dir", str(self.runs)])
        return {"wall_s": wall, "peak_rss_bytes": rss}

    def llamacpp_base(self, base: Path, batch: int | None = None) -> dict:
        wall, rss, text = timed([self.lp, "-m", str(self.ref), *self.common(batch), "--kl-divergence-base", str(base)])
        (self.work / f"llama-perplexity-base{'-b' + str(batch) if batch else ''}.log").write_text(text)
        return {"wall_s": wall, "peak_rss_bytes": rss, **llama_numbers(text)}

    def parity(self) -> dict:
        base = self.work / "reference.kld"
        ll_ref = self.llamacpp_base(base)
        q_ref = self.qeval_capture("reference")
        q_ref["final_ppl"] = qeval_json("ppl", "reference", "--runs-dir", str(self.runs))["ppl"]
        _, _, text = timed([self.lp, "-m", str(self.cand), *self.common(), "--kl-divergence-base", str(base),
                            "--kl-divergence"])
        (self.work / "llama-perplexity-kld.log").write_text(text)
        ll = llama_numbers(text)
        res = qeval_json("kld", "--ref", "reference", "--cand", str(self.cand), *self.ngl, "--runs-dir",
                         str(self.runs))
        q = {"ppl_cand": res["perplexity"]["ppl_cand"], "ppl_ref": res["perplexity"]["ppl_ref"],
             "mean_kld": res["kld"]["mean"], "same_top_pct": 100 * res["same_top1"]["fraction"]}
        return {"reference": {"llamacpp": ll_ref, "qeval": q_ref,
                              "ppl_rel_diff": rel_diff(q_ref["final_ppl"], ll_ref["final_ppl"])},
                "candidate": {"llamacpp": ll, "qeval": q,
                              "ppl_rel_diff": rel_diff(q["ppl_cand"], ll["ppl_cand"]),
                              "kld_rel_diff": rel_diff(q["mean_kld"], ll["mean_kld"]),
                              "same_top_diff_points": abs(q["same_top_pct"] - ll["same_top_pct"])}}

    def speed(self) -> dict:
        spec = f"pp=512;tg=128;reps={self.args.reps};ctx=4096"

        def qeval_run() -> dict:
            wall, rss, text = timed([*QEVAL, "deploy", str(self.ref), "--spec", spec, *self.ngl, "--force",
                                     "--runs-dir", str(self.runs), "--json"])
            return {"wall_s": wall, "peak_rss_bytes": rss, "result": first_json(text, "{")}

        def bench_run() -> dict:
            wall, rss, text = timed([self.lb, "-m", str(self.ref), "-p", "512", "-n", "128", "-r", str(self.args.reps),
                                     *self.ngl, "-o", "json"])
            return {"wall_s": wall, "peak_rss_bytes": rss, "result": first_json(text, "[")}

        q, lb = alternate(self.args.rounds, qeval_run, bench_run)
        (self.work / "deploy.json").write_text(json.dumps(q["result"], indent=1))
        (self.work / "llama-bench.json").write_text(json.dumps(lb["result"], indent=1))
        bench = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in lb["result"]}
        return {"llama_bench_tokens_per_s": bench, "qeval_deploy": deploy_speeds(q["result"]),
                "qeval_memory": deploy_memory(q["result"]), "rounds": self.args.rounds,
                "note": "the last round's figures; runs alternated (qeval first in even rounds)"}

    def hidden(self) -> dict:
        """auto's decision per piece, and the replay's KL per token against this run's logits: from captures in the
        hidden form, since auto keeps no replay record of a piece it codes as logits. Both ways of reading the head's
        input (qeval.engine.hidden_tap): -b 2048 puts 4 windows in a call (an embeddings context), -b N_CTX one
        (read in llama.cpp's graph, as at long contexts)."""
        timing = self.qeval_capture("hidden-auto", form="auto")
        info = qeval_json("info", str(self.runs / "hidden-auto.qeval"))
        asked = next((d["reference_form"] for d in walk(info) if isinstance(d.get("reference_form"), dict)), {})
        captures, replay_kl = {"auto": timing}, {}
        for route, batch in (("embeddings", None), ("graph", N_CTX)):
            label = f"hidden-{route}"
            captures[label] = self.qeval_capture(label, batch, form="hidden")
            per_token: dict[str, list[float]] = {}
            with closing(StoreReader(self.runs / f"{label}.qeval")) as store:
                for index in store.chunk_indices:
                    for replay in store.read_chunk(index).replays:
                        per_token.setdefault(replay.engine, []).extend(float(v) for v in replay.record.kl)
            (self.work / f"{label}-replay-kl-per-token.json").write_text(json.dumps(per_token))
            replay_kl[route] = {engine: {"tokens": len(v), "max": max(v), "median": float(np.median(v)),
                                         "mean": sum(v) / len(v)} for engine, v in per_token.items() if v}
        return {"capture": captures,
                "decision": {**asked, "pieces_by_form": info.get("pieces_by_form"),
                             "auto_replay_kl_limit": AUTO_REPLAY_KL},
                "replay_kl_per_token": replay_kl}

    def big_batches(self) -> dict:
        base = self.work / "reference-b2048.kld"
        ll, q = alternate(self.args.rounds, lambda: self.llamacpp_base(base, BIG_BATCH),
                          lambda: self.qeval_capture("reference-b2048", BIG_BATCH))
        return {"batch": BIG_BATCH, "llamacpp": ll, "qeval": q, "time_ratio": q["wall_s"] / ll["wall_s"]}


def unpack_pair(folder: Path, into: Path) -> Path | None:
    """into/reference.gguf from the carried folder/reference.gguf.zst, and into/candidate.gguf from it with
    llama.cpp's quantizer (Q8_0 requantized to Q4_0): the folder of the pair, None where `folder` holds none. The kit
    itself is left as it was carried."""
    packed = folder / PACKED_REFERENCE
    if not packed.is_file():
        return None
    into.mkdir(parents=True, exist_ok=True)
    reference = into / "reference.gguf"
    if not reference.is_file():
        partial = reference.with_suffix(".part")
        with packed.open("rb") as src, partial.open("wb") as dst:
            zstandard.ZstdDecompressor().copy_stream(src, dst)
        partial.replace(reference)
    demo.quantize(reference, into / "candidate.gguf", CANDIDATE_FTYPE)
    return into


def first_json(text: str, opener: str):
    """The JSON value that starts at the first `opener` of a tool's output (its stdout; the log follows)."""
    return json.JSONDecoder().raw_decode(text[text.index(opener):])[0]


def rel_diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else abs(a / b - 1)


def deploy_speeds(result: dict) -> list:
    """The speed rows of `qeval deploy --json` (whatever their nesting: every dict with tokens_per_s)."""
    return [d for d in walk(result) if "tokens_per_s" in d or "avg_ts" in d]


def deploy_memory(result: dict) -> list:
    return [d for d in walk(result) if "buffers" in d or "devices" in d]


def walk(node):
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def machine() -> dict:
    gpu = None
    if shutil.which("nvidia-smi"):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False).stdout.strip() or None
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "gpu": gpu, "python": platform.python_version()}


def write_summary(summary: dict, args: argparse.Namespace) -> None:
    if args.started:
        summary["total_seconds"] = round(time.time() - args.started, 1)
    for folder in filter(None, (args.out, args.mirror)):
        (folder / "summary.json").write_text(json.dumps(summary, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kit", type=Path, required=True)
    ap.add_argument("--bin", type=Path, required=True, help="the folder of llama-perplexity and llama-bench")
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="alternated rounds of each timed comparison")
    ap.add_argument("--reps", type=int, default=3, help="llama-bench's -r (and deploy's reps)")
    ap.add_argument("--only", default=",".join(CHECKS), help="comma-separated subset of " + ",".join(CHECKS))
    ap.add_argument("--mirror", type=Path, help="a folder that also gets summary.json (the device tool's $OUT)")
    ap.add_argument("--build-json", type=Path)
    ap.add_argument("--started", type=float, help="when run.sh started (epoch seconds): the total time")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = args.out / "corpus.txt"
    corpus.write_text(load_corpus().text)
    summary: dict = {"machine": machine(), "ngl": args.ngl, "chunks": args.chunks, "n_ctx": N_CTX,
                     "build": json.loads(args.build_json.read_text()) if args.build_json else None, "pairs": {},
                     "failed": []}
    write_summary(summary, args)
    unpacked = (unpack_pair(folder, args.out / "models" / folder.name) for folder in sorted(args.kit.glob("models-*")))
    pairs = [Pair(folder, args, corpus) for folder in unpacked if folder is not None]
    for check in args.only.split(","):  # each check on every pair before the next check
        for pair in pairs:
            result = summary["pairs"].setdefault(pair.name, {})
            started = time.perf_counter()
            try:
                result[check] = getattr(pair, check)()
            except Exception as exc:  # noqa: BLE001 - one failed check is recorded, the others still run
                result[check] = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
                summary["failed"].append(f"{pair.name}/{check}")
            result[check]["seconds"] = round(time.perf_counter() - started, 1)
            print(f"checks: {pair.name} {check}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
            write_summary(summary, args)  # after every check: a run stopped at the call's limit keeps what it did
    print(json.dumps({k: summary[k] for k in ("failed", "total_seconds") if k in summary}))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
