"""What llama.cpp allocates for a context, two ways: its own accounting, read from its log, and the KV-cache and
recurrent-state bytes that follow from the model's hyperparameters (the cross-check).

llama.cpp's accounting. llama-cpp-python exposes no C call for a memory breakdown (llama_get_memory_breakdown is
C++, a std::map), but llama.cpp logs every buffer it allocates while it loads a model and creates a context, one line
each, named by buffer (CPU, CPU_Mapped, CUDA0, CUDA_Host, ...): "model buffer size", "KV buffer size", "RS buffer
size" (recurrent state), "compute buffer size", "output buffer size", in MiB with two decimals (so each figure is
exact to ±0.005 MiB). qeval's engine records the log while it does both (qeval.engine.engine.recorded_log).

The formula. From the GGUF alone: every attention layer holds K and V rows of n_head_kv x head size values per cell,
in the cache's type (the block sizes of the loaded build's ggml: q8_0 is 34 bytes per 32 values, ...); a
full-attention layer has one cell per token of the context (n_ctx padded to 256, as llama.cpp pads it), a
sliding-window layer n_swa + n_ubatch cells padded to 256 and at most the context (llama.cpp's tools keep SWA caches
so: swa_full off); a recurrent layer (Gated DeltaNet, Mamba) holds one conv row of (d_conv - 1) x (d_inner + 2 x
n_group x d_state) and one state row of d_state x d_inner float32 values per sequence, whatever the context. Which
layers slide or recur is the GGUF's word where it says (sliding_window_pattern, recurrent_layers,
full_attention_interval), else llama.cpp's per-architecture default (src/models/<arch>.cpp). Architectures whose
caches llama.cpp lays out otherwise (compressed MLA caches, layers that share a cache, other recurrent states) get no
formula: None, never a guess.
"""

from __future__ import annotations

import re
from pathlib import Path

from qeval.engine.build_check import cache_type
from qeval.engine.modelinfo import cached_gguf_read
from qeval.storage.deployment import COMPONENTS
from qeval.storage.gguf_file import read_gguf

GEOMETRY_VERSION = 1
CELL_PAD = 256  # llama.cpp pads n_ctx, and every SWA cache, to a multiple of this many cells
MIB = 1 << 20
LOG_PRECISION_BYTES = MIB // 200  # llama.cpp prints MiB with two decimals: ±0.005 MiB

# llama.cpp's name of a buffer's use in its log -> qeval's component (qeval.storage.deployment.COMPONENTS)
_USES = {"model": "model", "KV": "kv", "RS": "recurrent", "compute": "compute", "output": "output"}
_BUFFER_LINE = re.compile(r"\b(\S+)\s+(model|KV|RS|compute|output) buffer size =\s*([0-9.]+) MiB")
# what a backend logs when it cannot allocate a buffer: ggml's CPU buffer (bytes), CUDA's cudaMalloc (MiB)
_FAILED_BYTES = re.compile(r"failed to allocate buffer of size (\d+)")
_FAILED_MIB = re.compile(r"allocating ([0-9.]+) MiB on device (\d+): \w+ failed")
_FAILED_WHAT = re.compile(r"failed to initialize the context: (.+)")
_CACHE_KIND = re.compile(r"creating\s+(non-SWA|SWA) KV cache")
_KV_CACHE = re.compile(r"llama_kv_cache: size =\s*[0-9.]+ MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*\d+/(\d+) seqs\)")
_RS_CACHE = re.compile(r"llama_memory_recurrent: size =\s*[0-9.]+ MiB \(\s*(\d+) cells,\s*(\d+) layers")
_CACHE_NAMES = {"SWA": "sliding-window", "non-SWA": "full-attention"}
_EXPERT_OVERRIDE = re.compile(r"tensor (\S+) \(.*\) buffer type overridden to (\S+)")

