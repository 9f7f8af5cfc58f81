"""Where llama.cpp's shared libraries are: the folder llama-cpp-python loads them from (its package's lib/, or the
folder LLAMA_CPP_LIB_PATH names) and a library's file there, named as llama-cpp-python names it on this platform
(llama_cpp._ctypes_extensions.load_shared_library: lib<name>.so on Linux, .so or .dylib on macOS, <name>.dll or
lib<name>.dll on Windows). Everything in qeval that locates those libraries asks here."""

from __future__ import annotations

import importlib.util
import os
import struct
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


# C++ runtimes a shared library can load (GNU's and LLVM's), by the start of their file names
CXX_RUNTIMES = ("libstdc++.so", "libc++.so")
_PT_LOAD, _PT_DYNAMIC, _DT_NULL, _DT_NEEDED, _DT_STRTAB = 1, 2, 0, 1, 5


def needed_libraries(path: Path) -> list[str] | None:
    """The libraries an ELF shared library names as needed (its DT_NEEDED entries), in order; None where `path` is
    not a 64-bit little-endian ELF file (macOS, Windows, a 32-bit build): the question is then left open."""
    data = Path(path).read_bytes()
    if data[:6] != b"\x7fELF\x02\x01":
        return None
    phoff, phentsize, phnum = int.from_bytes(data[32:40], "little"), *struct.unpack_from("<HH", data, 54)
    headers = [struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize) for i in range(phnum)]
    loads = [(vaddr, offset, filesz) for kind, _, offset, vaddr, _, filesz in headers if kind == _PT_LOAD]
    dynamic = next(((offset, filesz) for kind, _, offset, _, _, filesz in headers if kind == _PT_DYNAMIC), None)
    if dynamic is None:
        return []
    entries = [struct.unpack_from("<qQ", data, at) for at in range(dynamic[0], sum(dynamic) - 15, 16)]
    entries = entries[:next((i for i, (tag, _) in enumerate(entries) if tag == _DT_NULL), len(entries))]
    strtab = next((value for tag, value in entries if tag == _DT_STRTAB), None)
    base = next((offset + strtab - vaddr for vaddr, offset, size in loads if strtab is not None
                 and vaddr <= strtab < vaddr + size), None)
    if base is None:
        return None
    return [data[base + value:data.index(b"\0", base + value)].decode() for tag, value in entries if tag == _DT_NEEDED]


def private_cxx_runtime(folder: Path | None = None) -> bool:
    """Whether the build's libllama loads no C++ runtime: it was linked with its own copy (-static-libstdc++), and so
    was each of its C++ libraries. Two such copies meet when a model loads (llama_model::print_info's stream output
    resolves to libggml-cuda's copy: SIGSEGV, seen on an NVIDIA H200 machine's CUDA build); llama.cpp's own
    executables link the runtime into themselves and run. False where it cannot be told (not ELF, no libllama)."""
    lib = library_path("llama", folder)
    needed = None if lib is None else needed_libraries(lib)
    return needed is not None and not any(name.startswith(CXX_RUNTIMES) for name in needed)
