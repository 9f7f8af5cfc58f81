"""A GGUF as it is deployed: what llama.cpp allocates for a context of the user's size, and how fast it processes a
prompt and generates, measured as llama-bench measures (tools/llama-bench/llama-bench.cpp of the vendored llama.cpp).

Speed, as llama-bench. Each test gets its own context of tokens + depth cells (llama-bench's n_prompt + n_gen +
n_depth), with the deployment's threads, batch sizes, flash attention and KV cache. One untimed warm-up (a pp test:
the whole prompt on an empty cache; a tg test: one token), then each repetition: the cache cleared, filled to the
depth untimed (computed once, then restored from a saved sequence state, as llama-bench caches it), then timed:
  pp: `tokens` random tokens (the first BOS where the vocabulary adds one) in pieces of n_batch tokens, the logits of
      each piece's last token only, then llama_synchronize;
  tg: `tokens` single-token decodes, each followed by llama_synchronize.
Tokens per second of each repetition = tokens / its wall time (perf_counter_ns around exactly that work). Nothing
else of qeval runs meanwhile: no decode-ahead thread, no other model.

Memory. A context of n_ctx tokens is created, never filled, and llama.cpp's log lines of its buffers (and of the
model's, logged while loading) give every component per buffer (qeval.engine.memory). Filled contexts are measured
by RSS, in a child process per context (rss_growth), so that nothing else of this process counts: the growth of
the child's resident set from before the model is loaded to after every cell of the context is written.

Expert offload (llama.cpp's --n-cpu-moe N): llama-cpp-python 0.3.36 declares llama_model_params.tensor_buft_overrides
as an untyped pointer it never fills; qeval fills it with llama.cpp's own patterns (common.h, llm_ffn_block_regex:
blk.<i>.ffn_(up|down|gate|gate_up)_(ch|)exps for the first N layers) and ggml's CPU buffer type, and reads back from
llama.cpp's log which tensors it moved. Arbitrary -ot patterns are not offered.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import subprocess
import time
from dataclasses import dataclass

import numpy as np

from qeval.engine import memory
from qeval.engine.engine import ContextShape, EngineSettings, LlamaModel
from qeval.engine.probe import run_guarded
from qeval.errors import QevalError

# llama.cpp's defaults (common_params, llama-bench): what a deployment uses unless told otherwise
DEPLOY_BATCH = 2048
DEPLOY_UBATCH = 512
EXPERTS_PATTERN = r"blk\.{layer}\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # llm_ffn_block_regex(i, LLM_FFN_EXPS_REGEX)
TOKEN_SEED = 0  # of the random tokens (llama-bench: std::rand() unseeded, i.e. seed 1)
RSS_LINE = "qeval-rss: "  # the child's answer: this prefix and a JSON object
RSS_UNAVAILABLE = ("the resident set is unavailable on this platform (no /proc/self/status, and psutil is not "
                   "installed: pip install psutil)")
FILL_TIMEOUT_S = 24 * 3600


class _BuftOverride(ctypes.Structure):
    """struct llama_model_tensor_buft_override (llama.h)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclass(frozen=True)
class SpeedTest:
    """One llama-bench test: `test` (pp or tg) of `tokens` tokens after a prefill to `depth`."""

    test: str
    tokens: int
    depth: int

    @property
    def n_ctx(self) -> int:
        """llama-bench's context for it: n_prompt + n_gen + n_depth."""
        return self.tokens + self.depth


