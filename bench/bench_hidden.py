"""Could a reference store keep the final hidden state instead of the logits? (measurement only)

    PYTHONPATH=. nice -n 10 python bench/bench_hidden.py [--windows 4] [--f16]
        [--out bench/results/hidden-<cpu>.json]

A logits store keeps the reference's full-vocabulary logits (~113-138 KB per scored token at a
262,144 vocab). The alternative measured here keeps llama.cpp's final normalized hidden state
(2 bytes x n_embd per token) and replays the logits through the model's own output head, read from
the GGUF with gguf-py.

What llama.cpp computes (vendor/llama.cpp/src/models/gemma3.cpp): the last layer's output goes
through output_norm (RMS) into `result_norm`, which is `res->t_embd` (what an embeddings context
with pooling NONE returns, row by row); then `result_output = output @ result_norm`, where
`output` is `output.weight` or, when the GGUF has none, the tied `token_embd.weight`; then, only
if the GGUF sets `<arch>.final_logit_softcapping`, logits = c * tanh(logits / c). Nothing else.
An embeddings context (llama-context.cpp) still allocates and extracts logits (has_logits is always
true), but outputs every token of a batch, so logits and hidden states come from one decode.

On CPU a mul_mat first converts its float32 activations to the weight type's vec_dot_type
(ggml-cpu/ggml-cpu.c type_traits_cpu): Q8_0 -> q8_0 (per 32 values: d = amax/127 stored as fp16,
q = round(x * 127/amax), ggml-cpu/arch/x86/quants.c quantize_row_q8_0), F16 -> fp16, BF16 -> bf16;
the dot products then run on those (exact int8 block sums times d_w*d_x, accumulated in fp32).
So the replay is measured two ways:
  * plain: logits = float32(h) @ float32(W_out)^T, as a naive replay would do;
  * emulated: h is first rounded as ggml rounds it for the weight type (q8_0 fake-quantization
    for a Q8_0 head, fp16 for F16), then the same float32 matmul; and, on one window, the same in
    float64 (leaving only llama.cpp's fp32 accumulation order as a difference).
each from the hidden state as captured (f32) and as it would be stored (bf16, fp16).

Reported per variant: mean / 99.9 % / max KLD(llama.cpp || replay) in float64, same-top-1 %,
max |logit difference|; bytes per scored token (raw and zstd); replay throughput (matmul +
log-softmax, tokens/s). llama.cpp's logits are those of a plain logits-only context (what
qeval's Engine stores), and the embeddings context's own logits are checked against them.
Windows: n_ctx 512 from the shipped corpus, scored positions 256..510, BOS first, decoded in
128-token pieces (qeval.engine.engine). Timings on a shared 2-core machine are approximate.
--f16 requantizes the demo Q4_K_M to F16 (gemma-3-270m-F16.gguf next to the demo models) and
measures it too: its head's vec_dot_type is fp16, so there a 2-byte (fp16) store is what ggml multiplies.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path

import gguf
import numpy as np
import zstandard

from qeval.engine.engine import Engine, EngineSettings
from qeval.inputs.corpus import load_corpus, make_windows
from qeval.orchestrate import demo
from qeval.storage import hidden_form
from qeval.storage.scoring import HALF

N_CTX = 512
TOKEN_CHUNK = 64  # rows per replay/KLD step: bounds float64 temporaries to 64 x 262,144
LLAMA_FTYPE_MOSTLY_F16 = 1
QK8_0 = 32


# --- environment -----------------------------------------------------------------------------------
def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def cpu_slug(name: str) -> str:
    """'Intel(R) Xeon(R) Processor' -> 'intel-xeon-processor' (for the default result path)."""
    name = re.sub(r"\((R|TM)\)", "", name, flags=re.IGNORECASE)
    return "-".join(re.findall(r"[a-z0-9]+", name.lower())[:3])


# --- capture ---------------------------------------------------------------------------------------
def reference_logits(engine: Engine, window: np.ndarray) -> np.ndarray:
    """float32 [scored, n_vocab]: llama.cpp's logits as a logits-only context (qeval's store) gets them."""
    return np.concatenate([rows.copy() for _, rows in engine.iter_scored_logits(window)])


class HiddenCapture:
    """A second context on the engine's model with embeddings on (pooling NONE): every token of a
    batch is output, its `result_norm` row in the embeddings buffer and its logits in the logits buffer."""

    def __init__(self, engine: Engine):
        lc = self.lc = engine._lc
        self.engine = engine
        # the engine's own parameters (llama-perplexity's), so both contexts decode the same way
        cparams = engine._context_params()
        cparams.embeddings = True
        cparams.pooling_type = lc.LLAMA_POOLING_TYPE_NONE
        self.ctx = lc.llama_init_from_model(engine.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the embeddings context")
        self.n_embd = lc.llama_model_n_embd(engine.model)
        self.batch = lc.llama_batch_init(engine.n_batch, 0, 1)

    def window(self, window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(hidden float32 [scored, n_embd], logits float32 [scored, n_vocab]) of one window."""
        lc, eng = self.lc, self.engine
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        hidden, logits = [], []
        for start in range(0, N_CTX, eng.n_batch):  # the engine's pieces: same ubatch shapes
            stop = min(start + eng.n_batch, N_CTX)
            self._fill(window, start, stop)
            if lc.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
            positions = eng.scoring.positions(N_CTX)
            rows = positions[(positions >= start) & (positions < stop)] - start
            if not len(rows):
                continue
            n = stop - start  # every token is an output row, in batch order
            embd = np.ctypeslib.as_array(lc.llama_get_embeddings(self.ctx), shape=(n, self.n_embd))
            lg = np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(n, eng.n_vocab))
            hidden.append(embd[rows].copy())
            logits.append(lg[rows].copy())
        return np.concatenate(hidden), np.concatenate(logits)

    def _fill(self, window: np.ndarray, start: int, stop: int) -> None:
        b, n = self.batch, stop - start
        for i in range(n):
            pos = start + i
            b.token[i] = self.engine.bos if pos == 0 and self.engine.add_bos else int(window[pos])
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1
        b.n_tokens = n

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)


