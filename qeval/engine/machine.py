"""The machine a speed or memory figure was measured on: CPU and its flags, the cores this process may use, GPUs and
their driver (nvidia-smi, where there is one), the llama.cpp build and its backend. Its id, a hash of all of it, is
what a deployment record is reused by (qeval.storage.deployment): a figure is never carried to another machine, or
to this machine under another driver or llama.cpp build."""

from __future__ import annotations

import shutil
import subprocess

from qeval.engine.buildflags import cpu_flags, cpu_model
from qeval.engine.engine import _llama_cpp, available_cores
from qeval.engine.numerics import build_info
from qeval.storage.deployment import machine_id

NVIDIA_SMI_QUERY = ["--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"]
NVIDIA_SMI_TIMEOUT_S = 20


def nvidia_gpus(smi: str | None = None) -> list[dict]:
    """[{"name", "driver", "memory_bytes"}] of every NVIDIA GPU nvidia-smi lists; [] without nvidia-smi or when it
    fails (no driver loaded)."""
    smi = smi or shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return [parse_gpu_line(line) for line in out.stdout.splitlines() if line.strip()]


def parse_gpu_line(line: str) -> dict:
    """One line of nvidia-smi's CSV answer (name, driver, total memory in MiB)."""
    name, driver, mib = (part.strip() for part in line.rsplit(",", 2))
    try:
        memory = int(float(mib)) << 20
    except ValueError:
        memory = None
    return {"name": name, "driver": driver, "memory_bytes": memory}


def build_backend(system_info: str) -> str:
    """The backend a llama.cpp build computes on beyond the CPU (CUDA, Metal, Vulkan, ...), from its system info
    ("CPU : AVX2 = 1 | ... | CUDA : ARCHS = 890 | ..."); "CPU" for a CPU-only build."""
    names = [part.split(" : ")[0].strip() for part in system_info.split("|") if " : " in part]
    return next((n for n in names if n and n != "CPU"), "CPU")


def current_machine(gpus: list[dict] | None = None) -> dict:
    """This machine's block of a deployment record, with its id (qeval.storage.deployment.machine_id)."""
    lc = _llama_cpp()
    build = build_info(lc)
    machine = {"cpu": cpu_model(), "cpu_flags": sorted(cpu_flags()), "cores": available_cores(),
               "gpus": nvidia_gpus() if gpus is None else gpus, "backend": build_backend(build["system_info"]),
               "llama_cpp": {"version": build["llama_cpp_python"], "system_info": build["system_info"],
                             "gpu_offload": bool(lc.llama_supports_gpu_offload())}}
    return {"id": machine_id(machine), **machine}


def describe(machine: dict) -> str:
    """A machine in a few words: its CPU and cores, its GPUs."""
    gpus = ", ".join(g["name"] for g in machine.get("gpus") or ())
    return f"{machine.get('cpu') or 'unknown CPU'} ({machine.get('cores')} cores)" + (f", {gpus}" if gpus else "")
