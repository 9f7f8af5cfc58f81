"""The kit's tiny random-weight model pairs, one per vocab that matters, each pair small enough for one call.

Built with tests/tinymodels.py (its GGUF writer, tokenizer helpers and qwen35moe builder) at hidden width 32, so
that the two vocab matrices stay small at a 262K vocab; each pair is a reference (Q8_0: a head the hidden form
replays), quantized by llama.cpp's own quantizer from an F16 source and carried zstd-compressed, and a candidate
(Q4_0) that the device derives from it with the same quantizer (checks.unpack_pair): so both pairs fit one call.

* dense-262k: a two-layer llama-architecture model (attention, KV cache, flash attention) with Gemma-3's real
  tokenizer, vocab 262,144;
* qwen35moe-248k: the hybrid qwen35moe (Gated DeltaNet + attention, MoE) at Qwen3.5's vocab 248,320.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import zstandard

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))
import tinymodels
from fullwidth_model import QWEN35_VOCAB

from qeval.orchestrate import demo

T = gguf.MODEL_TENSOR
GEMMA_VOCAB = 262_144
N_EMBD = 32  # the smallest width Q4_0/Q8_0 blocks (32 values) quantize whole
REFERENCE, CANDIDATE = "Q8_0", "Q4_0"
PACKED_REFERENCE = "reference.gguf.zst"


@dataclass(frozen=True)
class DenseDims:
    n_embd: int = N_EMBD
    n_layer: int = 2
    n_head: int = 2
    n_head_kv: int = 1
    head_dim: int = 16
    n_ff: int = 64
    n_ctx_train: int = 4096


def build_dense(path: Path, tokenizer: list[tinymodels.MetadataEntry], dims: DenseDims = DenseDims(),
                seed: int = 0) -> Path:
    """A llama-architecture model: per layer RMS norm, grouped-query attention with RoPE, SwiGLU feed-forward."""
    m = tinymodels.TinyGGUF(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA], tokenizer, seed)
    w = m.writer
    w.add_context_length(dims.n_ctx_train)
    w.add_embedding_length(dims.n_embd)
    w.add_block_count(dims.n_layer)
    w.add_feed_forward_length(dims.n_ff)
    w.add_head_count(dims.n_head)
    w.add_head_count_kv(dims.n_head_kv)
    w.add_rope_dimension_count(dims.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    m.vocab_matrices(tinymodels.vocab_size(tokenizer), dims.n_embd)
    for layer in range(dims.n_layer):
        m.norm(T.ATTN_NORM, dims.n_embd, layer)
        m.tensor(T.ATTN_Q, (dims.n_embd, dims.head_dim * dims.n_head), layer)
        m.tensor(T.ATTN_K, (dims.n_embd, dims.head_dim * dims.n_head_kv), layer)
        m.tensor(T.ATTN_V, (dims.n_embd, dims.head_dim * dims.n_head_kv), layer)
        m.tensor(T.ATTN_OUT, (dims.head_dim * dims.n_head, dims.n_embd), layer)
        m.norm(T.FFN_NORM, dims.n_embd, layer)
        m.tensor(T.FFN_GATE, (dims.n_embd, dims.n_ff), layer)
        m.tensor(T.FFN_UP, (dims.n_embd, dims.n_ff), layer)
        m.tensor(T.FFN_DOWN, (dims.n_ff, dims.n_embd), layer)
    return m.finish()


def build_qwen35moe(path: Path, tokenizer: list[tinymodels.MetadataEntry]) -> Path:
    return tinymodels.build_qwen35moe(path, tokenizer, tinymodels.Qwen35MoeDims(n_embd=N_EMBD))


@dataclass(frozen=True)
class ModelSpec:
    name: str  # the piece is models-<name>/
    vocab: int
    build: Callable[[Path, list[tinymodels.MetadataEntry]], Path]


SPECS = (ModelSpec("dense-262k", GEMMA_VOCAB, build_dense),
         ModelSpec("qwen35moe-248k", QWEN35_VOCAB, build_qwen35moe))


def gemma_tokenizer() -> list[tinymodels.MetadataEntry]:
    """Gemma-3's tokenizer (vocab 262,144), read from the demo's published Q4_K_M GGUF."""
    return tinymodels.read_tokenizer(demo.assemble_source(demo.models_dir()))


def build_pair(spec: ModelSpec, out: Path, cache: Path) -> Path:
    """out/reference.gguf.zst: the Q8_0 reference, compressed so that every pair travels in one call (a machine that
    must start again spends minutes rebuilding); the device derives the Q4_0 candidate from it (checks.unpack_pair).
    The F16 source and the uncompressed reference stay in the cache."""
    cache.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    source = cache / f"{spec.name}-F16.gguf"
    if not source.is_file():
        tokenizer = tinymodels.truncate_tokenizer(gemma_tokenizer(), spec.vocab)
        partial = source.with_suffix(".gguf.part")
        spec.build(partial, tokenizer)
        partial.rename(source)
    reference = demo.quantize(source, cache / f"{spec.name}-{REFERENCE}.gguf", demo.DERIVED_FTYPES[REFERENCE])
    packed = out / PACKED_REFERENCE
    partial = packed.with_suffix(".part")
    with reference.open("rb") as src, partial.open("wb") as dst:
        zstandard.ZstdCompressor(level=19, threads=-1).copy_stream(src, dst)
    partial.replace(packed)
    return out