class DeployModel(LlamaModel):
    """A model loaded as deployed (weights, -ngl, --n-cpu-moe), contexts created one at a time: measure_memory and
    measure_speed. settings: the KV cache, flash attention, threads and -ngl of EngineSettings; n_batch and n_ubatch
    are the deployment's (llama.cpp's 2048 and 512 by default)."""

    def __init__(self, model_path, settings: EngineSettings, n_cpu_moe: int = 0):
        self.n_cpu_moe = n_cpu_moe
        self._overrides = None  # the override array and its patterns, alive while the model loads
        self._state: tuple[int, ctypes.Array] | None = None  # (depth, the sequence state there): llama-bench's cstate
        self._rng = np.random.default_rng(TOKEN_SEED)
        super().__init__(model_path, settings, weights=True)
        self.offloaded_experts = memory.overridden_tensors(self.load_log)
        if n_cpu_moe and not self.offloaded_experts:
            self.close()
            raise QevalError(f"--n-cpu-moe {n_cpu_moe}: {self.model_path.name} has no expert tensors in its first "
                             f"{n_cpu_moe} layers (blk.N.ffn_*_exps): it is no mixture of experts")

    @property
    def n_batch(self) -> int:
        return self.settings.n_batch or DEPLOY_BATCH

    @property
    def n_ubatch(self) -> int:
        return min(self.settings.n_ubatch or DEPLOY_UBATCH, self.n_batch)

    def _model_params(self):
        mparams = super()._model_params()
        if self.n_cpu_moe:
            patterns = [EXPERTS_PATTERN.format(layer=i).encode() for i in range(self.n_cpu_moe)]
            cpu = self._lc.llama_cpp._lib.ggml_backend_cpu_buffer_type
            cpu.restype = ctypes.c_void_p
            overrides = (_BuftOverride * (len(patterns) + 1))(*[_BuftOverride(p, cpu()) for p in patterns])
            self._overrides = (overrides, patterns)  # NULL-terminated by the zeroed last entry
            mparams.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
        return mparams

    def shape(self, n_ctx: int) -> ContextShape:
        """One sequence of n_ctx tokens, as llama.cpp's tools make a context by default (kv_unified off, swa_full
        off: qeval.engine.engine.LlamaModel._context_params)."""
        s = self.settings
        return ContextShape(n_ctx_seq=n_ctx, n_seq=1, n_batch=self.n_batch, n_ubatch=self.n_ubatch, kv_unified=False,
                            described=f"of {n_ctx} tokens with KV {s.type_k}/{s.type_v}, flash attention "
                                      f"{s.flash_attn} (-b {self.n_batch}, -ub {self.n_ubatch})")

    # -- memory ----------------------------------------------------------------------------------------------
    def measure_memory(self, n_ctx: int) -> tuple[dict, str | None]:
        """({buffer: {component: bytes}}, the cache layout in words) of a context of n_ctx tokens, created and freed
        unfilled; ContextFailed when llama.cpp cannot create it."""
        self.open_context(self.shape(n_ctx))
        try:
            return memory.buffer_sizes(self.load_log + self.context_log), memory.cache_layout(self.context_log)
        finally:
            self.free_context()

    # -- speed -----------------------------------------------------------------------------------------------
    def measure_speed(self, test: SpeedTest, reps: int) -> list[float]:
        """Tokens per second of each of `reps` timed repetitions of `test` after one untimed warm-up (the module's
        docstring); ContextFailed when its context cannot be made, QevalError when a decode fails."""
        self.open_context(self.shape(test.n_ctx))
        try:
            run = self._prompt if test.test == "pp" else self._generate
            self._clear()
            run(test.tokens if test.test == "pp" else 1)  # warm-up: caches, threads, the graph
            rates = []
            for _ in range(reps):
                self._clear()
                if test.depth:
                    self._to_depth(test.depth)
                start = time.perf_counter_ns()
                run(test.tokens)
                rates.append(test.tokens / ((time.perf_counter_ns() - start) / 1e9))
            return rates
        finally:
            self.free_context()

    def _clear(self) -> None:
        self._lc.llama_memory_clear(self._lc.llama_get_memory(self.ctx), False)  # as llama-bench: metadata only

    def _to_depth(self, depth: int) -> None:
        """The cache filled to `depth` tokens: restored from the saved state of the last depth computed, else
        computed and saved (llama-bench's ctx_state)."""
        lc = self._lc
        if self._state is not None and self._state[0] == depth:
            buf = self._state[1]
            if lc.llama_state_seq_set_data(self.ctx, buf, len(buf), 0):
                return
            self._clear()  # an incompatible state: computed again
        self._prompt(depth)
        size = lc.llama_state_seq_get_size(self.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        lc.llama_state_seq_get_data(self.ctx, buf, size, 0)
        self._state = (depth, buf)

    def _random_tokens(self, n: int) -> np.ndarray:
        return self._rng.integers(0, self.n_vocab, n, dtype=np.int32)

    def _decode_tokens(self, tokens: np.ndarray) -> None:
        """One llama_decode of `tokens` continuing the sequence (llama_batch_get_one: positions from the cache,
        the last token's logits only)."""
        lc = self._lc
        batch = lc.llama_batch_get_one(tokens.ctypes.data_as(ctypes.POINTER(lc.llama_token)), len(tokens))
        rc = lc.llama_decode(self.ctx, batch)
        if rc != 0:
            raise QevalError(f"llama_decode failed with code {rc} (out of memory, or the context is full)")

    def _prompt(self, n_tokens: int) -> None:
        """llama-bench's test_prompt: n_tokens random tokens in pieces of n_batch, then synchronize."""
        done = 0
        while done < n_tokens:
            tokens = self._random_tokens(min(n_tokens - done, self.n_batch))
            if done == 0 and self.add_bos:
                tokens[0] = self.bos
            self._decode_tokens(tokens)
            done += len(tokens)
        self._lc.llama_synchronize(self.ctx)

    def _generate(self, n_tokens: int) -> None:
        """llama-bench's test_gen: n_tokens single-token decodes, each synchronized."""
        token = np.array([self.bos if self.add_bos else self._random_tokens(1)[0]], dtype=np.int32)
        for _ in range(n_tokens):
            self._decode_tokens(token)
            self._lc.llama_synchronize(self.ctx)
            token[0] = self._random_tokens(1)[0]

    # -- a filled context, for the RSS cross-check (run in a child: rss_growth) ------------------------------------
    def fill(self, n_ctx: int) -> None:
        """A context of n_ctx tokens, every cell written (n_ctx tokens in pieces of n_batch): what RSS then holds is
        what the context uses."""
        self.open_context(self.shape(n_ctx))
        self._prompt(n_ctx)



def resident_bytes() -> int:
    """This process's resident set: VmRSS of /proc/self/status (Linux), else psutil's (macOS, Windows, where it is
    installed); QevalError where neither tells."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil  # noqa: PLC0415 - optional: only where /proc is absent
    except ImportError:
        raise QevalError(RSS_UNAVAILABLE) from None
    return psutil.Process().memory_info().rss


def fill_in_child(job: dict) -> None:
    """The child's side of rss_growth: the resident set before the model loads and after its context of n_ctx is
    filled, printed as RSS_LINE + JSON ({"rss_growth_bytes"} or {"error"})."""
    from qeval.engine.engine import quiet_llama  # noqa: PLC0415

    quiet_llama()  # llama.cpp's backends initialised before the baseline: only the model and context count
    try:
        before = resident_bytes()
        with DeployModel(job["model"], EngineSettings(**job["settings"]), job["n_cpu_moe"]) as model:
            model.fill(job["n_ctx"])
            answer = {"rss_growth_bytes": resident_bytes() - before}
    except QevalError as exc:
        answer = {"error": str(exc)}
    print(RSS_LINE + json.dumps(answer), flush=True)


def rss_growth(model_path, settings: EngineSettings, n_cpu_moe: int, n_ctx: int) -> tuple[int | None, str | None]:
    """(how much a child's resident set grew from before loading the model to after filling a context of n_ctx
    tokens, None) or (None, why it could not be measured)."""
    job = {"model": str(model_path), "settings": dataclasses.asdict(settings), "n_cpu_moe": n_cpu_moe, "n_ctx": n_ctx}
    try:
        proc = run_guarded(["fill", json.dumps(job)], f"filling a context of {n_ctx} tokens", timeout=FILL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"filling a context of {n_ctx} tokens took over {FILL_TIMEOUT_S} s"
    answers = [line[len(RSS_LINE):] for line in proc.stdout.splitlines() if line.startswith(RSS_LINE)]
    if not answers:
        last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return None, f"the child filling a context of {n_ctx} tokens ended without an answer ({last})"
    answer = json.loads(answers[-1])
    return answer.get("rss_growth_bytes"), answer.get("error")
