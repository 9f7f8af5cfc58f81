"""What llama.cpp computed with, beyond the settings qeval passes it: the KV rotation, the environment
variables it reads, and the build. Every store and result records them (qeval.identity makes them part of
a producer), so a request under other numerics never reuses a number made under these.

KV rotation. llama.cpp rotates K and V with a Hadamard transform before quantizing them when the cache type
is quantized and the head size is a multiple of 64 (src/llama-kv-cache.cpp, `attn_rot_k`/`attn_rot_v`), unless
LLAMA_ATTN_ROT_DISABLE is set to a non-zero number. It changes what a quantized cache costs several-fold
(docs/numerics.md). qeval records the rotation llama.cpp reports while it creates the context (its log line
`attn_rot_k = 1`), and predicts it by the same rule for planning (`rotation_rule`), so a matrix knows what a
pair will compute before it runs it; tests hold the two equal. `--kv-rotation on|off` sets the variable for
the context qeval creates, `auto` leaves llama.cpp's rule (and the user's environment) alone.

Environment. Every variable named GGML_* or LLAMA_* is read by the loaded llama.cpp or by a tool around it;
those known to change only logging, debugging, where files live or which devices are visible (DIAGNOSTIC) are
left out, every other one set is recorded: a spurious recompute costs minutes, a stale number costs trust.
LLAMA_ATTN_ROT_DISABLE is left out of the environment block because its effect is recorded as the rotation.

Build. llama-cpp-python's version, llama.cpp's own report of what it was compiled with (llama_print_system_info:
instruction sets, GPU backends), and the build's own version, ggml commit and type table (qeval.engine.build_check):
logits move between builds, and LLAMA_CPP_LIB_PATH loads another build under the same llama-cpp-python.

Offload. Layers on a GPU run other kernels: the number of layers offloaded, 0 on a CPU-only build.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Iterator

from qeval.errors import QevalError

ROTATION_ENV = "LLAMA_ATTN_ROT_DISABLE"
ROTATION_MODES = ("auto", "on", "off")
ROTATION_HEAD_MULTIPLE = 64  # llama.cpp rotates heads whose size is a multiple of this
UNKNOWN = "unknown"  # what a store made before qeval recorded numerics holds

# Variables of the GGML_/LLAMA_ families that cannot move a logit: logs, traces, debug dumps, backtraces, paths,
# device visibility, and the Python loader's library path (the library it loads is recorded as the build).
DIAGNOSTIC = re.compile(r"(DEBUG|TRACE|BACKTRACE|_LOG|CAPTURE|VISIBLE_DEVICES|_PATH$|^LLAMA_ARG_|^LLAMA_CACHE$"
                        r"|^LLAMA_CPP_LIB)")


def numerics_env(environ=None) -> dict[str, str]:
    """The environment variables of the loaded llama.cpp that may change its numbers, as set now."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in sorted(environ)
            if name.startswith(("GGML_", "LLAMA_")) and name != ROTATION_ENV and not DIAGNOSTIC.search(name)}


def _quantized(cache_type: str) -> bool:
    return cache_type not in ("f32", "f16", "bf16")


def rotation_disabled(mode: str, environ=None) -> bool:
    """Whether the context is created with the rotation disabled: `off`, or `auto` under the user's variable."""
    if mode != "auto":
        return mode == "off"
    value = (os.environ if environ is None else environ).get(ROTATION_ENV)
    try:
        return bool(value) and int(value) != 0  # llama.cpp: atoi(value) != 0
    except ValueError:
        return False


