"""qeval's speed and memory figures (`qeval deploy`) next to llama.cpp's own, on the same machine and build.

    python bench/bench_deploy.py [--rounds 3] [--reps 5] [--threads 2] [--quick] [--out bench/results/deploy-NAME]
        [--llama-bench PATH] [--llama-perplexity PATH]

Default paths: the tools built from the vendored llama.cpp (.../vendor/llama.cpp/build-tools/bin, or $LLAMA_BENCH and
$LLAMA_PERPLEXITY). It writes NAME.json and NAME.md (default NAME: deploy-<cpu>) with the machine and its load:

1. Speed, three rows of the demo's Gemma-3-270M (Q8_0, Q4_K_M, Q8_0 with KV q8_0), pp512 and tg128 at depths 0 and
   4096, each tool run as a user runs it: `qeval deploy ... --json` and `llama-bench ... -o json` in their own
   processes, same threads, batch sizes, KV cache and flash attention, R repetitions after a warm-up. Runs alternate
   (round k: qeval first when k is even, llama-bench first when odd); per tool and test the median over rounds of its
   medians; the ratio qeval / llama-bench (target: within 10 % on a quiet machine).
2. Memory of the same rows at contexts 4096 and 32768: qeval's figures (llama.cpp's log, read through the binding)
   against llama-perplexity's own log lines for the same context (another process, another binary: it creates the
   context, then refuses the short text), against the formula from the GGUF, and the RSS growth of a filled context
   (rss=1), whose difference between the two contexts is set against the KV cache's.
3. The tests' tiny qwen35moe (Gated DeltaNet + attention), as built there and with a wider recurrent state (so that
   its bytes show at llama.cpp's two-decimal MiB): memory at 1024, 2048 and 4096 under KV f16 and q8_0: the
   recurrent state flat, the attention KV growing.

--quick: pp64/tg16 at depths 0 and 512, 2 repetitions, one round: proves the script on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import cpu_name

from qeval.engine.memory import buffer_sizes, formula_bytes, memory_geometry
from qeval.orchestrate import demo

ROOT = Path(__file__).resolve().parent.parent
TOOLS = Path("/work/llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp/build-tools/bin")
ROWS = [("Q8_0", "Q8_0", "f16"), ("Q4_K_M", "Q4_K_M", "f16"), ("Q8_0+kv-q8_0", "Q8_0", "q8_0")]
CONTEXTS = (4096, 32768)
HYBRID_CONTEXTS = (1024, 2048, 4096)
MIB = 1 << 20


def fa_for(kv: str) -> str:
    return "auto" if kv in ("f16", "f32", "bf16") else "on"  # a quantized V cache needs flash attention


def qeval(*args: str) -> dict:
    cmd = [sys.executable, "-m", "qeval", "deploy", *args, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode not in (0, 2) or not proc.stdout.strip():
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def qeval_speed(quant: str, model: Path, kv: str, a) -> dict[str, float]:
    spec = f"ctx=0;depth={','.join(map(str, a.depths))};pp={a.pp};tg={a.tg};reps={a.reps}"
    out = qeval(f"{quant}={model}", "--kv", kv, "--spec", spec, "-t", str(a.threads), "--runs-dir", a.work,
                "--force")  # qeval labels the KV row itself: Q8_0+kv-q8_0
    record = out["deployment"]["records"][0]
    return {name(s["test"], s["tokens"], s["depth"]): s["tokens_per_s"]["median"] for s in record["speed"]}


def name(test: str, tokens: int, depth: int) -> str:
    return f"{test}{tokens}" + (f" @ d{depth}" if depth else "")


def llama_bench_speed(model: Path, kv: str, a) -> dict[str, float]:
    cmd = [a.llama_bench, "-m", str(model), "-p", str(a.pp), "-n", str(a.tg), "-d", ",".join(map(str, a.depths)),
           "-r", str(a.reps), "-t", str(a.threads), "-b", "2048", "-ub", "512", "-ctk", kv, "-ctv", kv,
           "-fa", fa_for(kv), "-ngl", "0", "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed:\n{proc.stderr[-3000:]}")
    out = {}
    for t in json.loads(proc.stdout):
        test, tokens = ("pp", t["n_prompt"]) if t["n_prompt"] else ("tg", t["n_gen"])
        out[name(test, tokens, t["n_depth"])] = statistics.median(t["samples_ts"])
    return out


def speed(models: dict, a) -> list[dict]:
    runs = {label: {"qeval": [], "llama-bench": []} for label, _, _ in ROWS}
    for k in range(a.rounds):
        for label, quant, kv in ROWS:
            tools = [("qeval", lambda: qeval_speed(quant, models[quant], kv, a)),
                     ("llama-bench", lambda: llama_bench_speed(models[quant], kv, a))]
            for tool, run in tools if k % 2 == 0 else tools[::-1]:
                runs[label][tool].append(run())
                print(f"round {k + 1}: {label} {tool}: {runs[label][tool][-1]}", file=sys.stderr, flush=True)
    rows = []
    for label, _, kv in ROWS:
        for test in runs[label]["qeval"][0]:
            q = [r[test] for r in runs[label]["qeval"]]
            b = [r[test] for r in runs[label]["llama-bench"]]
            rows.append({"label": label, "kv": kv, "test": test, "qeval_tps": statistics.median(q),
                         "llama_bench_tps": statistics.median(b), "ratio": statistics.median(q) / statistics.median(b),
                         "qeval_rounds": q, "llama_bench_rounds": b})
    return rows


def llama_perplexity_buffers(model: Path, kv: str, n_ctx: int, a) -> dict:
    """llama.cpp's own buffer lines for a context of n_ctx, from llama-perplexity (its real load: after the last
    dry run of common's fitting, whose buffers are logged as 0.00 MiB)."""
    text = Path(a.work) / "short.txt"
    text.write_text("A short text: llama-perplexity creates the context, then refuses it.\n")
    cmd = [a.llama_perplexity, "-m", str(model), "-f", str(text), "-c", str(n_ctx), "-b", "2048", "-ub", "512",
           "-ctk", kv, "-ctv", kv, "-fa", fa_for(kv), "-t", str(a.threads), "-ngl", "0", "-v"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stderr + proc.stdout
    return buffer_sizes(_last_load(log))


def _last_load(log: str) -> list[str]:
    """The lines of llama.cpp's last model load and context in a log (llama-perplexity's real one)."""
    lines = log.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if re.search(r"model buffer size =\s*[1-9]", line)]
    return lines[starts[-1]:] if starts else lines


