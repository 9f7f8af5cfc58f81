"""The child side of qeval.engine.probe: `python -m qeval.engine.probe_child JOB ARGS` prints llama.cpp's
system info first (the instruction sets the build was compiled for), then runs JOB (but `build`, the build check of
qeval.engine.build_check, which must not import the bindings before it has checked them). Whatever kills the
child (SIGILL, SIGSEGV, ...) reaches the parent as a signal it turns into one message.

A module of its own: it runs the engine, which itself asks the probe (the parent side) first."""

from __future__ import annotations

import ctypes
import json
import os
import sys

from qeval.engine.probe import SYSTEM_INFO_PREFIX


def _print_system_info() -> None:
    import llama_cpp  # noqa: PLC0415 - not for the build check, which must not import the bindings first

    info = llama_cpp.llama_print_system_info().decode(errors="replace").replace("\n", " ")
    print(SYSTEM_INFO_PREFIX + info, flush=True)


def _decode(model: str) -> None:
    import numpy as np  # noqa: PLC0415

    from qeval.engine.engine import Engine  # noqa: PLC0415

    with Engine(model, 16) as engine:
        for _ in engine.iter_scored_logits(np.full(16, engine.bos, dtype=np.int32)):
            pass


def _quantize(src: str, dst: str, ftype: str) -> None:
    import llama_cpp  # noqa: PLC0415

    from qeval.engine.engine import quiet_llama  # noqa: PLC0415

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


def _build() -> None:
    from qeval.engine.build_check import print_report  # noqa: PLC0415

    print_report()


CHILD_JOBS = {"decode": _decode, "quantize": _quantize, "recipe": _recipe, "fill": _fill, "build": _build}

if __name__ == "__main__":
    if sys.argv[1] != "build":  # the build check loads the build itself: the bindings may not import
        _print_system_info()
    CHILD_JOBS[sys.argv[1]](*sys.argv[2:])
