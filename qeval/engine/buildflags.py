"""The llama.cpp build flags that suit the CPU (and GPU) this runs on.

llama-cpp-python compiles llama.cpp at install time from CMAKE_ARGS. Two defaults go wrong:
a native build (-march=native) on Intel CPUs with AMX crashes in the AMX matmul, and a fixed
portable list that names AVX-512 dies with SIGILL on CPUs without it (AMD EPYC Zen 3, most
desktops). So on x86-64 the build is portable (GGML_NATIVE=OFF) and each instruction-set option
is switched on exactly when this CPU reports it; AMX stays off. Elsewhere (ARM, Apple silicon)
llama.cpp's own native default is right.

Standard library only: install.sh runs this file before qeval (or numpy) is installed:
    python3 qeval/engine/buildflags.py [--gpu cuda|metal|vulkan|hip] [--package]
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
# llama-cpp-python's own switches: its multimodal library (mtmd, 23K lines of C++) is never loaded by qeval, and
# compiling it is time every install pays
PACKAGE_OPTIONS = ("-DLLAVA_BUILD=OFF",)

# ggml option -> the /proc/cpuinfo flags it needs (ggml-cpu/CMakeLists.txt: GGML_AVX512 compiles
# with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw, hence all five).
X86_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512f", "avx512vbmi"),
    "GGML_AVX512_VNNI": ("avx512f", "avx512_vnni"),
    "GGML_AVX512_BF16": ("avx512f", "avx512_bf16"),
}
# Never enabled: the AMX matmul crashes (SIGSEGV) at the first decode on the machines we saw.
X86_ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
GPU_OPTIONS = {"cuda": "GGML_CUDA", "metal": "GGML_METAL", "vulkan": "GGML_VULKAN", "hip": "GGML_HIP"}


def is_x86_64(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64")


def cpuinfo_field(name: str, cpuinfo: str | None = None) -> str | None:
    """The first value of a /proc/cpuinfo field (None where it or the file is unavailable)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
                cpuinfo = fh.read()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags as Linux names them (empty where /proc/cpuinfo is unavailable)."""
    return set((cpuinfo_field("flags", cpuinfo) or "").split())


def cpu_model() -> str | None:
    """The CPU's name ("model name" in /proc/cpuinfo, else what the platform says; None when neither says)."""
    return cpuinfo_field("model name") or platform.processor() or None


def cmake_options(flags: set[str], machine: str | None = None, gpu: str | None = None) -> list[str]:
    """The -D options for this machine. On x86-64 without readable CPU flags, AVX2 is assumed
    absent: a slower build beats one that dies with SIGILL."""
    options = []
    if is_x86_64(machine):
        options.append("-DGGML_NATIVE=OFF")
        for option, needs in X86_OPTIONS.items():
            options.append(f"-D{option}={'ON' if all(f in flags for f in needs) else 'OFF'}")
        options += [f"-D{option}=OFF" for option in X86_ALWAYS_OFF]
    if gpu:
        if gpu not in GPU_OPTIONS:
            raise ValueError(f"unknown GPU backend {gpu!r}; choose one of: {', '.join(GPU_OPTIONS)}")
        options.append(f"-D{GPU_OPTIONS[gpu]}=ON")
    return options


def this_machine_options(gpu: str | None = None) -> list[str]:
    return [*cmake_options(cpu_flags(), gpu=gpu), *PACKAGE_OPTIONS]


def reinstall_command(gpu: str | None = None) -> str:
    """A pip command that rebuilds llama-cpp-python for this machine. --no-cache-dir and
    --force-reinstall because pip otherwise reuses its cached wheel whatever CMAKE_ARGS say."""
    cmake_args = " ".join(this_machine_options(gpu))
    return (f"CMAKE_ARGS={shlex.quote(cmake_args)} pip install --no-cache-dir --force-reinstall --no-deps "
            f"{LLAMA_CPP_PYTHON}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print the CMAKE_ARGS for a llama.cpp build on this machine.")
    parser.add_argument("--gpu", choices=sorted(GPU_OPTIONS), default=os.environ.get("QEVAL_GPU") or None)
    parser.add_argument("--package", action="store_true", help="print the llama-cpp-python pin instead")
    args = parser.parse_args(argv)
    print(LLAMA_CPP_PYTHON if args.package else " ".join(this_machine_options(args.gpu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