def component(devices: dict, part: str) -> int:
    return sum(d.get(part, 0) for d in devices.values())


def memory(models: dict, a) -> list[dict]:
    rows = []
    spec = f"ctx={','.join(map(str, CONTEXTS))};pp=0;tg=0;rss={0 if a.no_rss else 1}"
    for label, quant, kv in ROWS:
        record = qeval(f"{quant}={models[quant]}", "--kv", kv, "--spec", spec, "-t", str(a.threads),
                       "--runs-dir", a.work, "--force")["deployment"]["records"][0]
        for figure in record["memory"]:
            theirs = llama_perplexity_buffers(models[quant], kv, figure["n_ctx"], a)
            ours = figure["devices"]
            rows.append({"label": label, "kv": kv, "n_ctx": figure["n_ctx"], "layout": figure["layout"],
                         "qeval": {p: component(ours, p) for p in ("model", "kv", "recurrent", "compute", "output")},
                         "llama_perplexity": {p: component(theirs, p) for p in ("model", "kv", "recurrent", "compute",
                                                                                  "output")},
                         "total_bytes": figure["total_bytes"], "formula": figure["formula"],
                         "rss_growth_bytes": figure["rss_growth_bytes"]})
    return rows


def hybrid(a) -> list[dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    import tinymodels  # noqa: PLC0415

    tokenizer = tinymodels.read_tokenizer(demo.prepare_models(demo.models_dir())["Q8_0"])
    variants = {"tests' dims": tinymodels.Qwen35MoeDims(),
                "wide state": tinymodels.Qwen35MoeDims(ssm_head_dim=64, ssm_k_heads=4, ssm_v_heads=8)}
    rows = []
    for variant, dims in variants.items():
        path = tinymodels.build_qwen35moe(Path(a.work) / f"qwen35moe-{variant.replace(' ', '-')}.gguf", tokenizer,
                                          dims)
        geometry = memory_geometry(path)
        for kv in ("f16", "q8_0"):
            record = qeval(f"hybrid={path}", "--kv", kv, "--spec",
                           f"ctx={','.join(map(str, HYBRID_CONTEXTS))};pp=0;tg=0", "-t", str(a.threads),
                           "--runs-dir", a.work, "--force")["deployment"]["records"][0]
            for figure in record["memory"]:
                rows.append({"variant": variant, "kv": kv, "n_ctx": figure["n_ctx"],
                             "kv_bytes": component(figure["devices"], "kv"),
                             "recurrent_bytes": component(figure["devices"], "recurrent"),
                             "formula": formula_bytes(geometry, figure["n_ctx"], kv, kv, 512),
                             "layout": figure["layout"]})
    return rows


def markdown(result: dict) -> str:
    m = result["machine"]
    out = [f"# qeval deploy next to llama.cpp's own figures ({m['cpu']})", "",
           f"Machine: {m['cpu']}, {m['cores']} cores, llama-cpp-python {m['llama_cpp']['version']}, backend "
           f"{m['backend']}; {result['threads']} threads. Load average (1, 5, 15 min) before: "
           f"{', '.join(f'{x:.2f}' for x in result['load_before'])}; after: "
           f"{', '.join(f'{x:.2f}' for x in result['load_after'])}. {result['rounds']} rounds alternated, "
           f"{result['reps']} repetitions each. Command: `{result['command']}`.", "",
           "## Speed: tokens per second (median over rounds of each tool's median)", "",
           "| row | KV | test | qeval | llama-bench | qeval / llama-bench |", "|---|---|---|---:|---:|---:|"]
    out += [f"| {r['label']} | {r['kv']} | {r['test']} | {r['qeval_tps']:,.2f} | {r['llama_bench_tps']:,.2f} | "
            f"{r['ratio']:.3f} |" for r in result["speed"]]
    out += ["", "## Memory (MiB): qeval (llama.cpp's log through the binding) vs llama-perplexity's own lines, "
                "the formula, RSS", "",
            "| row | KV | n_ctx | model | KV | compute | output | total | llama-perplexity KV / compute / output | "
            "formula KV | RSS growth |", "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in result["memory"]:
        q, lp = r["qeval"], r["llama_perplexity"]
        rss = "" if r["rss_growth_bytes"] is None else f"{r['rss_growth_bytes'] / MIB:,.1f}"
        out.append(f"| {r['label']} | {r['kv']} | {r['n_ctx']} | {q['model'] / MIB:,.2f} | {q['kv'] / MIB:,.2f} | "
                   f"{q['compute'] / MIB:,.2f} | {q['output'] / MIB:,.2f} | {r['total_bytes'] / MIB:,.2f} | "
                   f"{lp['kv'] / MIB:,.2f} / {lp['compute'] / MIB:,.2f} / {lp['output'] / MIB:,.2f} | "
                   f"{r['formula']['kv'] / MIB:,.2f} | {rss} |")
    out += ["", "## Hybrid (tiny qwen35moe): recurrent state flat, attention KV growing (bytes)", "",
            "| variant | KV | n_ctx | KV | formula KV | recurrent | formula recurrent |",
            "|---|---|---:|---:|---:|---:|---:|"]
    out += [f"| {r['variant']} | {r['kv']} | {r['n_ctx']} | {r['kv_bytes']:,} | {r['formula']['kv']:,} | "
            f"{r['recurrent_bytes']:,} | {r['formula']['recurrent']:,} |" for r in result["hybrid"]]
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-rss", action="store_true", help="skip the RSS children (filling a 32K context)")
    p.add_argument("--out", type=Path)
    p.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH") or str(TOOLS / "llama-bench"))
    p.add_argument("--llama-perplexity", default=os.environ.get("LLAMA_PERPLEXITY") or str(TOOLS / "llama-perplexity"))
    a = p.parse_args()
    a.pp, a.tg, a.depths = (64, 16, (0, 512)) if a.quick else (512, 128, (0, 4096))
    if a.quick:
        a.reps, a.rounds = min(a.reps, 2), 1
    a.work = tempfile.mkdtemp(prefix="qeval-bench-deploy-")
    models = demo.prepare_models(demo.models_dir())
    from qeval.engine.machine import current_machine  # noqa: PLC0415

    load_before, t0 = list(os.getloadavg()), time.time()
    result = {"machine": current_machine(), "threads": a.threads, "rounds": a.rounds, "reps": a.reps,
              "quick": a.quick, "command": " ".join(["python", "bench/bench_deploy.py", *sys.argv[1:]]),
              "load_before": load_before, "speed": speed(models, a), "memory": memory(models, a),
              "hybrid": hybrid(a)}
    result.update(load_after=list(os.getloadavg()), wall_s=round(time.time() - t0, 1))
    slug = re.sub(r"[^a-z0-9]+", "-", cpu_name().lower()).strip("-")[:32]
    out = a.out or ROOT / "bench" / "results" / f"deploy-{slug}{'-quick' if a.quick else ''}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
