"""The GPU kit's rules, without building anything: what of llama-cpp-python's source a build keeps, and
whether the kit's pieces fit the device machine's per-call limit.

The device machine (docs/gpu.md) takes at most 64 MiB per call, the repository's working tree included, and
has no network. So every piece of the kit (trimmed source, wheels, models) must fit beside the tree in one call,
and the pieces are grouped into as few calls as fit (`plan_calls`). assemble.py builds the pieces; this module
holds only the rules, so that tests/test_gpukit.py checks them in milliseconds.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from qeval.errors import QevalError

MiB = 2**20
CALL_LIMIT_BYTES = 64 * MiB  # the device tool's limit on what travels in one call, working tree included
# Headroom under the limit: untracked files that appear between assembling and the call, a log, a result.
MARGIN_BYTES = 2 * MiB

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
VENDOR = "vendor/llama.cpp"

# llama-cpp-python's own files a scikit-build-core build reads (README.md: pyproject's readme; PKG-INFO: an sdist's).
KEEP_TOP = frozenset({"CMakeLists.txt", "pyproject.toml", "llama_cpp", "LICENSE.md", "README.md", "PKG-INFO",
                      "vendor"})
# What the vendored llama.cpp's CMake reads for the library, common/ and the two tools (vendor/: json, httplib,
# and what vendor/CMakeLists.txt adds unconditionally).
KEEP_VENDOR = frozenset({"CMakeLists.txt", "cmake", "include", "src", "common", "ggml", "vendor", "tools", "LICENSE"})
# ggml/src/ggml-<backend>/ folders kept: the CPU backend always, CUDA for the GPU build. ggml adds a backend's
# folder only when its GGML_<BACKEND> option is on, so the others can go.
KEEP_BACKENDS = frozenset({"ggml-cpu", "ggml-cuda"})
KEEP_TOOLS = ("llama-bench", "perplexity")  # the targets llama-bench and llama-perplexity
# Dropped at any depth: repository metadata. (Not "models": src/models/ holds the architectures' code.)
DROP_ANYWHERE = frozenset({".git", ".github", ".gemini"})

# tools/CMakeLists.txt as the trimmed tree has it: only the two tools kept (the original adds every tool folder).
TOOLS_CMAKELISTS = ("# qeval's GPU kit: only the tools a check runs (tools/gpu/kit.py)\n"
                    "find_package(Threads REQUIRED)\n"
                    "llama_add_compile_flags()\n"
                    + "".join(f"add_subdirectory({tool})\n" for tool in KEEP_TOOLS))
# llama-cpp-python builds libmtmd (multimodal, from tools/mtmd) by default; qeval never loads it
# (llama_cpp imports mtmd_cpp only for a vision chat handler), and the trimmed tree drops tools/mtmd.
LLAVA_DEFAULT_ON = 'option(LLAVA_BUILD "Build llava shared library and install alongside python package" ON)'
LLAVA_DEFAULT_OFF = LLAVA_DEFAULT_ON.replace(" ON)", " OFF)")


def kept(relpath: str) -> bool:
    """Whether a path of the unpacked sdist (relative to its top folder) stays in the trimmed tree."""
    parts = PurePosixPath(relpath).parts
    if not parts or parts[0] not in KEEP_TOP or DROP_ANYWHERE.intersection(parts):
        return False
    if parts[0] != "vendor":
        return True
    if len(parts) < 3 or parts[1] != "llama.cpp":
        return len(parts) < 2 or parts[1] == "llama.cpp"
    inner = parts[2:]
    if inner[0] not in KEEP_VENDOR:
        return False
    if inner[0] == "tools":
        return inner == ("tools", "CMakeLists.txt") or (len(inner) > 1 and inner[1] in KEEP_TOOLS)
    if inner[:2] == ("ggml", "src") and len(inner) > 3 and inner[2].startswith("ggml-"):
        return inner[2] in KEEP_BACKENDS
    return True


def rewrite(relpath: str, text: str) -> str:
    """A kept file's text in the trimmed tree: the two CMake files whose original names what was dropped."""
    if relpath == f"{VENDOR}/tools/CMakeLists.txt":
        return TOOLS_CMAKELISTS
    if relpath == "CMakeLists.txt":
        if LLAVA_DEFAULT_ON not in text:
            raise QevalError("llama-cpp-python's CMakeLists.txt no longer declares LLAVA_BUILD as the kit expects: "
                             "update tools/gpu/kit.py for this version")
        return text.replace(LLAVA_DEFAULT_ON, LLAVA_DEFAULT_OFF)
    return text


REWRITTEN = ("CMakeLists.txt", f"{VENDOR}/tools/CMakeLists.txt")


# --------------------------------------------------------------------------------------------------
# sizes: each piece fits one call beside the working tree
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    name: str  # the path under the kit's folder that travels (a file or a folder), as run.sh expects it
    bytes: int


def piece_budget(tree_bytes: int, limit: int = CALL_LIMIT_BYTES, margin: int = MARGIN_BYTES) -> int:
    """The most one call can carry beside a working tree of tree_bytes."""
    return limit - margin - tree_bytes


def check_pieces(pieces: list[Piece], tree_bytes: int, limit: int = CALL_LIMIT_BYTES) -> None:
    """Refuse a kit with a piece that cannot travel in any call."""
    budget = piece_budget(tree_bytes, limit)
    too_big = [p for p in pieces if p.bytes > budget]
    if too_big:
        listed = ", ".join(f"{p.name} ({p.bytes / MiB:.1f} MiB)" for p in too_big)
        raise QevalError(f"kit piece over the per-call budget of {budget / MiB:.1f} MiB "
                         f"({limit / MiB:.0f} MiB less the {tree_bytes / MiB:.1f} MiB working tree and margin): "
                         f"{listed}; make it smaller or split it")


def plan_calls(base: list[Piece], extras: list[Piece], tree_bytes: int,
               limit: int = CALL_LIMIT_BYTES) -> list[list[Piece]]:
    """The pieces grouped into calls: the base pieces (source and wheels: what the build needs) travel in every call,
    so that each call stands alone (a machine is warm only 30 s after a call: the next one may find it bare and
    rebuild), and the extras (models) fill the calls in order beside them."""
    check_pieces(base + extras, tree_bytes, limit)
    room = piece_budget(tree_bytes, limit) - sum(p.bytes for p in base)
    too_big = [p.name for p in extras if p.bytes > room]
    if too_big:
        raise QevalError(f"kit pieces too big to travel beside the source and wheels ({room / MiB:.1f} MiB left "
                         f"in a call): {', '.join(too_big)}")
    calls: list[list[Piece]] = []
    for piece in extras:
        if calls and sum(p.bytes for p in calls[-1]) + piece.bytes <= room:
            calls[-1].append(piece)
        else:
            calls.append([piece])
    return [base + call for call in calls] or [list(base)]


def tree_bytes(repo: Path) -> int:
    """Bytes of the working tree that travels: tracked files and untracked files git does not ignore."""
    listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout.split(b"\0")
    return sum((repo / name.decode()).stat().st_size for name in listed
               if name and (repo / name.decode()).is_file())


def path_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
