"""A random-weight qwen35moe GGUF at Qwen3.5-35B-A3B's width, quantized to Q8_0 and Q4_0 (issue 28).

    python bench/fullwidth_model.py [--dir ~/.cache/qeval/fullwidth] [--experts 8] [--experts-used 2]

The layers are tests/tinymodels.py's qwen35moe builder with full-width sizes (Qwen35MoeDims); what is cut
is depth and expert count, so that the model fits a small machine's disk and time:

* as the real model: vocab 248,320, d_model 2048, one block of its pattern (3 Gated DeltaNet layers, then one
  gated-attention layer), attention 16 query heads / 2 KV heads of 256 with 64 rotated dims (partial rotary
  0.25, M-RoPE sections 11/11/10), DeltaNet 16 key heads and 32 value heads of 128 with a 4-tap convolution,
  experts and the shared expert of FFN width 512;
* cut: 4 layers instead of 40 (one block of ten), --experts routed experts (default 8, of 256), --experts-used
  per token (default 2, of 8).

The tokenizer is Gemma-3's real one (from the demo's cached Gemma-3-270M GGUF) cut to its first 248,320 pieces
(tinymodels.truncate_tokenizer): no GGUF tokenizer of Qwen3.5's own was found in the package registry's lists, and
what the measurements need is the vocab's size, which sets every per-row cost and the logits' memory.
The F16 source is built once; the quants come from llama.cpp's own quantizer (demo.quantize), each
skipped when it exists.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import tinymodels  # noqa: E402

from qeval.orchestrate import demo  # noqa: E402

QWEN35_VOCAB = 248_320
QUANTS = ("Q8_0", "Q4_0")


def fullwidth_dims(n_expert: int, n_expert_used: int) -> tinymodels.Qwen35MoeDims:
    """Qwen3.5-35B-A3B's widths, one block deep, n_expert experts."""
    return tinymodels.Qwen35MoeDims(
        n_embd=2048, n_ctx_train=262_144, n_layer=4, full_attention_interval=4,
        n_head=16, n_head_kv=2, head_dim=256, n_rot=64, rope_sections=(11, 11, 10, 0),
        ssm_conv_kernel=4, ssm_head_dim=128, ssm_k_heads=16, ssm_v_heads=32,
        n_expert=n_expert, n_expert_used=n_expert_used, n_ff_expert=512, n_ff_shared=512)


def build(directory: Path, n_expert: int = 8, n_expert_used: int = 2) -> dict[str, Path]:
    """quant -> path of the full-width model, the F16 source included."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"qwen35moe-fullwidth-4L-{n_expert}x{n_expert_used}e"
    source = directory / f"{stem}-F16.gguf"
    if not source.is_file():
        gemma = demo.prepare_models(demo.models_dir())[demo.REFERENCE]
        tokenizer = tinymodels.truncate_tokenizer(tinymodels.read_tokenizer(gemma), QWEN35_VOCAB)
        partial = source.with_suffix(".gguf.part")
        tinymodels.build_qwen35moe(partial, tokenizer, fullwidth_dims(n_expert, n_expert_used))
        partial.rename(source)
    paths = {"F16": source}
    for quant in QUANTS:
        paths[quant] = demo.quantize(source, directory / f"{stem}-{quant}.gguf", demo.DERIVED_FTYPES[quant])
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=demo.cache_dir() / "fullwidth")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--experts-used", type=int, default=2)
    args = ap.parse_args()
    for quant, path in build(args.dir, args.experts, args.experts_used).items():
        print(f"{quant}\t{path}\t{path.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
