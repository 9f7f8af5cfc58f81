"""The hidden form of a reference against the logits form, measured end to end (docs/why-logits.md)

    PYTHONPATH=. nice python bench/bench_hidden_form.py sizes [--chunks 4] [--work DIR] [--out FILE]
    PYTHONPATH=. nice python bench/bench_hidden_form.py speed [--chunks 4] [--work DIR] [--out FILE]

Gemma-3-270M Q8_0 (the demo's quants, ~/.cache/qeval/models), n_ctx 512, the shipped corpus, --chunks windows,
every thread of this machine. Both subcommands capture (or reuse, from --work) the same reference three times with
`qeval capture`'s code: --reference-form logits (LOG), hidden (HID) and auto (AUT, the default).

sizes: bytes per scored token of each store (the whole file; the hidden one also without its head, which is stored
  once whatever the number of tokens, and per part: hidden rows, scalars and ids, error record), beside llama.cpp's
  --kl-divergence-base (524,296 B per token at this vocabulary); capture seconds per scored token of each form; and
  `qeval certify` of a copy of the auto store (what publish pays for its lean pieces).
speed: side by side in one run (best of --repeats): replaying the hidden store (reading every chunk's rows as a
  comparison does: decompress, replay through the head on every core), in scored tokens per second: uncoded by
  llama.cpp's own kernel (ggml) and by qeval's portable one (a live comparison's read), and coded (a stored
  candidate's comparison: portable replay, then the code); `qeval kld` (the
  comparison alone, metrics.compare) of a Q4_0 store against LOG and against HID; and live, the Q4_0 GGUF decoded
  against each reference (the forward pass included), seconds per scored token.

Results go to bench/results/hidden-form-<subcommand>-<cpu>.json (or --out). On a shared machine the timings move
with its load, which is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from common import best, cpu_name

from qeval import api
from qeval.compare import metrics
from qeval.orchestrate import demo
from qeval.orchestrate.certify import certify_store
from qeval.storage.error_record import record_bytes
from qeval.storage.store import StoreReader

LLAMACPP_BYTES_PER_TOKEN = 524_296  # llama.cpp --kl-divergence-base per scored token at this vocabulary (measured)


def capture(work: Path, label: str, model: Path, chunks: int, form: str) -> float:
    """Capture (or reuse) `label`; seconds it took now (0 when reused)."""
    t0 = time.perf_counter()
    result, _ = api.capture_store(str(model), label, runs_dir=work, chunks=chunks, reference_form=form)
    return time.perf_counter() - t0 if result["status"] == "complete" else 0.0


def captures(work: Path, chunks: int) -> dict:
    models = demo.prepare_models(demo.models_dir())
    seconds = {label: capture(work, label, models["Q8_0"], chunks, form)
               for label, form in (("LOG", "logits"), ("HID", "hidden"), ("AUT", "auto"))}
    return {"models": models, "capture_seconds": seconds}


def sizes(work: Path, chunks: int) -> dict:
    done = captures(work, chunks)
    out = {}
    for label in ("LOG", "HID", "AUT"):
        with StoreReader(work / f"{label}.qeval") as r:
            scored = sum(r.header.n_scored_of(c) for c in r.chunk_indices)
            size = r.size_bytes
            entry = {"file_bytes": size, "scored_tokens": scored, "bytes_per_token": size / scored,
                     "x_smaller_than_llamacpp": LLAMACPP_BYTES_PER_TOKEN * scored / size,
                     "error_record_bytes_per_token": record_bytes(scored, 32) / scored,
                     "capture_seconds": done["capture_seconds"][label],
                     "capture_seconds_per_token": done["capture_seconds"][label] / scored}
            if r.header.hidden:
                head = r.header.head["bytes"]
                entry.update(head_bytes=head, bytes_per_token_without_head=(size - head) / scored,
                             hidden_row_raw_bytes=r.output_head.activation.row_bytes(r.header.head["n_embd"]))
            out[label] = entry
    return {"stores": out, "llamacpp_bytes_per_token": LLAMACPP_BYTES_PER_TOKEN, "certify": certify_copy(work)}


def certify_copy(work: Path) -> dict:
    """What `qeval certify` (publish) then pays for the auto store's lean pieces, on a copy: seconds, pieces."""
    copy = work / "AUT-certified.qeval"
    shutil.copy(work / "AUT.qeval", copy)
    t0 = time.perf_counter()
    res = certify_store(copy)
    return {"seconds": time.perf_counter() - t0, "lean_pieces": res.lean_pieces, "kept_hidden": res.kept_hidden,
            "coded": res.coded, "file_bytes": res.size_bytes}


def speed(work: Path, chunks: int, repeats: int) -> dict:
    done = captures(work, chunks)
    q4 = done["models"]["Q4_0"]
    capture(work, "Q4_0", q4, chunks, "logits")
    out = {}
    for engine in ("ggml", "portable"):
        with StoreReader(work / "HID.qeval") as hid:
            if engine == "portable":
                hid.replay_matched("ggml", False)  # as on a CPU whose ggml sums otherwise
            hid.output_head.weights  # loaded once, as a comparison does on its first chunk
            scored = sum(hid.header.n_scored_of(c) for c in hid.chunk_indices)
            for c in hid.chunk_indices[:1]:  # warm: ggml's copy of the head, compiled kernels
                list(hid.read_chunk(c).iter_rows(hid.header.n_vocab))
            replay = best(lambda: [list(hid.read_chunk(c).iter_rows(hid.header.n_vocab)) for c in hid.chunk_indices],
                          repeats)
            out[f"replay_uncoded_{engine}_tokens_per_s"] = scored / replay
            out[f"replay_uncoded_{engine}_engines"] = hid.replay_matches
            if engine == "portable":  # the coded read (samplers against a stored candidate): portable, coded
                replay = best(lambda: [hid.read_chunk(c).codes(hid.header.n_vocab) for c in hid.chunk_indices],
                              repeats)
                out["replay_coded_tokens_per_s"] = scored / replay  # on REPLAY_THREADS threads (every core)
    for ref in ("LOG", "HID"):
        with StoreReader(work / f"{ref}.qeval") as r, StoreReader(work / "Q4_0.qeval") as cand:
            t = best(lambda: metrics.compare(r, cand, threads=os.cpu_count()), repeats)
        out[f"kld_store_vs_{ref}_seconds_per_token"] = t / scored
        t0 = time.perf_counter()
        api.kld_report(str(work / f"{ref}.qeval"), str(q4), runs_dir=work)
        out[f"kld_live_q4_0_vs_{ref}_seconds_per_token"] = (time.perf_counter() - t0) / scored
    return {"scored_tokens": scored, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("sizes", "speed"))
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/qeval-bench-hidden-form"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    result = sizes(args.work, args.chunks) if args.what == "sizes" else speed(args.work, args.chunks, args.repeats)
    cpu = cpu_name()
    result = {"cpu": cpu, "threads": os.cpu_count(), "load_average": os.getloadavg(), "chunks": args.chunks,
              "n_ctx": 512, "model": "gemma-3-270m-Q8_0", **result}
    slug = "-".join(cpu.lower().replace("(r)", "").replace("(tm)", "").split()[:3])
    out = args.out or Path(f"bench/results/hidden-form-{args.what}-{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