# What llama.cpp says of each KV cache it made (llama_kv_cache's size line: the types it allocated) and of flash
# attention: the setting as it went in (`flash_attn = enabled|disabled|auto`), then, for auto, what it resolved to.
_KV_TYPES = re.compile(r"llama_kv_cache: size =.*?\bK \(([^)]+)\):.*?\bV \(([^)]+)\):")
_FA_SETTING = re.compile(r"flash_attn\s+= (enabled|disabled|auto|on|off|1|0)\b")
_FA_RESOLVED = re.compile(r"Flash Attention (enabled|not supported, set to disabled)")
RECURRENT_VALUE_BYTES = 4  # llama.cpp keeps recurrent states in f32

# llama.cpp's default sliding-window pattern per architecture (load_swa_pattern(ml, n, dense_first) in
# src/models/<arch>.cpp), used where the GGUF carries no sliding_window_pattern: (n, dense_first).
SWA_PATTERNS = {"gemma2": (2, False), "gemma3": (6, False), "cohere2": (4, False), "cohere2moe": (4, True),
                "exaone4": (4, False), "exaone-moe": (4, False), "llama4": (4, False), "olmo2": (4, False),
                "gpt-oss": (2, False), "afmoe": (4, False), "plamo3": (8, False), "smallthinker": (4, True),
                "phi3": (1, False)}
# Recurrent layers whose conv and state rows follow Mamba's sizes (llama_hparams::n_embd_r/n_embd_s): Mamba itself
# and the Gated DeltaNet hybrids. Other recurrent states (RWKV, LFM2's short convolutions, Kimi's KDA, MiniMax) are
# not modelled.
MAMBA_STATE_ARCHS = {"mamba", "mamba2", "jamba", "granitehybrid", "nemotron_h", "falcon-h1", "plamo2", "qwen3next",
                     "qwen35", "qwen35moe"}
ALL_RECURRENT_ARCHS = {"mamba", "mamba2"}
DEFAULT_FULL_ATTENTION_INTERVAL = {"qwen3next": 4, "qwen35": 4, "qwen35moe": 4}
# Caches laid out otherwise: KV shared across layers (Gemma-3n, Gemma-4), other recurrent states.
NOT_MODELLED = {"gemma3n", "gemma4", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7", "lfm2", "lfm2moe", "kimi-linear",
                "minimax-01", "glm5-next", "deepseek4"}


def buffer_sizes(lines: list[str]) -> dict[str, dict[str, int]]:
    """{buffer name: {component: bytes}} of the buffers llama.cpp logged (a model load's and a context's lines):
    model, KV and RS buffers add up (several files, several caches: a sliding-window model has two KV caches), a
    compute or output buffer is the last one logged for its name (llama.cpp reserves, then logs it once)."""
    out: dict[str, dict[str, int]] = {}
    for line in lines:
        for name, use, mib in _BUFFER_LINE.findall(line):
            component, size = _USES[use], round(float(mib) * MIB)
            parts = out.setdefault(name, {})
            parts[component] = parts.get(component, 0) + size if component in ("model", "kv", "recurrent") else size
    return {name: {c: parts[c] for c in COMPONENTS if c in parts} for name, parts in out.items()}


def total_bytes(devices: dict[str, dict[str, int]]) -> int:
    return sum(sum(parts.values()) for parts in devices.values())


def failed_allocation(lines: list[str]) -> tuple[int | None, str | None]:
    """(the bytes a buffer llama.cpp could not allocate asked for, what llama.cpp was making), each None where its
    log does not say."""
    text = "".join(lines)
    asked = [int(n) for n in _FAILED_BYTES.findall(text)]
    asked += [round(float(mib) * MIB) for mib, _ in _FAILED_MIB.findall(text)]
    what = _FAILED_WHAT.findall(text)
    return (asked[-1] if asked else None), (what[-1].strip() if what else None)


