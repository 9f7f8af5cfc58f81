"""The seeds' width, measured (issue 28): qeval capture, a live qeval candidate and llama-perplexity on the
full-width qwen35moe model of bench/fullwidth_model.py, at long n_ctx, one window each (a capture: --windows).

    python bench/bench_fullwidth.py --steps capture:8192,capture:8192:hidden,kld:8192:f16,llama:8192 \
        [--score every:64] [--windows 1] [--corpus NAME] [--llama-perplexity PATH] [--as-gib 14] \
        [--models-dir DIR] \
        [--out bench/results/fullwidth-qwen35moe-amd-epyc.json]

A step is one child process, run under `prlimit --as` (an address-space cap: a run that asks for more
memory fails alone instead of pushing a shared machine out of memory) and timed by /usr/bin/time (wall
clock, peak RSS):

* capture:N[:FORM] — `qeval capture` of the Q8_0 reference, n_ctx N, --windows windows of --corpus (its documents
  joined: --concat), --score S, --reference-form FORM (default logits; the store is ref<N>, or ref<N>-<FORM>);
* kld:N:KV[:ROT] — `qeval kld` of the Q4_0 model run live against that capture, KV cache type KV for K and V,
  Hadamard rotation ROT (on/off; default auto);
* llama:N — llama-perplexity --kl-divergence-base of the Q8_0 reference, n_ctx N, one chunk, over the same
  corpus text (llama-perplexity's stream: the documents joined, which is what --concat makes qeval do).

Flash attention is on in every step (a quantized V cache needs it). Each finished step is appended to --out
at once, so an interrupted series keeps what it measured; a step that failed is kept with its exit code and
last lines, and one that asked for more memory than the cap is marked so. A capture records its store's size, scored
tokens, bytes per scored token (the hidden form's also without the head it embeds once) and the error the store
recorded (`qeval info --json`: KL(exact ‖ stored) per token, max |Δ log p|).

    python bench/bench_fullwidth.py --table [--out FILE]

prints the table docs/scaling.md shows: the last run of each step in FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common import TIME, cpu_name
from fullwidth_model import build

from qeval.inputs.corpus import DEFAULT_CORPUS, load_corpus
from qeval.storage.hidden_form import FORMS

OOM_SIGNS = ("bad_alloc", "Cannot allocate memory", "MemoryError", "failed to allocate", "insufficient memory",
             "out of memory", "unable to allocate", "failed to mmap")
# llama-perplexity exits 0 after a failed llama_decode (e.g. an output buffer it could not allocate) and after
# refusing a text shorter than 2 x n_ctx tokens
FAILURE_SIGNS = ("failed to decode", "you need at least")
SCRATCH = Path(tempfile.gettempdir()) / "qeval-fullwidth"


def run_capped(argv: list[str], as_bytes: int, env: dict | None = None) -> dict:
    """Exit code, wall seconds, peak RSS and the last lines of `argv` run under an address-space cap."""
    proc = subprocess.run(["prlimit", f"--as={as_bytes}", "--", *TIME, *argv], capture_output=True, text=True,
                          env=env)
    timing = re.search(r"WALL=([\d.]+) RSS_KB=(\d+)", proc.stderr)
    text = (proc.stdout + proc.stderr).replace("\r", "\n")
    out = {"argv": argv, "rc": proc.returncode, "wall_s": float(timing.group(1)) if timing else None,
           "peak_rss_gib": round(int(timing.group(2)) / 2**20, 3) if timing else None,
           "tail": [line for line in text.splitlines() if line.strip()][-8:], "stdout": proc.stdout}
    stopped = stop_reason(proc.returncode, text, as_bytes)
    if stopped:
        out["stopped"] = stopped
    return out


def stop_reason(rc: int, text: str, as_bytes: int) -> str | None:
    """Why a run did not finish (None if it did): out of memory under the cap, or another failure."""
    if rc == 0 and not any(s in text for s in FAILURE_SIGNS):
        return None
    if any(s in text for s in OOM_SIGNS):
        return f"out of memory under a {as_bytes / 2**30:g} GiB address-space cap"
    said = [line for line in text.splitlines() if any(s in line for s in FAILURE_SIGNS)]
    return f"failed ({said[0].split(' E ')[-1].strip()})" if said else "failed"


def qeval_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "qeval", *args]


def step_argv(step: str, models: dict[str, Path], args, runs: Path, corpus: Path) -> tuple[list[str], dict | None]:
    kind, n_ctx, *rest = step.split(":")
    common = ["-fa", "on", "-t", str(args.threads), "--runs-dir", str(runs)]  # kld takes n_ctx from the reference
    if kind == "capture":
        label, form = capture_store(step)
        return qeval_argv("capture", str(models["Q8_0"]), "-l", label, "-c", n_ctx, "--score", args.score,
                          "--corpus", args.corpus, "--chunks", str(args.windows), "--concat", "--reference-form", form,
                          *common), None
    if kind == "kld":
        kv, rotation = (rest + ["auto"])[:2] if rest else ("f16", "auto")
        return qeval_argv("kld", "--ref", f"ref{n_ctx}", "--cand", str(models["Q4_0"]), "--json",
                          "-ctk", kv, "-ctv", kv, "--kv-rotation", rotation, *common), None
    if kind == "llama":
        if not args.llama_perplexity:
            sys.exit("llama:N needs --llama-perplexity")
        lp = Path(args.llama_perplexity)
        env = {**os.environ, "LD_LIBRARY_PATH": str(lp.parent)}
        base = SCRATCH / f"base{n_ctx}.kld"
        return [str(lp), "-m", str(models["Q8_0"]), "-f", str(corpus), "-c", n_ctx, "--chunks", "1",
                "--kl-divergence-base", str(base), "-fa", "on", "-t", str(args.threads)], env
    sys.exit(f"unknown step {step!r}: capture:N[:FORM], kld:N:KV[:ROT] or llama:N")


def capture_store(step: str) -> tuple[str, str]:
    """(store label, --reference-form) of a capture:N[:FORM] step: ref<N> in the logits form, ref<N>-<FORM> else."""
    _, n_ctx, *rest = step.split(":")
    form = rest[0] if rest else "logits"
    return f"ref{n_ctx}" + ("" if form == "logits" else f"-{form}"), form


def store_facts(store: Path) -> dict:
    """A capture's store: its bytes, scored tokens, bytes per scored token (the hidden form's also without its
    head) and the error it recorded (`qeval info --json`)."""
    if not store.is_file():
        return {"store_bytes": 0}
    info = json.loads(subprocess.run(qeval_argv("info", str(store), "--json"), capture_output=True, text=True,
                                     check=True).stdout)
    return {"store_bytes": info["size_bytes"], "scored_tokens": info["scored_tokens"],
            "bytes_per_scored_token": info["bytes_per_scored_token"],
            **{k: info[k] for k in ("form", "bytes_per_scored_token_without_head", "llamacpp_equivalent_bytes")
               if k in info}, "error": info["error"]}


def qeval_json(stdout: str) -> dict | None:
    """The result object `qeval kld --json` prints (None if the run printed none)."""
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        return None


RUNS = {"capture": "qeval capture (Q8_0)", "kld": "qeval live candidate (Q4_0)",
        "llama": "llama-perplexity --kl-divergence-base (Q8_0)"}


KV_ORDER = ("f16", "q8_0", "q4_0")


def parse_step(step: str) -> tuple[str, str, list[str]]:
    """A step's kind, n_ctx and KV part ([type] or [type, rotation]; f16 where the step names none: a capture's
    third part is its form, its KV f16)."""
    kind, n_ctx, *kv = step.split(":")
    return kind, n_ctx, kv if kv and kind == "kld" else ["f16"]


def table(doc: dict) -> str:
    """Markdown: the last run of each step (per --score, corpus and cap), by n_ctx, run, KV type and rotation."""
    last = {(s["step"], s["score"], s.get("corpus", DEFAULT_CORPUS), s["as_cap_gib"]): s for s in doc["steps"]}

    def order(s: dict) -> tuple:
        kind, n_ctx, kv = parse_step(s["step"])
        return (int(n_ctx), list(RUNS).index(kind), KV_ORDER.index(kv[0]), kv[1:] != ["on"], s["score"],
                FORMS.index(capture_store(s["step"])[1]) if kind == "capture" else 0)

    columns = ("n_ctx", "run", "KV (rotation)", "text", "scored rows", "wall, peak RSS", "store",
               "mean KLD ± SE, same top-1", "beside")
    rows = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for s in sorted(last.values(), key=order):
        kind, n_ctx, kv = parse_step(s["step"])
        stopped = s.get("stopped") or stop_reason(s["rc"], "\n".join(s["tail"]), int(s["as_cap_gib"] * 2**30))
        done = (f"stopped after {s['wall_s']:.0f} s, {s['peak_rss_gib']:.2f} GiB: {stopped}" if stopped
                else f"{s['wall_s']:.0f} s, **{s['peak_rss_gib']:.2f} GiB**")
        store = f"{s['store_bytes'] / 1e6:,.0f} MB" if s.get("store_bytes") else ""
        if s.get("bytes_per_scored_token"):
            store += f", {s['bytes_per_scored_token']:,.0f} B per scored token"
        if s.get("bytes_per_scored_token_without_head"):
            store += f" ({s['bytes_per_scored_token_without_head']:,.0f} without the head)"
        metrics = (s.get("result") or {}).get("metrics", {})
        quality = (f"{metrics['kld_mean']['value']:.4f} ± {metrics['kld_mean']['se']:.4f}, "
                   f"{metrics['same_top1_pct']['value']:.1f} %" if metrics else "")
        text = "" if kind == "kld" else Path(s.get("corpus", DEFAULT_CORPUS)).name  # kld: the reference's text
        kv_text = f"{kv[0]} ({kv[1]})" if len(kv) > 1 else kv[0]
        run = RUNS[kind] + (f", {capture_store(s['step'])[1]} form" if kind == "capture" else "")
        rows.append(f"| {int(n_ctx) // 1024}K | {run} | {kv_text} | {text} | "
                    f"{s['score'] if kind != 'llama' else 'second half'} | {done} | {store} | {quality} | "
                    f"{s.get('ran_beside', '')} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", help="comma-separated capture:N, kld:N:KV[:ROT], llama:N")
    ap.add_argument("--table", action="store_true", help="print --out's table (the last run of each step) and stop")
    ap.add_argument("--score", default="every:64")
    ap.add_argument("--windows", type=int, default=1, help="windows a capture step captures (--chunks): what a hidden "
                    "capture pays once, its head, weighs less over more windows")
    ap.add_argument("--corpus", default=DEFAULT_CORPUS,
                    help="what capture:N and llama:N read (`shipped`: every shipped text, for n_ctx past one book)")
    ap.add_argument("--llama-perplexity")
    ap.add_argument("--as-gib", type=float, default=14.0, help="address-space cap of every step, GiB")
    ap.add_argument("--beside", default="", help="what else of this series ran at the same time (recorded)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--models-dir", type=Path, default=SCRATCH / "models")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results"
                    / "fullwidth-qwen35moe-amd-epyc.json")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.out.read_text())))
        return
    if not args.steps:
        ap.error("give --steps (or --table)")
    models = build(args.models_dir)
    runs = SCRATCH / "runs"
    SCRATCH.mkdir(parents=True, exist_ok=True)
    corpus = SCRATCH / "corpus.txt"
    corpus.write_text(load_corpus(args.corpus).text)
    doc = json.loads(args.out.read_text()) if args.out.is_file() else {
        "cpu": cpu_name(), "cores": os.cpu_count(),
        "note": "ran_beside: what else of this series ran beside a step; load_average_before: the machine's load then",
        "models": {q: {"file": p.name, "bytes": p.stat().st_size} for q, p in models.items()}, "steps": []}
    as_bytes = int(args.as_gib * 2**30)
    for step in args.steps.split(","):
        argv, env = step_argv(step, models, args, runs, corpus)
        if step.startswith("capture"):  # a finished store of the same capture would be reused, not measured
            (runs / f"{capture_store(step)[0]}.qeval").unlink(missing_ok=True)
        result = {"step": step, "score": args.score, "windows": args.windows, "corpus": args.corpus,
                  "as_cap_gib": args.as_gib,
                  "ran_beside": args.beside, "load_average_before": os.getloadavg(),
                  **run_capped(argv, as_bytes, env)}
        stdout = result.pop("stdout")
        if step.startswith("kld"):
            result["result"] = qeval_json(stdout)
        if step.startswith("capture"):
            result.update(store_facts(runs / f"{capture_store(step)[0]}.qeval"))
        if step.startswith("llama"):
            base = SCRATCH / f"base{step.split(':')[1]}.kld"
            result["kld_base_bytes"] = base.stat().st_size if base.is_file() else 0
            base.unlink(missing_ok=True)
        doc["steps"].append(result)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        print(json.dumps({k: result.get(k) for k in ("step", "rc", "wall_s", "peak_rss_gib", "stopped")}), flush=True)


if __name__ == "__main__":
    main()
