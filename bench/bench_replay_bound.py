"""What the hidden form's capture could prove instead of replaying (issue 42, item 1): an a-priori bound on the
portable replay's distance from llama.cpp's logits, against the distance the capture measures today.

    PYTHONPATH=.:bench nice python bench/bench_replay_bound.py [--chunks 2] [--work DIR] [--store S] [--out FILE]

A hidden capture replays every scored row through the output head with qeval's portable kernel (docs/why-logits.md),
to record that replay's error against llama.cpp's logits: most of the capture's time. The replay's only difference
from llama.cpp's Q8_0 head is float32 rounding in ggml's sum of a row's block products (each block's int8 dot product
is an exact integer; a product of two fp16 scales is exact in float32). Rounding-error analysis bounds it with no
replay: a sum of terms along a path of at most K float32 roundings is off by at most γ_K · Σ|terms|,
γ_K = K·u / (1 - K·u), u = 2⁻²⁴ (Higham, Accuracy and Stability of Numerical Algorithms, §3.1). Per vocabulary
entry v, Σ_b |dot_b · dx_b · dw_bv| ≤ Σ_b (|dx_b| · ‖qx_b‖₁) · (|dw_bv| · max_j |qw_bjv|) =: A_v, a product of
n_embd/32 terms per entry (32× fewer than the replay's); for every entry at once, Σ_b (|dx_b| · ‖qx_b‖₁) · max_v
(|dw_bv| · max_j |qw_bjv|) costs n_embd operations per token, none over the vocabulary ("head maxima"). Both sides'
rounding to float32 adds u·|logit| (|logit| ≤ A_v). With every entry within ε_v, KL(exact ‖ replay) ≤ ½ Σ_v p_v ε_v²
e^{ε_v} (e^δ ≤ 1 + δ + ½δ²e^{|δ|}: "weighted", which needs the exact p, a pass over the vocabulary), and with one ε
for all entries KL ≤ ε²/2 (Hoeffding's lemma: "uniform").

K is a claim about ggml's kernels: on x86 (AVX2, AVX-512) a row's blocks are fused-multiply-added into float32 lanes
and the lanes summed at the end (K = nb + 4 for 16 lanes); a scalar or NEON kernel rounds a block's product and its
sum apart (K ≤ 2·nb + 8); any order of all n_embd products, K = n_embd. The bench prints each.

On the store's own capture machine, llama.cpp's kernel (ggml_replay) gives llama.cpp's logits bit for bit (the
store's ggml record says so), so the bench reads its rows as the exact logits; it refuses a machine where they do not
hash as the capture's. By default it captures Gemma-3-270M Q8_0's reference (--chunks windows of 512) in the hidden
form into --work; --store reads a hidden (or auto) store captured on this machine instead (the full-width model's of
bench_fullwidth.py). Results: bench/results/replay-bound-<cpu>.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from common import cpu_name

from qeval import api
from qeval.orchestrate import demo
from qeval.storage.codec import replayed_rows
from qeval.storage.hidden_form import HIDDEN
from qeval.storage.store import StoreReader

U = 2.0 ** -24


def gamma(k: int) -> float:
    return k * U / (1 - k * U)


def block_maxima(head) -> np.ndarray:
    """float64 [nb, V]: |dw_bv| · max_j |qw_bjv| of a Q8_0 head."""
    w = head.weights
    q_max = np.abs(w.values.astype(np.int16)).max(axis=2)  # [tiles, nb, VT]
    per_tile = np.abs(w.scales) * q_max
    return per_tile.transpose(1, 0, 2).reshape(per_tile.shape[1], -1)[:, :head.n_vocab]


def row_sums(rows) -> np.ndarray:
    """float64 [T, nb]: |dx_b| · ‖qx_b‖₁ of stored q8_0 rows."""
    return np.abs(rows.scales) * np.abs(rows.values.astype(np.float64)).sum(axis=2)


def head_maxima_bound(rows, w_max_b: np.ndarray, k: int) -> np.ndarray:
    """Per token, with no pass over the vocabulary: ε for every entry and its uniform KL bound ε²/2."""
    a = row_sums(rows) @ w_max_b  # ≥ Σ_b |terms| and ≥ |logit| of every entry
    eps = (gamma(k) + 2 * U) * a
    return eps ** 2 / 2


def bounds(rows, w_max: np.ndarray, exact: np.ndarray, k: int) -> dict:
    """Per token: ε (one for every entry), its KL bound, and the per-entry KL bound weighted by the exact p."""
    a = row_sums(rows) @ w_max  # [T, V] ≥ Σ_b |terms| (BLAS float64: its own rounding is ~1e-14 relative, << γ_K)
    eps = gamma(k) * a + 2 * U * np.abs(exact.astype(np.float64))
    logp = exact.astype(np.float64) - exact.max(axis=1, keepdims=True)
    p = np.exp(logp)
    p /= p.sum(axis=1, keepdims=True)
    eps_max = eps.max(axis=1)
    return {"eps_max": eps_max, "kl_uniform": eps_max ** 2 / 2,
            "kl_weighted": 0.5 * (p * eps ** 2 * np.exp(eps)).sum(axis=1)}


def measured(exact: np.ndarray, replayed: np.ndarray) -> dict:
    """The portable replay's error as the capture measures it: max |Δ logit| and KL(exact ‖ replay) per token."""
    e, r = exact.astype(np.float64), replayed.astype(np.float64)
    lp_e = e - np.logaddexp.reduce(e, axis=1, keepdims=True)
    lp_r = r - np.logaddexp.reduce(r, axis=1, keepdims=True)
    return {"max_abs": np.abs(r - e).max(axis=1), "kl": (np.exp(lp_e) * (lp_e - lp_r)).sum(axis=1)}


