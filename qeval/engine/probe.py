"""Catch a llama-cpp-python build that crashes on this CPU before it takes a run down.

A llama.cpp build can die without a Python exception: SIGILL when it was compiled for
instructions this CPU lacks (AVX-512 on an AMD Zen 3, say), SIGSEGV in the AMX matmul of a
native build on some Intel machines or where each library carries its own C++ runtime, SIGBUS, SIGFPE, an abort. So every path that runs llama.cpp
first runs it in a child process: a decode of a few tokens before a capture or a live candidate
(remembered per build, keyed by the shared libraries' paths, sizes and mtimes), and the whole
quantization for `demo`. A crash there becomes one clear message with a rebuild command for
this machine.

The child prints llama.cpp's system info (the instruction sets the build was compiled for)
before it does anything else, so the message can say which of them this CPU lacks.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import signal
import subprocess
import sys
from pathlib import Path

from qeval.engine.buildflags import X86_OPTIONS, cpu_flags, is_x86_64, reinstall_command
from qeval.engine.modelinfo import cache_dir
from qeval.errors import QevalError
from qeval.storage.llama_libraries import library_folders, private_cxx_runtime, shared_libraries

SYSTEM_INFO_PREFIX = "qeval-llama-system-info: "


def build_id() -> str:
    # found, not imported: importing llama_cpp binds the build, which the build check (qeval.engine.build_check),
    # keyed by this id, must do first. LLAMA_CPP_LIB_PATH makes llama-cpp-python load the libraries from
    # elsewhere: hash those too
    try:
        folders = library_folders()
    except ImportError:
        raise QevalError("llama-cpp-python is not installed; see README 'Install'") from None
    h = hashlib.sha256(importlib.metadata.version("llama_cpp_python").encode())
    for root in folders:
        for lib in shared_libraries(root):
            st = lib.stat()
            h.update(f"{lib}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def child_command(args: list[str]) -> list[str]:
    """The argv of a guarded child; the one seam tests replace with a child that crashes."""
    return [sys.executable, "-m", "qeval.engine.probe_child", *args]


def missing_instructions(system_info: str, flags: set[str]) -> list[str]:
    """Instruction sets the build uses (llama.cpp prints `AVX512 = 1`) that this CPU lacks."""
    if not flags:
        return []
    used = {part.split("=")[0].strip() for part in system_info.split("|") if part.strip().endswith("= 1")}
    lacking = []
    for option, needs in X86_OPTIONS.items():
        name = option.removeprefix("GGML_")
        if name in used and not all(f in flags for f in needs):
            lacking.append(name)
    return lacking


def crash_message(returncode: int, stdout: str, what: str) -> str:
    try:
        sig = signal.Signals(-returncode).name
    except ValueError:
        sig = f"signal {-returncode}"
    info = next((line[len(SYSTEM_INFO_PREFIX):] for line in stdout.splitlines()
                 if line.startswith(SYSTEM_INFO_PREFIX)), "")
    lacking = missing_instructions(info, cpu_flags()) if is_x86_64() else []
    if lacking:
        why = f"it was compiled for {', '.join(lacking)}, which this CPU does not have"
    elif private_cxx_runtime():
        why = ("its libraries each carry their own copy of the C++ runtime (libllama loads no libstdc++.so.6: "
               "linked with -static-libstdc++), and the copies crash where they meet; run qeval with "
               "LD_PRELOAD=libstdc++.so.6, or rebuild it with a compiler that links libstdc++ dynamically")
    elif sig == "SIGILL":
        why = ("it executes an instruction this CPU does not have: it was compiled for another CPU "
               "(AVX-512 on a CPU without it, say)")
    elif sig == "SIGSEGV":
        why = "a build with native CPU flags crashes like this in the AMX matmul on some machines"
    else:
        why = "it was probably compiled for another machine or with flags this CPU does not support"
    return (f"this llama-cpp-python build crashes on this CPU ({sig} during {what}): {why}. "
            f"Rebuild it for this machine (pip's wheel cache bypassed):\n  {reinstall_command()}\n"
            "or, in a qeval checkout: ./install.sh --rebuild (add --gpu cuda|metal|vulkan for a GPU build)")


def run_guarded(args: list[str], what: str, timeout: float = 3600) -> subprocess.CompletedProcess:
    """Run `python -m qeval.engine.probe_child ARGS` in a child; a crash by signal raises one clear QevalError."""
    # the child is the probe: the model it loads must not spawn another one (qeval.engine.engine.LlamaModel)
    env = {**os.environ, "QEVAL_SKIP_PROBE": "1"}
    proc = subprocess.run(child_command(args), capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode == -signal.SIGKILL:  # not a crash of the build: the kernel's out-of-memory killer, or a user
        raise QevalError(f"the child running {what} was killed (SIGKILL): most likely the system ran out of memory")
    if proc.returncode < 0:
        raise QevalError(crash_message(proc.returncode, proc.stdout, what))
    return proc


def ensure_llama_runs(model: str | os.PathLike) -> None:
    """Decode a few tokens of `model` in a child once per llama.cpp build."""
    if os.environ.get("QEVAL_SKIP_PROBE"):
        return
    marker = cache_dir() / "probe" / f"{build_id()}.ok"
    if marker.exists():
        return
    proc = run_guarded(["decode", str(model)], "the first decode")
    if proc.returncode != 0:
        # The model itself may be at fault (bad file, ...); the caller will report that properly.
        return
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass


def quantize_guarded(src: Path, dst: Path, ftype: int) -> None:
    """llama.cpp's quantizer in a child: a crash is a message, a failure its stderr's last line."""
    proc = run_guarded(["quantize", str(src), str(dst), str(ftype)], f"quantization of {src.name}")
    if proc.returncode != 0:
        detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise QevalError(f"llama.cpp could not quantize {src.name} to ftype {ftype}: {detail}")