def allocated_cache(lines: list[str]) -> dict:
    """What llama.cpp made of a context's cache, from its log: {"types": [(K type, V type) of each KV cache, as
    allocated], "flash_attn": True/False, None where it did not say}."""
    text = "".join(lines)
    resolved = _FA_RESOLVED.findall(text)
    setting = _FA_SETTING.findall(text)
    if resolved:
        flash = resolved[-1] == "enabled"
    else:
        flash = {"enabled": True, "on": True, "1": True, "disabled": False, "off": False, "0": False}.get(
            setting[-1] if setting else "")
    return {"types": _KV_TYPES.findall(text), "flash_attn": flash}


def overridden_tensors(lines: list[str]) -> dict[str, str]:
    """{tensor name: buffer type} of every tensor llama.cpp put elsewhere by a tensor buffer override (-ot,
    --n-cpu-moe), from its model load's log."""
    return dict(_EXPERT_OVERRIDE.findall("".join(lines)))


# -- the formula ------------------------------------------------------------------------------------------------
def memory_geometry(path: str | Path) -> dict:
    """What the KV and recurrent-state formula needs of a GGUF (cached per file, as its facts are)."""
    return cached_gguf_read(Path(path), "memory-geometry", GEOMETRY_VERSION, _read_geometry)


def _per_layer(value, n_layer: int) -> list:
    if isinstance(value, list):
        return list(value) + [value[-1] if value else 0] * (n_layer - len(value))
    return [value] * n_layer


def _pattern_layers(n_layer: int, n: int, dense_first: bool) -> list[bool]:
    """llama_hparams::set_swa_pattern: which layers slide."""
    if dense_first:
        return [n == 0 or i % n != 0 for i in range(n_layer)]
    return [n == 0 or i % n < n - 1 for i in range(n_layer)]


def _read_geometry(path: Path) -> dict:
    field = read_gguf(path).field
    arch = field("general.architecture") or "unknown"

    def key(name: str):
        return field(f"{arch}.{name}")

    n_layer = key("block_count") or 0
    n_embd, n_head = key("embedding_length"), key("attention.head_count")
    geometry = {"architecture": arch, "n_layer": n_layer, "modelled": None}
    if arch in NOT_MODELLED or key("attention.kv_lora_rank") or key("attention.shared_kv_layers"):
        geometry["modelled"] = f"llama.cpp lays out {arch}'s caches in a way the formula does not model"
        return geometry
    heads = _per_layer(key("attention.head_count_kv") if key("attention.head_count_kv") is not None else n_head,
                       n_layer)
    n_head_max = max(_per_layer(n_head, n_layer)) if n_head else 0
    default_head = n_embd // n_head_max if n_embd and n_head_max else 0
    k_head, v_head = key("attention.key_length") or default_head, key("attention.value_length") or default_head
    recurrent = _recurrent_layers(arch, key, heads, n_layer)
    n_swa = key("attention.sliding_window") or 0
    sliding = [False] * n_layer
    if n_swa:
        pattern = key("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            sliding = [bool(p) for p in _per_layer(pattern, n_layer)]
        elif isinstance(pattern, int) or arch in SWA_PATTERNS:
            n, dense_first = (pattern, SWA_PATTERNS.get(arch, (0, False))[1]) if isinstance(pattern, int) \
                else SWA_PATTERNS[arch]
            sliding = _pattern_layers(n_layer, n, dense_first)
        else:
            geometry["modelled"] = f"{arch} has sliding-window layers and neither its GGUF nor the formula says which"
            return geometry
    layers = [{"n_head_kv": int(h), "sliding": s} for h, s, r in zip(heads, sliding, recurrent) if h and not r]
    geometry.update(modelled=True, n_swa=int(n_swa), k_head=int(k_head), v_head=int(v_head),
                    k_head_swa=int(key("attention.key_length_swa") or k_head),
                    v_head_swa=int(key("attention.value_length_swa") or v_head), attention=layers,
                    recurrent_layers=sum(recurrent))
    if any(recurrent):
        if arch not in MAMBA_STATE_ARCHS:
            geometry["modelled"] = f"{arch}'s recurrent state is not modelled"
            return geometry
        d_conv, d_inner = key("ssm.conv_kernel") or 0, key("ssm.inner_size") or 0
        d_state, n_group = key("ssm.state_size") or 0, key("ssm.group_count") or 0
        geometry.update(r_values=max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state), s_values=d_state * d_inner)
    return geometry