# --- the output head from the GGUF -----------------------------------------------------------------
def output_head(path: Path) -> tuple[np.ndarray, str, str, float]:
    """(W_out float32 [n_vocab, n_embd], tensor name, its GGML type, final_logit_softcapping or 0)."""
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    # llama_model_gemma3::load_arch_tensors: output.weight if present, else tied to token_embd
    tensor = tensors.get("output.weight") or tensors["token_embd.weight"]
    weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    arch = field_value(reader, "general.architecture")
    softcap = field_value(reader, f"{arch}.final_logit_softcapping") or 0.0
    return np.ascontiguousarray(weights), tensor.name, tensor.tensor_type.name, float(softcap)


def field_value(reader: gguf.GGUFReader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == gguf.GGUFValueType.STRING else value[0].item()


# --- how ggml rounds activations before the matmul -------------------------------------------------
def to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even, as ggml_compute_fp32_to_bf16), kept as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def to_fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def encode_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows as q8_0 blocks, as the AVX quantize_row_q8_0 of ggml-cpu/arch/x86/quants.c makes them (the shipped
    emulation, qeval.storage.hidden_form.encode_q8_0, over any leading dimensions): 34 bytes per 32 values."""
    d, q = hidden_form.encode_q8_0(x.reshape(-1, x.shape[-1]))
    return d.reshape(*x.shape[:-1], -1), q.reshape(*x.shape[:-1], -1, QK8_0)


def decode_q8_0(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    # d * q is exact in float32 (11 x 7 significant bits), as ggml's exact int8 block sums times d
    return (q.astype(np.float32) * d.astype(np.float32)[..., None]).reshape(*q.shape[:-2], -1)


def fake_q8_0(x: np.ndarray) -> np.ndarray:
    """What a Q8_0 mul_mat on CPU actually multiplies: x after a q8_0 round trip."""
    return decode_q8_0(*encode_q8_0(x))


ACTIVATION_ROUNDING = {"Q8_0": fake_q8_0, "F16": to_fp16, "BF16": to_bf16}
STORED_FORMS = {"f32": lambda h: h, "fp16": to_fp16, "bf16": to_bf16}


# --- replay and divergence -------------------------------------------------------------------------
def replay(h: np.ndarray, weights: np.ndarray, softcap: float) -> np.ndarray:
    """logits = h @ W^T in h's dtype, then what gemma3.cpp applies after the matmul."""
    logits = h @ weights.T
    if softcap:
        logits = softcap * np.tanh(logits / softcap)
    return logits


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def divergence(ref: np.ndarray, rep: np.ndarray) -> dict:
    """Per token: KLD(ref || rep) in float64, whether top-1 agrees, max |logit difference|."""
    lp, lq = log_softmax(ref.astype(np.float64)), log_softmax(rep.astype(np.float64))
    return {"kld": (np.exp(lp) * (lp - lq)).sum(axis=1),
            "same_top1": ref.argmax(axis=1) == rep.argmax(axis=1),
            "max_abs_logit": np.abs(ref.astype(np.float64) - rep).max(axis=1)}


