"""Assemble the GPU kit in .gpukit/kit/: everything a run on the device machine needs, in pieces that each fit
one call (tools/gpu/README.md).

    /work/main/.venv/bin/python tools/gpu/assemble.py [--only src,wheels,models] [--kit .gpukit/kit]

Pieces (each a path under the kit's folder; manifest.json lists them with their sizes and the calls that carry them):
  src/     llama-cpp-python's sdist trimmed to a CUDA/CPU build of the library plus llama-perplexity and llama-bench
  wheels/  the wheels qeval needs that the device image lacks (manylinux x86_64, CPython 3.12)
  models-<name>/  a tiny random-weight model pair (reference Q8_0, candidate Q4_0) per vocab that matters

Needs the network (pip) and a qeval environment with llama-cpp-python (the quantizer) and the demo model (the
Gemma-3 tokenizer the tiny models carry).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO)]  # kit, models; this checkout's qeval
import kit

from qeval.errors import QevalError

SDIST = f"llama_cpp_python-{kit.LLAMA_CPP_PYTHON_VERSION}.tar.gz"
# The wheels qeval needs that the device image lacks (KINDS.md's package list), each with the requirement that
# decides whether a machine needs it: run.sh installs a wheel only where that requirement is unmet, so a machine
# that has the package keeps its own. scikit-build-core and pathspec build llama-cpp-python offline
# (--no-build-isolation); setuptools>=77 builds qeval itself (pyproject's build-system).
WHEELS = {"zstandard==0.25.0": "zstandard>=0.22", "gguf==0.19.0": "gguf>=0.19", "diskcache==5.6.3": "diskcache>=5.6.1",
          "scikit-build-core==1.1.2": "scikit-build-core>=0.9.2", "pathspec==1.1.1": "pathspec>=0.12",
          "setuptools==84.2.1": "setuptools>=77"}
BASE_PIECES = ("src", "wheels")  # what every call carries: the build's inputs
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def build_src(kit_dir: Path, cache: Path) -> Path:
    """The sdist, downloaded once into the cache, written again without what the build does not read."""
    original = cache / SDIST
    if not original.is_file():
        pip("download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(cache),
            f"llama-cpp-python=={kit.LLAMA_CPP_PYTHON_VERSION}")
    out = kit_dir / "src" / SDIST
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".part")
    rewritten = set()
    with tarfile.open(original) as src, tarfile.open(partial, "w:gz", compresslevel=9) as dst:
        for member in src:
            _, _, rel = member.name.partition("/")
            if not rel or not kit.kept(rel):
                continue
            if not member.isfile():
                if member.isdir():
                    dst.addfile(member)
                continue
            data = src.extractfile(member).read()
            if rel in kit.REWRITTEN:
                data = kit.rewrite(rel, data.decode()).encode()
                member.size = len(data)
                rewritten.add(rel)
            dst.addfile(member, io.BytesIO(data))
    if rewritten != set(kit.REWRITTEN):
        raise QevalError(f"the sdist lacks {sorted(set(kit.REWRITTEN) - rewritten)}: update tools/gpu/kit.py")
    partial.replace(out)
    return out.parent


def build_wheels(kit_dir: Path) -> Path:
    out = kit_dir / "wheels"
    out.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
        *platforms, "-d", str(out), *WHEELS)
    (out / "requirements.json").write_text(json.dumps(
        {wheel_name(out, dist): needed for dist, needed in WHEELS.items()}, indent=1) + "\n")
    return out


def wheel_name(folder: Path, dist: str) -> str:
    name, version = dist.split("==")
    found = sorted(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if len(found) != 1:
        raise QevalError(f"expected one wheel of {dist} in {folder}, found {[f.name for f in found]}")
    return found[0].name


def build_models(kit_dir: Path) -> list[Path]:
    import models

    return [models.build_pair(spec, kit_dir / f"models-{spec.name}", kit_dir.parent / "cache" / "models")
            for spec in models.SPECS]


def manifest(kit_dir: Path, pieces: list[Path], seconds: dict[str, float]) -> dict:
    tree = kit.tree_bytes(REPO)
    listed = [kit.Piece(p.relative_to(kit_dir).as_posix(), kit.path_bytes(p)) for p in pieces]
    base = [p for p in listed if p.name in BASE_PIECES]
    calls = kit.plan_calls(base, [p for p in listed if p not in base], tree)
    return {
        "tree_bytes": tree,
        "call_limit_bytes": kit.CALL_LIMIT_BYTES,
        "piece_budget_bytes": kit.piece_budget(tree),
        "pieces": {p.name: p.bytes for p in listed},
        "calls": [[p.name for p in call] for call in calls],
        "call_bytes": [sum(p.bytes for p in call) for call in calls],
        "assemble_seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kit", type=Path, default=REPO / ".gpukit" / "kit")
    ap.add_argument("--only", default="src,wheels,models", help="comma-separated subset of src,wheels,models")
    args = ap.parse_args(argv)
    kit_dir = args.kit.resolve()
    cache = kit_dir.parent / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    steps = {"src": lambda: [build_src(kit_dir, cache)], "wheels": lambda: [build_wheels(kit_dir)],
             "models": lambda: build_models(kit_dir)}
    seconds = {}
    for step in args.only.split(","):
        started = time.perf_counter()
        steps[step]()
        seconds[step] = round(time.perf_counter() - started, 1)
    pieces = sorted(p for p in kit_dir.iterdir() if p.is_dir())
    try:
        summary = manifest(kit_dir, pieces, seconds)
    except QevalError as e:
        print(f"assemble: {e}", file=sys.stderr)
        return 1
    (kit_dir / "manifest.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, size in summary["pieces"].items():
        print(f"{size / kit.MiB:8.2f} MiB  {name}")
    for i, (call, size) in enumerate(zip(summary["calls"], summary["call_bytes"]), 1):
        print(f"call {i}: carry {', '.join('.gpukit/kit/' + n for n in call)} ({size / kit.MiB:.1f} MiB "
              f"+ tree {summary['tree_bytes'] / kit.MiB:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
