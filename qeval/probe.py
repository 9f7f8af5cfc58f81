"""Catch a llama-cpp-python build that crashes on this CPU before it takes a capture down.

A build compiled with native flags on some machines dies in the AMX matmul at the first decode
(SIGSEGV): no Python exception, just a dead process. So the first use of each build decodes a
few tokens in a child process; a crash there becomes one clear message. Success is remembered per
build (the shared libraries' paths, sizes and mtimes).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from .errors import QevalError
from .modelinfo import cache_dir

REINSTALL = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON '
             '-DGGML_AVX512=ON" pip install --force-reinstall --no-cache-dir --no-deps llama-cpp-python==0.3.36')


def build_id() -> str:
    import llama_cpp  # noqa: PLC0415

    root = Path(llama_cpp.__file__).parent
    h = hashlib.sha256(llama_cpp.__version__.encode())
    for lib in sorted(root.rglob("*.so*")) + sorted(root.rglob("*.dylib")) + sorted(root.rglob("*.dll")):
        st = lib.stat()
        h.update(f"{lib}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def probe_command(model: str | os.PathLike) -> list[str]:
    return [sys.executable, "-m", "qeval.probe", str(model)]


def ensure_llama_runs(model: str | os.PathLike) -> None:
    if os.environ.get("QEVAL_SKIP_PROBE"):
        return
    marker = cache_dir() / "probe" / f"{build_id()}.ok"
    if marker.exists():
        return
    proc = subprocess.run(probe_command(model), capture_output=True, text=True, timeout=600)
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        raise QevalError(
            f"this llama-cpp-python build crashes on this CPU ({sig} at the first decode). This happens when it "
            f"was compiled with native CPU flags on some machines (the AMX matmul path). Rebuild it with "
            f"portable flags:\n  {REINSTALL}")
    if proc.returncode != 0:
        # The model itself may be at fault (bad file, ...); the caller will report that properly.
        return
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass


def _probe(model: str) -> None:
    import numpy as np  # noqa: PLC0415

    from .engine import Engine  # noqa: PLC0415

    with Engine(model, 16) as engine:
        for _ in engine.iter_scored_logits(np.full(16, engine.bos, dtype=np.int32)):
            pass


if __name__ == "__main__":
    _probe(sys.argv[1])