def replay_divergence(ref: np.ndarray, h: np.ndarray, weights: np.ndarray, softcap: float) -> dict:
    """divergence() of a window, computed TOKEN_CHUNK rows at a time."""
    parts = [divergence(ref[s:s + TOKEN_CHUNK], replay(h[s:s + TOKEN_CHUNK], weights, softcap))
             for s in range(0, len(h), TOKEN_CHUNK)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def summarize(per_token: dict) -> dict:
    kld = per_token["kld"]
    return {"tokens": len(kld), "mean_kld": float(kld.mean()),
            "p999_kld": float(np.percentile(kld, 99.9)), "max_kld": float(kld.max()),
            "same_top1_pct": float(100 * per_token["same_top1"].mean()),
            "max_abs_logit_diff": float(per_token["max_abs_logit"].max())}


def replay_speed(h: np.ndarray, weights: np.ndarray, softcap: float, rounding, repeats: int = 2) -> dict:
    """Scored tokens/s of a float32 replay (activation rounding + matmul, then log-softmax), best of
    `repeats` (the machine is shared), and of its two parts."""
    best_matmul = best_softmax = float("inf")
    for _ in range(repeats):
        matmul = softmax = 0.0
        for s in range(0, len(h), TOKEN_CHUNK):
            t0 = time.perf_counter()
            logits = replay(rounding(h[s:s + TOKEN_CHUNK]), weights, softcap)
            t1 = time.perf_counter()
            log_softmax(logits)
            matmul, softmax = matmul + t1 - t0, softmax + time.perf_counter() - t1
        best_matmul, best_softmax = min(best_matmul, matmul), min(best_softmax, softmax)
    n = len(h)
    return {"tokens_per_s": n / (best_matmul + best_softmax), "matmul_tokens_per_s": n / best_matmul,
            "log_softmax_tokens_per_s": n / best_softmax}


def stored_bytes(hidden: np.ndarray) -> dict:
    """Bytes per scored token of the hidden state: raw and zstd (level 19) of its 2-byte forms and
    of its q8_0 blocks (fp16 scales and int8 values as two planes)."""
    zc = zstandard.ZstdCompressor(level=19)
    n, n_embd = hidden.shape
    fp16 = hidden.astype(np.float16)
    bf16 = (to_bf16(hidden).view(np.uint32) >> 16).astype(np.uint16)
    d, q = encode_q8_0(hidden)
    return {"n_embd": int(n_embd), "fp16_raw": 2 * n_embd, "bf16_raw": 2 * n_embd,
            "q8_0_raw": n_embd // QK8_0 * (2 + QK8_0),
            "fp16_zstd": len(zc.compress(fp16.tobytes())) / n, "bf16_zstd": len(zc.compress(bf16.tobytes())) / n,
            "q8_0_zstd": (len(zc.compress(d.tobytes())) + len(zc.compress(q.tobytes()))) / n,
            "max_abs_hidden": float(np.abs(hidden).max())}


def q8_0_disagreement(hidden: np.ndarray) -> dict:
    """Why a 2-byte store cannot be re-quantized into llama.cpp's q8_0 activations: the share of block
    scales and int8 values that differ from those of the f32 hidden state after fp16 / bf16 storage."""
    d_ref, q_ref = encode_q8_0(hidden)
    out = {}
    for form in ("fp16", "bf16"):
        d, q = encode_q8_0(STORED_FORMS[form](hidden))
        out[form] = {"scales_differ_pct": float(100 * (d != d_ref).mean()),
                     "int8_values_differ_pct": float(100 * (q != q_ref).mean())}
    return out


# --- one model -------------------------------------------------------------------------------------
def measure_model(path: Path, windows_text: str, n_windows: int) -> dict:
    weights, head_name, head_type, softcap = output_head(path)
    emulate = ACTIVATION_ROUNDING[head_type]
    variants = {f"{form}/{how}": [] for form in STORED_FORMS for how in ("plain", "emulated")}
    variants["f32/emulated_float64"] = []  # first window only: no float32 rounding in the replay
    same_ctx, hiddens = [], []
    engine = Engine(path, N_CTX, EngineSettings(n_threads=2))
    capture = HiddenCapture(engine)
    try:
        windows = make_windows(engine.tokenize(windows_text), N_CTX, n_windows)
        for k, window in enumerate(windows):
            ref = reference_logits(engine, window)
            hidden, embd_ctx_logits = capture.window(window)
            hiddens.append(hidden)
            same_ctx.append(divergence(ref, embd_ctx_logits))
            for form, store in STORED_FORMS.items():
                h = store(hidden)
                variants[f"{form}/plain"].append(replay_divergence(ref, h, weights, softcap))
                variants[f"{form}/emulated"].append(replay_divergence(ref, emulate(h), weights, softcap))
            if k == 0:
                variants["f32/emulated_float64"].append(
                    replay_divergence(ref, emulate(hidden).astype(np.float64), weights, softcap))
            print(f"{path.name}: window {k + 1}/{len(windows)}", flush=True)
    finally:
        capture.close()
        engine.close()
    hidden_all = np.concatenate(hiddens)
    joined = {name: {k: np.concatenate([p[k] for p in parts]) for k in parts[0]} for name, parts in variants.items()}
    sample = hiddens[0]
    return {
        "model": path.name, "output_head": head_name, "output_head_type": head_type,
        "final_logit_softcapping": softcap, "n_vocab": int(weights.shape[0]),
        "activation_rounding_emulated": emulate.__name__,
        "bytes_per_scored_token": stored_bytes(hidden_all),
        "q8_0_after_2byte_storage": q8_0_disagreement(hidden_all),
        "embeddings_context_logits_vs_logits_context": summarize(
            {k: np.concatenate([p[k] for p in same_ctx]) for k in same_ctx[0]}),
        "replay": {name: summarize(per_token) for name, per_token in joined.items()},
        # storing h in the weight type's vec_dot_type form (q8_0 blocks for a Q8_0 head, fp16 for F16)
        # is exactly what `emulated` replays from f32: decode_q8_0(encode_q8_0(h)) is fake_q8_0(h)
        "stored_vec_dot_form": {"Q8_0": "q8_0 blocks (34 bytes / 32 values)", "F16": "fp16",
                                "BF16": "bf16"}[head_type],
        "replay_speed_float32": {"plain": replay_speed(sample, weights, softcap, lambda h: h),
                                 "emulated": replay_speed(sample, weights, softcap, emulate)},
    }


def meets_criterion(summary: dict) -> bool:
    """The issue's bar for shipping a hidden-state codec."""
    return summary["mean_kld"] <= 1e-5 and summary["same_top1_pct"] >= 99.9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=4, help="windows of 512 tokens (255 scored each)")
    ap.add_argument("--f16", action="store_true", help="also an F16 model requantized from the Q4_K_M")
    ap.add_argument("--out", default=None, help="default bench/results/hidden-<cpu>.json")
    args = ap.parse_args()
    cpu = cpu_name()
    out_path = Path(args.out or f"bench/results/hidden-{cpu_slug(cpu)}.json")
    paths = demo.prepare_models(demo.models_dir())
    models = [paths["Q8_0"]]
    if args.f16:
        models.append(demo.quantize(paths["Q4_K_M"], demo.model_path("F16", demo.models_dir()),
                                    LLAMA_FTYPE_MOSTLY_F16))
    text = load_corpus().text
    result = {"cpu": cpu, "n_ctx": N_CTX, "windows": args.windows,
              "scored_positions": [int(HALF.positions(N_CTX)[0]), int(HALF.positions(N_CTX)[-1])],
              "criterion": "mean KLD(llama.cpp || replay) <= 1e-5 and same top-1 >= 99.9 %",
              "models": [measure_model(p, text, args.windows) for p in models]}
    for model in result["models"]:
        model["meets_criterion"] = {name: meets_criterion(s) for name, s in model["replay"].items()}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
