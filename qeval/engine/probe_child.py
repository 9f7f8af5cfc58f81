"""The child side of qeval.engine.probe: `python -m qeval.engine.probe_child JOB ARGS` prints llama.cpp's
system info first (the instruction sets the build was compiled for), then runs JOB. Whatever kills the
child (SIGILL, SIGSEGV, ...) reaches the parent as a signal it turns into one message.

A module of its own: it runs the engine, which itself asks the probe (the parent side) first."""

from __future__ import annotations

import ctypes
import json
import os
import sys

import llama_cpp
import numpy as np

from qeval.engine.engine import Engine, quiet_llama
from qeval.engine.probe import SYSTEM_INFO_PREFIX


def _print_system_info() -> None:
    info = llama_cpp.llama_print_system_info().decode(errors="replace").replace("\n", " ")
    print(SYSTEM_INFO_PREFIX + info, flush=True)


def _decode(model: str) -> None:
    with Engine(model, 16) as engine:
        for _ in engine.iter_scored_logits(np.full(16, engine.bos, dtype=np.int32)):
            pass


def _quantize(src: str, dst: str, ftype: str) -> None:
    quiet_llama()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(ftype)
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"llama_model_quantize returned {rc}")


def _recipe(job: str) -> None:
    from qeval.engine.recipe import quantize_in_child  # noqa: PLC0415

    quantize_in_child(json.loads(job))


def _fill(job: str) -> None:
    from qeval.engine.deploy import fill_in_child  # noqa: PLC0415

    fill_in_child(json.loads(job))


CHILD_JOBS = {"decode": _decode, "quantize": _quantize, "recipe": _recipe, "fill": _fill}

if __name__ == "__main__":
    _print_system_info()
    CHILD_JOBS[sys.argv[1]](*sys.argv[2:])
