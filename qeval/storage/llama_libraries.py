"""Where llama.cpp's shared libraries are: the folder llama-cpp-python loads them from (its package's lib/, or the
folder LLAMA_CPP_LIB_PATH names) and a library's file there, named as llama-cpp-python names it on this platform
(llama_cpp._ctypes_extensions.load_shared_library: lib<name>.so on Linux, .so or .dylib on macOS, <name>.dll or
lib<name>.dll on Windows). Everything in qeval that locates those libraries asks here."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

# a shared library on any platform (a Linux one may carry a version: .so.1), in the order a build's files are hashed
PATTERNS = ("*.so*", "*.dylib", "*.dll")


def library_file_names(name: str, platform: str | None = None) -> list[str]:
    """The file names library `name` (llama, ggml-base, ...) may have on `platform` (sys.platform), in the order
    llama-cpp-python tries them."""
    platform = platform or sys.platform
    if platform == "darwin":
        return [f"lib{name}.so", f"lib{name}.dylib"]
    if platform == "win32":
        return [f"{name}.dll", f"lib{name}.dll"]
    return [f"lib{name}.so"]  # Linux, the BSDs


def package_folder() -> Path:
    """The llama_cpp package's folder, found without importing it (the import loads, and binds, the build, which
    qeval.engine.build_check must check first); ImportError where llama-cpp-python is not installed."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("llama-cpp-python is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def library_folders() -> list[Path]:
    """Every folder llama-cpp-python may load llama.cpp's libraries from: its package (lib/ inside it) and
    LLAMA_CPP_LIB_PATH where set."""
    return [package_folder(), *(Path(p) for p in filter(None, [os.environ.get("LLAMA_CPP_LIB_PATH")]))]


def loaded_folder() -> Path:
    """The folder llama-cpp-python loads its libraries from: LLAMA_CPP_LIB_PATH, else its package's lib/."""
    folder = os.environ.get("LLAMA_CPP_LIB_PATH")
    return Path(folder) if folder else package_folder() / "lib"


def library_path(name: str, folder: Path | None = None) -> Path | None:
    """The file of library `name` in `folder` (default: loaded_folder()) on this platform, None where it has none."""
    folder = loaded_folder() if folder is None else folder
    return next((folder / n for n in library_file_names(name) if (folder / n).is_file()), None)


def library_file(folder: Path, name: str) -> Path:
    """Library `name`'s file in `folder`: the one there, else the first name this platform gives it."""
    return library_path(name, folder) or folder / library_file_names(name)[0]


def shared_libraries(root: Path) -> list[Path]:
    """Every shared library under `root`, of any platform: what a build is made of (sorted per pattern)."""
    return [p for pattern in PATTERNS for p in sorted(root.rglob(pattern))]