def stats(v: np.ndarray) -> dict:
    return {"mean": float(v.mean()), "p99.9": float(np.quantile(v, 0.999)), "max": float(v.max())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/qeval-bench-replay-bound"))
    ap.add_argument("--store", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    store = args.store
    if store is None:
        args.work.mkdir(parents=True, exist_ok=True)
        store = args.work / "HID.qeval"
        api.capture_store(str(demo.model_path("Q8_0", demo.models_dir())), "HID", out=str(store),
                          chunks=args.chunks, reference_form=HIDDEN)
    with StoreReader(store) as reader:
        model = reader.header.model.get("file_name", "?")
        head = reader.output_head
        if head.ggml_type != "Q8_0" or head.softcap:
            raise SystemExit(f"{store}: the bound here is of a Q8_0 head without a soft-cap, not {head.ggml_type} "
                             f"(soft-cap {head.softcap})")
        nb = head.n_embd // 32
        kernels = {"x86 lanes (nb + 4)": nb + 4, "any ggml CPU kernel (2 nb + 8)": 2 * nb + 8,
                   "any order (n_embd)": head.n_embd}
        w_max = block_maxima(head)
        w_max_b = w_max.max(axis=1)
        parts: dict[str, list] = {}
        seconds = {"portable replay": 0.0, "bound (weighted, one K; numpy)": 0.0, "bound (head maxima, one K)": 0.0}
        for index in range(reader.header.chunk_start, reader.header.chunk_stop):
            for piece in reader.iter_pieces(index):
                rows = piece._stored_rows()
                exact, replay = piece._uncoded_rows()
                if replay.engine != "ggml" or replay.record.max_abs_dlogp().max() > 1e-11:
                    raise SystemExit("llama.cpp's kernel does not give llama.cpp's logits here: run on the "
                                     "capturing machine")
                t0 = time.perf_counter()
                portable = np.concatenate(list(replayed_rows(head, rows)))
                seconds["portable replay"] += time.perf_counter() - t0
                for name, value in measured(exact, portable).items():
                    parts.setdefault(f"measured {name}", []).append(value)
                for label, k in kernels.items():
                    t0 = time.perf_counter()
                    found = bounds(rows, w_max, exact, k)
                    t1 = time.perf_counter()
                    found["kl_head_maxima"] = head_maxima_bound(rows, w_max_b, k)
                    seconds["bound (weighted, one K; numpy)"] += (t1 - t0) / len(kernels)
                    seconds["bound (head maxima, one K)"] += (time.perf_counter() - t1) / len(kernels)
                    for name, value in found.items():
                        parts.setdefault(f"{label}: {name}", []).append(value)
    n = sum(len(v) for v in parts["measured kl"])
    result = {"cpu": cpu_name(), "store": str(store), "model": model, "head": [head.n_vocab, head.n_embd],
              "scored_tokens": n, "nb": nb,
              "ms_per_token": {k: 1e3 * v / n for k, v in seconds.items()},
              **{k: stats(np.concatenate(v)) for k, v in parts.items()}}
    print(json.dumps(result, indent=1))
    slug = cpu_name().lower().replace(" ", "-")
    out = args.out or Path(f"bench/results/replay-bound-{slug}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
