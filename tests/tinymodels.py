"""Tiny random-weight GGUF models of other architectures, carrying Gemma-3's real tokenizer.

Each builder writes one small model with gguf-py (tensor names from gguf.TENSOR_NAMES, shapes as
the vendored llama.cpp's loader creates them in src/models/<arch>.cpp) and random weights from a
fixed seed. Dims are tiny (hidden 64) so a 64-token window decodes in milliseconds; the two
262,144 x 64 vocab matrices dominate the size (32 MiB each in F16). Shapes below are written in
ggml's order (ne0 = the row length, the input dimension of a weight), as llama.cpp lists them.

Scales keep every activation near unit size (weights ~ N(0, 1/fan_in), RMS norms of one), and the
output matrix is separate from the embedding and scaled so logits spread over a few nats: the
distributions are neither one-hot nor flat, and a quantized copy differs measurably.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

T = gguf.MODEL_TENSOR
N_EMBD = 64
LOGIT_SPREAD = 3.0  # std of the logits: a few nats between likely and unlikely tokens
NORMAL_BLOCK_ROWS = 4096  # rows drawn per call: a full-width vocab matrix never exists in float64


@dataclass(frozen=True)
class MetadataEntry:
    key: str
    value: object
    types: tuple[gguf.GGUFValueType, ...]  # (type,) or (ARRAY, element type)


def read_tokenizer(gguf_path: Path) -> list[MetadataEntry]:
    """Every tokenizer.ggml.* key of a GGUF (token pieces, scores, types, special ids, flags)."""
    reader = gguf.GGUFReader(gguf_path)
    return [MetadataEntry(key, field.contents(), tuple(field.types))
            for key, field in reader.fields.items() if key.startswith("tokenizer.ggml.")]


def truncate_tokenizer(tokenizer: list[MetadataEntry], n_tokens: int) -> list[MetadataEntry]:
    """The first n_tokens pieces only: a small vocab for models that are refused anyway (the
    special ids of Gemma's vocab are all below 10, so they stay valid)."""
    return [MetadataEntry(e.key, e.value[:n_tokens], e.types) if e.types[0] == gguf.GGUFValueType.ARRAY else e
            for e in tokenizer]


def vocab_size(tokenizer: list[MetadataEntry]) -> int:
    return next(len(e.value) for e in tokenizer if e.key == "tokenizer.ggml.tokens")


class TinyGGUF:
    """A GGUFWriter for one architecture, plus a seeded generator for its random weights."""

    def __init__(self, path: Path, arch: str, tokenizer: Sequence[MetadataEntry] = (), seed: int = 0):
        self.path, self.arch = Path(path), arch
        self.rng = np.random.default_rng(seed)
        self.writer = gguf.GGUFWriter(self.path, arch)
        self.writer.add_name(f"tiny-{arch}")
        self.writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        for entry in tokenizer:
            self.writer.add_key_value(entry.key, entry.value, entry.types[0],
                                      sub_type=entry.types[1] if len(entry.types) > 1 else None)

    def tensor(self, kind: T, ne: tuple[int, ...], bid: int | None = None, suffix: str = ".weight",
               data: np.ndarray | None = None, scale: float | None = None, dtype=np.float32) -> None:
        """Add tensor `kind` of ggml shape `ne`: `data` if given, else N(0, scale²) with scale
        defaulting to 1/sqrt(ne[0]), which keeps a matmul's output at its input's size."""
        shape = tuple(reversed(ne))  # numpy's shape is ggml's ne reversed
        if data is None:
            data = self._normal(shape, scale if scale is not None else ne[0] ** -0.5, dtype)
        name = gguf.TENSOR_NAMES[kind].format(bid=bid) + suffix
        self.writer.add_tensor(name, np.asarray(data, dtype=dtype).reshape(shape))

    def _normal(self, shape: tuple[int, ...], scale: float, dtype) -> np.ndarray:
        """N(0, scale²) drawn a block of rows at a time into `dtype`: the same numbers as one draw
        (the generator's stream is sequential), without a float64 copy of a vocab-sized matrix."""
        out = np.empty(shape, dtype=dtype)
        rows = out.reshape(-1, shape[-1])
        for start in range(0, len(rows), NORMAL_BLOCK_ROWS):
            block = rows[start:start + NORMAL_BLOCK_ROWS]
            block[...] = self.rng.normal(0.0, scale, size=block.shape)
        return out

    def norm(self, kind: T, n: int, bid: int | None = None) -> None:
        self.tensor(kind, (n,), bid, data=np.ones(n))

    def vocab_matrices(self, n_vocab: int, n_embd: int = N_EMBD) -> None:
        """Input embedding and a separate output head (tied ones make a random model echo its input)."""
        self.tensor(T.TOKEN_EMBD, (n_embd, n_vocab), scale=1.0, dtype=np.float16)
        self.norm(T.OUTPUT_NORM, n_embd)
        self.tensor(T.OUTPUT, (n_embd, n_vocab), scale=LOGIT_SPREAD / n_embd ** 0.5, dtype=np.float16)

    def finish(self) -> Path:
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_tensors_to_file()
        self.writer.close()
        return self.path


# --------------------------------------------------------------------------------------------------
# qwen35moe: Gated-DeltaNet recurrent layers, full attention every 4th layer, MoE feed-forward
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Qwen35MoeDims:
    n_embd: int = N_EMBD
    n_ctx_train: int = 4096
    n_layer: int = 4  # layers 0-2 recurrent, layer 3 full attention
    full_attention_interval: int = 4
    n_head: int = 2
    n_head_kv: int = 1
    head_dim: int = 32
    n_rot: int = 16
    rope_sections: tuple[int, int, int, int] = (3, 3, 2, 0)  # interleaved M-RoPE, sums to n_rot / 2
    ssm_conv_kernel: int = 4
    ssm_head_dim: int = 16  # ssm.state_size: key and value head size of the delta net
    ssm_k_heads: int = 2  # ssm.group_count
    ssm_v_heads: int = 2  # ssm.time_step_rank
    n_expert: int = 4
    n_expert_used: int = 2
    n_ff_expert: int = 32
    n_ff_shared: int = 32

    def is_recurrent(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval != 0


def build_qwen35moe(path: Path, tokenizer: list[MetadataEntry], dims: Qwen35MoeDims = Qwen35MoeDims(),
                    seed: int = 0) -> Path:
    m = TinyGGUF(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN35MOE], tokenizer, seed)
    w = m.writer
    w.add_context_length(dims.n_ctx_train)
    w.add_embedding_length(dims.n_embd)
    w.add_block_count(dims.n_layer)
    w.add_head_count(dims.n_head)
    w.add_head_count_kv(dims.n_head_kv)
    w.add_key_length(dims.head_dim)
    w.add_value_length(dims.head_dim)
    w.add_rope_dimension_count(dims.n_rot)
    w.add_rope_dimension_sections(list(dims.rope_sections))
    w.add_rope_freq_base(1e7)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(dims.n_expert)
    w.add_expert_used_count(dims.n_expert_used)
    w.add_expert_feed_forward_length(dims.n_ff_expert)
    w.add_expert_shared_feed_forward_length(dims.n_ff_shared)
    w.add_ssm_conv_kernel(dims.ssm_conv_kernel)
    w.add_ssm_state_size(dims.ssm_head_dim)
    w.add_ssm_group_count(dims.ssm_k_heads)
    w.add_ssm_time_step_rank(dims.ssm_v_heads)
    w.add_ssm_inner_size(dims.ssm_head_dim * dims.ssm_v_heads)
    w.add_full_attention_interval(dims.full_attention_interval)
    m.vocab_matrices(vocab_size(tokenizer), dims.n_embd)
    for layer in range(dims.n_layer):
        m.norm(T.ATTN_NORM, dims.n_embd, layer)
        m.norm(T.ATTN_POST_NORM, dims.n_embd, layer)
        if dims.is_recurrent(layer):
            _delta_net_layer(m, dims, layer)
        else:
            _attention_layer(m, dims, layer)
        _moe_layer(m, dims, layer)
    return m.finish()


def _attention_layer(m: TinyGGUF, dims: Qwen35MoeDims, layer: int) -> None:
    q_width = dims.head_dim * dims.n_head
    m.tensor(T.ATTN_Q, (dims.n_embd, 2 * q_width), layer)  # query and its output gate, interleaved per head
    m.tensor(T.ATTN_K, (dims.n_embd, dims.head_dim * dims.n_head_kv), layer)
    m.tensor(T.ATTN_V, (dims.n_embd, dims.head_dim * dims.n_head_kv), layer)
    m.tensor(T.ATTN_OUT, (q_width, dims.n_embd), layer)
    m.norm(T.ATTN_Q_NORM, dims.head_dim, layer)
    m.norm(T.ATTN_K_NORM, dims.head_dim, layer)


def _delta_net_layer(m: TinyGGUF, dims: Qwen35MoeDims, layer: int) -> None:
    key_dim = dims.ssm_head_dim * dims.ssm_k_heads
    value_dim = dims.ssm_head_dim * dims.ssm_v_heads
    heads = dims.ssm_v_heads
    m.tensor(T.ATTN_QKV, (dims.n_embd, 2 * key_dim + value_dim), layer)
    m.tensor(T.ATTN_GATE, (dims.n_embd, value_dim), layer)
    m.tensor(T.SSM_CONV1D, (dims.ssm_conv_kernel, 2 * key_dim + value_dim), layer)
    # decay per step exp(-softplus(alpha + dt_bias) * exp(A_log)), initialised as in transformers
    dt = np.exp(m.rng.uniform(np.log(1e-3), np.log(1e-1), size=heads))
    m.tensor(T.SSM_DT, (heads,), layer, suffix=".bias", data=np.log(np.expm1(dt)))
    m.tensor(T.SSM_A, (heads,), layer, suffix="", data=-m.rng.uniform(1.0, 16.0, size=heads))
    m.tensor(T.SSM_BETA, (dims.n_embd, heads), layer)
    m.tensor(T.SSM_ALPHA, (dims.n_embd, heads), layer)
    m.norm(T.SSM_NORM, dims.ssm_head_dim, layer)
    m.tensor(T.SSM_OUT, (value_dim, dims.n_embd), layer)


def _moe_layer(m: TinyGGUF, dims: Qwen35MoeDims, layer: int) -> None:
    m.tensor(T.FFN_GATE_INP, (dims.n_embd, dims.n_expert), layer)
    m.tensor(T.FFN_GATE_EXP, (dims.n_embd, dims.n_ff_expert, dims.n_expert), layer)
    m.tensor(T.FFN_UP_EXP, (dims.n_embd, dims.n_ff_expert, dims.n_expert), layer)
    m.tensor(T.FFN_DOWN_EXP, (dims.n_ff_expert, dims.n_embd, dims.n_expert), layer)
    m.tensor(T.FFN_GATE_INP_SHEXP, (dims.n_embd,), layer)
    m.tensor(T.FFN_GATE_SHEXP, (dims.n_embd, dims.n_ff_shared), layer)
    m.tensor(T.FFN_UP_SHEXP, (dims.n_embd, dims.n_ff_shared), layer)
    m.tensor(T.FFN_DOWN_SHEXP, (dims.n_ff_shared, dims.n_embd), layer)


# --------------------------------------------------------------------------------------------------
# mamba: purely recurrent (a selective state space per layer, no attention, no KV cache)
# --------------------------------------------------------------------------------------------------
MAMBA_LAYERS, MAMBA_D_STATE, MAMBA_DT_RANK, MAMBA_D_CONV = 2, 16, 4, 4
MAMBA_D_INNER = 2 * N_EMBD  # llama.cpp supports an expansion factor of 2 only


def build_mamba(path: Path, tokenizer: list[MetadataEntry], seed: int = 0) -> Path:
    m = TinyGGUF(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MAMBA], tokenizer, seed)
    w = m.writer
    w.add_context_length(4096)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(MAMBA_LAYERS)
    w.add_ssm_conv_kernel(MAMBA_D_CONV)
    w.add_ssm_inner_size(MAMBA_D_INNER)
    w.add_ssm_state_size(MAMBA_D_STATE)
    w.add_ssm_time_step_rank(MAMBA_DT_RANK)
    w.add_layer_norm_rms_eps(1e-5)
    m.vocab_matrices(vocab_size(tokenizer))
    for layer in range(MAMBA_LAYERS):
        m.norm(T.ATTN_NORM, N_EMBD, layer)
        m.tensor(T.SSM_IN, (N_EMBD, 2 * MAMBA_D_INNER), layer)
        m.tensor(T.SSM_CONV1D, (MAMBA_D_CONV, MAMBA_D_INNER), layer)
        m.tensor(T.SSM_CONV1D, (MAMBA_D_INNER,), layer, suffix=".bias", data=np.zeros(MAMBA_D_INNER))
        m.tensor(T.SSM_X, (MAMBA_D_INNER, MAMBA_DT_RANK + 2 * MAMBA_D_STATE), layer)
        m.tensor(T.SSM_DT, (MAMBA_DT_RANK, MAMBA_D_INNER), layer)
        dt = np.exp(m.rng.uniform(np.log(1e-3), np.log(1e-1), size=MAMBA_D_INNER))
        m.tensor(T.SSM_DT, (MAMBA_D_INNER,), layer, suffix=".bias", data=np.log(np.expm1(dt)))
        # A = -[1 .. d_state] for every channel (S4D-real init, as the reference implementation)
        m.tensor(T.SSM_A, (MAMBA_D_STATE, MAMBA_D_INNER), layer, suffix="",
                 data=-np.tile(np.arange(1, MAMBA_D_STATE + 1), (MAMBA_D_INNER, 1)))
        m.tensor(T.SSM_D, (MAMBA_D_INNER,), layer, suffix="", data=np.ones(MAMBA_D_INNER))
        m.tensor(T.SSM_OUT, (MAMBA_D_INNER, N_EMBD), layer)
    return m.finish()