def _recurrent_layers(arch: str, key, heads: list, n_layer: int) -> list[bool]:
    """Which layers carry a recurrent state, as llama.cpp's loader of `arch` decides."""
    listed = key("attention.recurrent_layers")
    if listed is not None:
        return [bool(r) for r in _per_layer(listed, n_layer)]
    interval = key("full_attention_interval") or DEFAULT_FULL_ATTENTION_INTERVAL.get(arch)
    if interval:
        return [(i + 1) % interval != 0 for i in range(n_layer)]
    if arch in ALL_RECURRENT_ARCHS:
        return [True] * n_layer
    if arch in MAMBA_STATE_ARCHS:  # hybrids that mark a recurrent layer by no KV heads
        return [not h for h in heads]
    return [False] * n_layer


def _pad(n: int, to: int = CELL_PAD) -> int:
    return -(-n // to) * to


def row_bytes(cache_type_name: str, values: int) -> int:
    """ggml_row_size: bytes of a row of `values` values of this cache type (its block sizes from the build's ggml)."""
    return cache_type(cache_type_name).row_bytes(values)


def cache_cells(geometry: dict, n_ctx: int, n_ubatch: int) -> tuple[int, int]:
    """(cells of a full-attention layer's cache, cells of a sliding-window layer's) for one sequence of n_ctx."""
    full = _pad(n_ctx)
    return full, _pad(min(full, geometry.get("n_swa", 0) + n_ubatch))


def formula_bytes(geometry: dict, n_ctx: int, type_k: str, type_v: str, n_ubatch: int) -> dict:
    """{"kv": bytes, "recurrent": bytes} llama.cpp allocates for one sequence of n_ctx tokens with these cache types
    (the module's docstring); both None where the geometry is not modelled."""
    if geometry.get("modelled") is not True:
        return {"kv": None, "recurrent": None}
    full, swa = cache_cells(geometry, n_ctx, n_ubatch)
    kv = 0
    for layer in geometry["attention"]:
        cells, k_head, v_head = (swa, geometry["k_head_swa"], geometry["v_head_swa"]) if layer["sliding"] else \
            (full, geometry["k_head"], geometry["v_head"])
        h = layer["n_head_kv"]
        kv += cells * (row_bytes(type_k, h * k_head) + row_bytes(type_v, h * v_head))
    recurrent = geometry["recurrent_layers"] * (geometry.get("r_values", 0) + geometry.get("s_values", 0)) \
        * RECURRENT_VALUE_BYTES
    return {"kv": kv, "recurrent": recurrent}


def cache_layout(lines: list[str]) -> str | None:
    """The cache layout llama.cpp used for a context, in words, from its log (None where it logged no cache): each
    KV cache's cells and layers (a sliding-window model's SWA cache apart), the recurrent state, the sequences."""
    text = "".join(lines)
    kinds = _CACHE_KIND.findall(text)
    caches = _KV_CACHE.findall(text)
    parts = [f"{_CACHE_NAMES.get(kinds[i] if i < len(kinds) else '', 'attention')} KV cache of {cells} cells x "
             f"{layers} layers" for i, (cells, layers, _) in enumerate(caches)]
    parts += [f"recurrent state of {cells} cell(s) per layer" for cells, _ in _RS_CACHE.findall(text)]
    if not parts:
        return None
    sequences = caches[0][2] if caches else "1"
    return f"{'; '.join(parts)}; {sequences} sequence(s), swa_full off (llama.cpp tools' default)"