def rotation_rule(facts: dict, type_k: str, type_v: str, mode: str = "auto", environ=None) -> dict[str, bool]:
    """{"k": ..., "v": ...}: whether llama.cpp rotates each cache, by its rule, for a model of these facts
    (qeval.engine.modelinfo) and these cache types under `mode`; `on` where it cannot rotate is refused."""
    if mode not in ROTATION_MODES:
        raise QevalError(f"--kv-rotation must be one of {', '.join(ROTATION_MODES)}, not {mode!r}")
    geometry = (facts or {}).get("kv_cache") or {}
    heads = {"k": geometry.get("k_head"), "v": geometry.get("v_head")}
    types = {"k": type_k, "v": type_v}
    can = {c: _quantized(types[c]) and bool(heads[c]) and heads[c] % ROTATION_HEAD_MULTIPLE == 0 for c in "kv"}
    if mode == "on":
        quantized = [c for c in "kv" if _quantized(types[c])]
        if not quantized:
            raise QevalError(f"--kv-rotation on: llama.cpp rotates only a quantized KV cache, and this one is "
                             f"{type_k}/{type_v}")
        unable = [c for c in quantized if not can[c]]
        if unable:
            c = unable[0]
            raise QevalError(f"--kv-rotation on: llama.cpp rotates a cache only when its head size is a multiple of "
                             f"{ROTATION_HEAD_MULTIPLE}; {facts.get('file_name') or 'this model'}'s {c.upper()} heads "
                             f"are {heads[c] or 'of unknown size'}")
    off = rotation_disabled(mode, environ)
    return {c: can[c] and not off for c in "kv"}


@contextlib.contextmanager
def rotation_env(mode: str) -> Iterator[None]:
    """The process environment llama.cpp reads while creating a context under `mode` (it reads the variable in
    its KV cache's constructor): set for `off`, removed for `on`, untouched for `auto`; restored afterwards."""
    if mode == "auto":
        yield
        return
    before = os.environ.get(ROTATION_ENV)
    if mode == "off":
        os.environ[ROTATION_ENV] = "1"
    else:
        os.environ.pop(ROTATION_ENV, None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ROTATION_ENV, None)
        else:
            os.environ[ROTATION_ENV] = before


_ROTATION_LINE = re.compile(r"attn_rot_([kv]) = (\d+)")


def reported_rotation(log_text: str) -> dict[str, bool] | None:
    """The rotation llama.cpp reported while creating a context ({"k", "v"}: rotated by any of its KV caches),
    None when it reported none (a model without an attention cache, or a llama.cpp without the rotation)."""
    found = _ROTATION_LINE.findall(log_text)
    if not found:
        return None
    return {c: any(cache == c and int(flag) for cache, flag in found) for c in "kv"}


def build_info(lc) -> dict:
    """The llama.cpp build loaded through llama-cpp-python module `lc`: the bindings' version, the build's report of
    what it was compiled with, its own version and commit (llama_version, ggml_version, ggml_commit) and a digest of
    its ggml type table (qeval.engine.build_check: a fork's, or another mainline's, is another build)."""
    from qeval.engine.build_check import build_report  # noqa: PLC0415

    info = (lc.llama_print_system_info() or b"").decode("utf-8", "replace")
    return {"llama_cpp_python": lc.__version__, "system_info": " ".join(info.split()).strip(" |"),
            **build_report().identity()}


def offloaded_layers(facts: dict, n_gpu_layers: int, offloaded: bool) -> int:
    """Layers llama.cpp puts on a GPU: 0 when nothing is offloaded; -ngl beyond the model's layers (+1 for the
    output layer) or -1 is all of them, so -ngl 99 and -ngl 999 compute the same."""
    if not offloaded:
        return 0
    n_layer = (facts or {}).get("block_count")
    total = n_layer + 1 if isinstance(n_layer, int) else None
    if n_gpu_layers < 0:
        return total if total is not None else -1
    return min(n_gpu_layers, total) if total is not None else n_gpu_layers


def numerics_block(build: dict, gpu_layers: int, environ=None) -> dict:
    """What a store's capture block records as its numerics (qeval.identity.producer)."""
    return {"build": build, "env": numerics_env(environ), "gpu_layers": gpu_layers}