# --------------------------------------------------------------------------------------------------
# what qeval refuses: an encoder-only model, a vision projector, an architecture nobody knows
# --------------------------------------------------------------------------------------------------
BERT_CTX = 128


def build_bert(path: Path, tokenizer: list[MetadataEntry], declares_encoder: bool = True, seed: int = 0) -> Path:
    """A one-layer BERT: loadable by llama.cpp, but an encoder (no KV cache, no next-token logits).
    Converters write `bert.attention.causal = false`; without it only llama.cpp itself can tell."""
    m = TinyGGUF(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT], tokenizer, seed)
    w = m.writer
    w.add_context_length(BERT_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(1)
    w.add_feed_forward_length(4 * N_EMBD)
    w.add_head_count(2)
    w.add_layer_norm_eps(1e-12)
    if declares_encoder:
        w.add_causal_attention(False)
    w.add_uint32(gguf.Keys.Tokenizer.TOKEN_TYPE_COUNT, 2)
    m.tensor(T.TOKEN_EMBD, (N_EMBD, vocab_size(tokenizer)))
    m.tensor(T.POS_EMBD, (N_EMBD, BERT_CTX))
    m.norm(T.TOKEN_EMBD_NORM, N_EMBD)
    m.tensor(T.TOKEN_EMBD_NORM, (N_EMBD,), suffix=".bias", data=np.zeros(N_EMBD))
    for kind in (T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT):
        m.tensor(kind, (N_EMBD, N_EMBD), 0)
    for kind in (T.ATTN_OUT_NORM, T.LAYER_OUT_NORM):
        m.norm(kind, N_EMBD, 0)
        m.tensor(kind, (N_EMBD,), 0, suffix=".bias", data=np.zeros(N_EMBD))
    m.tensor(T.FFN_UP, (N_EMBD, 4 * N_EMBD), 0)
    m.tensor(T.FFN_DOWN, (4 * N_EMBD, N_EMBD), 0)
    return m.finish()


def build_mmproj(path: Path, seed: int = 0) -> Path:
    """What a vision projector (mmproj) file looks like to a loader: architecture `clip`, no vocab."""
    m = TinyGGUF(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ], seed=seed)
    m.writer.add_type(gguf.GGUFType.MMPROJ)
    m.writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    m.writer.add_uint32(gguf.Keys.ClipVision.EMBEDDING_LENGTH, N_EMBD)
    m.tensor(gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH, (14, 14, 3, N_EMBD))
    return m.finish()


def build_unknown_arch(path: Path, tokenizer: list[MetadataEntry], arch: str = "not-a-real-arch") -> Path:
    """A well-formed GGUF whose architecture string no llama.cpp knows."""
    m = TinyGGUF(path, arch, tokenizer)
    m.writer.add_embedding_length(N_EMBD)
    m.tensor(T.TOKEN_EMBD, (N_EMBD, vocab_size(tokenizer)))
    return m.finish()
