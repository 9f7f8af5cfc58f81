"""One reference for everyone (issue 42), end to end on the demo's models: what a publisher writes and a user
downloads, and the time to a first KLD for a user who holds only the Q4_K_M GGUF.

    PYTHONPATH=.:tests nice python bench/bench_shared_reference.py [--chunks 80] [--work DIR] [--out FILE]

Gemma-3-270M (the demo's quants, ~/.cache/qeval/models), n_ctx 512, the shipped corpus, --chunks windows, every
thread of this machine, side by side in one run:

1. the publisher captures the Q8_0 reference in the default form (REF: `--reference-form auto`, hidden wherever its
   replay holds) and, to compare, in the logits form (LOG): seconds and bytes of each store, and the form of REF's
   pieces (reused from --work when there);
2. `qeval publish` puts REF on a local server that answers as the Hugging Face Hub does (tests/fake_hub.py, git LFS:
   the Xet protocol is not served locally): seconds and bytes sent;
3. a user with an empty huggingface_hub cache pulls it (`--ref hf:`: download, sha256, the store's own checksums):
   seconds and bytes downloaded; then `qeval kld` of the Q4_K_M GGUF live against it: seconds, and its figures;
4. the same user capturing the reference themselves instead (they would need the 292 MB Q8_0 GGUF): REF's capture
   seconds plus the live `qeval kld` against their own REF, whose figures must be the pulled one's to every digit.

Results go to bench/results/shared-reference-<cpu>.json (or --out), with the load average before and after: on a
shared machine the seconds move with its load; the bytes do not.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
from common import cpu_name
from fake_hub import FakeHub, endpoint, upload_hub
from pytest_httpserver import HTTPServer

from qeval import api
from qeval.orchestrate import demo
from qeval.storage import reference_pack
from qeval.storage.hidden_form import DEFAULT_FORM
from qeval.storage.store import StoreReader

REPO = "bench/gemma-3-270m-reference"


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def capture(work: Path, label: str, model: Path, chunks: int, form: str) -> dict:
    """Capture (or reuse) `label`: its seconds now (None when reused) and its bytes."""
    (result, _), seconds = timed(lambda: api.capture_store(str(model), label, runs_dir=work, chunks=chunks,
                                                           reference_form=form))
    path = work / f"{label}.qeval"
    return {"form": form, "seconds": seconds if result["status"] == "complete" else None,
            "bytes": path.stat().st_size, "path": path}


def kld(ref: str, cand: Path, chunks: int, work: Path) -> dict:
    (result, _), seconds = timed(lambda: api.kld_report(ref, str(cand), chunks=chunks, runs_dir=work))
    return {"seconds": seconds, "scored_tokens": result["scored_tokens"], "kld_mean": result["kld"]["mean"],
            "kld_max": result["kld"]["ladder"]["Maximum"], "kld_p99_9": result["kld"]["ladder"]["99.9%"],
            "same_top1": result["same_top1"]["fraction"], "ppl_cand": result["perplexity"]["ppl_cand"],
            "ppl_ref": result["perplexity"]["ppl_ref"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=80)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="qeval-shared-"))
    work.mkdir(parents=True, exist_ok=True)
    models = demo.prepare_models(demo.models_dir())
    out = {"cpu": cpu_name(), "threads": os.cpu_count(), "chunks": args.chunks, "n_ctx": 512,
           "load_average_before": os.getloadavg(),
           "gguf_bytes": {q: models[q].stat().st_size for q in ("Q8_0", "Q4_K_M")}}
    stores = {label: capture(work, label, models["Q8_0"], args.chunks, form)
              for label, form in (("REF", DEFAULT_FORM), ("LOG", "logits"))}
    with StoreReader(stores["REF"]["path"]) as ref:
        stores["REF"]["pieces"] = dict(Counter(form for _, _, form in ref.piece_forms()))
    server = HTTPServer()
    server.start()
    with pytest.MonkeyPatch.context() as mp:
        from huggingface_hub import constants

        endpoint(mp, server.url_for("").rstrip("/"))
        mp.setattr(constants, "HF_HUB_OFFLINE", False)
        mp.setattr(constants, "HF_HUB_CACHE", str(work / "publisher-cache"))
        upload_hub(mp)
        hub = FakeHub(server)
        _, out["publish_seconds"] = timed(lambda: api.publish_report(str(stores["REF"]["path"]), f"hf:{REPO}:REF"))
        out["publish_bytes_sent"] = sum(n for _, n in hub.puts)
        out["published_files"] = {name: len(data) for name, data in hub.repos[REPO].items()}
        user_cache = work / "user-cache"  # a user who never pulled anything
        mp.setattr(constants, "HF_HUB_CACHE", str(user_cache))
        reference_pack._verified.clear()
        pulled, out["pull_seconds"] = timed(lambda: reference_pack.pull(f"hf:{REPO}:REF"))
        out["pull_bytes"] = sum(p.stat().st_size for p in user_cache.rglob("*") if p.is_file() and not p.is_symlink())
        out["user_kld_vs_hf"] = kld(f"hf:{REPO}:REF", models["Q4_K_M"], args.chunks, work / "user-runs")
    server.stop()
    out["user_kld_vs_hf"]["pull_plus_kld_seconds"] = out["pull_seconds"] + out["user_kld_vs_hf"]["seconds"]
    own = out["self_kld_vs_own_ref"] = kld(str(stores["REF"]["path"]), models["Q4_K_M"], args.chunks, work / "self-runs")
    if stores["REF"]["seconds"] is not None:
        own["capture_plus_kld_seconds"] = stores["REF"]["seconds"] + own["seconds"]
    figures = [k for k in own if k not in ("seconds", "capture_plus_kld_seconds")]
    out["pulled_figures_equal_own"] = all(own[k] == out["user_kld_vs_hf"][k] for k in figures)
    out["stores"] = {label: {k: v for k, v in s.items() if k != "path"} for label, s in stores.items()}
    out["load_average_after"] = os.getloadavg()
    path = args.out or Path(__file__).parent / "results" / \
        f"shared-reference-{cpu_name().lower().replace(' ', '-').replace('(r)', '')}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    print("wrote", path, "pulled", pulled)


if __name__ == "__main__":
    main()
