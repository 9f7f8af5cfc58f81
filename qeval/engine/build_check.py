"""The llama.cpp build qeval loads, checked against llama-cpp-python's bindings before anything runs, and what it is.

A user may point qeval at a build of their own (LLAMA_CPP_LIB_PATH: a fork, a newer mainline). llama-cpp-python
binds its functions by name with the signatures of the llama.h it was written for: a function the build lacks
fails its import, and a parameter struct of another size is read and written past its end, silently. So a child
process (qeval.engine.probe_child `build`, crash-safe as the probe is) checks, without importing the bindings first:

- every function the bindings bind (their `@ctypes_function("name", ...)` declarations in llama_cpp/llama_cpp.py)
  is exported by the build's libllama;
- the parameter structs llama.cpp returns by value (llama_context_params, llama_model_params,
  llama_model_quantize_params) are the size the bindings declare: their default-params function is called with a
  buffer of known fill as its return slot (x86-64, where that slot is the first argument), and the bytes it writes
  give the C struct's size. On other machines this part is skipped and said so.

and reports the build's identity: llama_version(), ggml_version() and ggml_commit(), and its ggml type table
(qeval.engine.cache_types). An incompatible build is refused with one message naming what differs. The report is
kept per build (qeval.engine.probe.build_id) on disk and once per process in memory.
"""

from __future__ import annotations

import ast
import ctypes
import json
import os
import platform
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from qeval.engine import cache_types
from qeval.errors import QevalError
from qeval.storage.llama_libraries import library_file, loaded_folder, package_folder

REPORT_VERSION = 1
REPORT_PREFIX = "qeval-build-report: "
# The structs llama.cpp returns by value, by the function that returns its defaults (they are > 16 bytes, so
# returned through a slot the caller passes).
DEFAULT_PARAMS = {"llama_context_params": "llama_context_default_params",
                  "llama_model_params": "llama_model_default_params",
                  "llama_model_quantize_params": "llama_model_quantize_default_params"}
_FILLS = (0xAA, 0x55)
_SLOT_BYTES = 4096  # more than any parameter struct


@dataclass(frozen=True)
class BuildReport:
    """What the build check found (the module's docstring)."""

    library: str  # the folder the build was loaded from
    llama_version: str
    ggml_version: str
    ggml_commit: str
    types: list = field(default_factory=list)  # [cache_types.GgmlType]
    missing: list = field(default_factory=list)  # functions the bindings bind that the build lacks
    structs: dict = field(default_factory=dict)  # {struct: [bytes the bindings declare, bytes the build writes]}
    unchecked: str = ""  # what was not checked, and why

    def differences(self) -> list[str]:
        out = []
        if self.missing:
            more = len(self.missing) - 8
            shown = ", ".join(self.missing[:8]) + (f" and {more} more" if more > 0 else "")
            out.append(f"{len(self.missing)} function(s) the bindings call are not in its libllama: {shown}")
        out += [f"{name} is {built} bytes in the build, {bound} bytes in the bindings"
                for name, (bound, built) in self.structs.items() if bound != built]
        return out

    def identity(self) -> dict:
        """The build as a store's numerics record it (qeval.engine.numerics.build_info)."""
        table = [[t.id, t.name, t.block_size, t.type_size] for t in self.types]
        from qeval.identity import digest  # noqa: PLC0415

        return {"llama_version": self.llama_version, "ggml_version": self.ggml_version,
                "ggml_commit": self.ggml_commit, "type_table": digest(table)[:16]}

    def to_json(self) -> dict:
        return {"version": REPORT_VERSION, "library": self.library, "llama_version": self.llama_version,
                "ggml_version": self.ggml_version, "ggml_commit": self.ggml_commit,
                "types": cache_types.table_json(self.types), "missing": self.missing, "structs": self.structs,
                "unchecked": self.unchecked}

    @classmethod
    def from_json(cls, d: dict) -> "BuildReport":
        return cls(d["library"], d["llama_version"], d["ggml_version"], d["ggml_commit"],
                   cache_types.table_from_json(d["types"]), d["missing"], d["structs"], d.get("unchecked", ""))


# -- the child's side ---------------------------------------------------------------------------------------------
def bindings_file() -> Path:
    """llama-cpp-python's llama_cpp/llama_cpp.py, found without importing it (the import binds the build)."""
    try:
        return package_folder() / "llama_cpp.py"
    except ImportError:
        raise QevalError("llama-cpp-python is not installed; see README 'Install'") from None


def bound_functions(source: str) -> list[str]:
    """The C functions a bindings module binds: the names of its `@ctypes_function("name", ...)` decorators."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for deco in node.decorator_list:
                if (isinstance(deco, ast.Call) and getattr(deco.func, "id", None) == "ctypes_function" and deco.args
                        and isinstance(deco.args[0], ast.Constant) and isinstance(deco.args[0].value, str)):
                    names.append(deco.args[0].value)
    return names


def written_size(function) -> int:
    """The bytes a C function returning a struct by value writes into its return slot (x86-64: the slot's address
    is its hidden first argument): the last byte that differs from the slot's fill under either of two fills."""
    function.restype, function.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    slots = []
    for fill in _FILLS:
        slot = (ctypes.c_ubyte * _SLOT_BYTES)(*([fill] * _SLOT_BYTES))
        function(ctypes.addressof(slot))
        slots.append(bytes(slot))
    return max((i + 1 for i in range(_SLOT_BYTES) if any(s[i] != f for s, f in zip(slots, _FILLS))), default=0)


def _struct_sizes(lib: ctypes.CDLL) -> dict:
    import llama_cpp  # noqa: PLC0415 - after every bound function was found: the import binds them

    out = {}
    for struct, function in DEFAULT_PARAMS.items():
        cls = getattr(llama_cpp, struct)
        align = ctypes.alignment(cls)
        built = -(-written_size(getattr(lib, function)) // align) * align  # trailing padding may go unwritten
        out[struct] = [ctypes.sizeof(cls), built]
    return out


def _text(lib: ctypes.CDLL, name: str) -> str:
    f = getattr(lib, name, None)
    if f is None:
        return "none"
    f.restype, f.argtypes = ctypes.c_char_p, []
    return (f() or b"").decode("utf-8", "replace")


def check_here() -> BuildReport:
    """The build check, in this process (the child's job; see the module's docstring)."""
    folder = loaded_folder()
    try:
        base = ctypes.CDLL(str(library_file(folder, "ggml-base")))
        cpu = ctypes.CDLL(str(library_file(folder, "ggml-cpu")))
        # the type table before libllama is loaded: once it is, ggml's GGUF reader no longer logs through
        # ggml_log_set's callback (measured), which is where the type count is read
        types = cache_types.read_type_table(base, cpu)
        lib = ctypes.CDLL(str(library_file(folder, "llama")), mode=ctypes.RTLD_GLOBAL)
    except (OSError, TypeError) as exc:
        raise QevalError(f"cannot load the llama.cpp build in {folder}: {exc}") from None
    missing = [name for name in dict.fromkeys(bound_functions(bindings_file().read_text())) if not hasattr(lib, name)]
    structs, unchecked = {}, ""
    if missing:
        unchecked = "struct sizes (the bindings cannot be imported)"
    elif platform.machine().lower() in ("x86_64", "amd64"):
        structs = _struct_sizes(lib)
    else:
        unchecked = f"struct sizes (checked on x86-64 only, this is {platform.machine()})"
    return BuildReport(library=str(folder), llama_version=_text(lib, "llama_version"),
                       ggml_version=_text(base, "ggml_version"), ggml_commit=_text(base, "ggml_commit"), types=types,
                       missing=missing, structs=structs, unchecked=unchecked)


def print_report() -> None:
    """The child's output: the report as one JSON line."""
    print(REPORT_PREFIX + json.dumps(check_here().to_json()), flush=True)


# -- the parent's side --------------------------------------------------------------------------------------------
def _report_file() -> Path:
    from qeval.engine import probe  # noqa: PLC0415
    from qeval.engine.modelinfo import cache_dir  # noqa: PLC0415

    return cache_dir() / "probe" / f"{probe.build_id()}.build.json"


def _cached_report() -> BuildReport | None:
    try:
        d = json.loads(_report_file().read_text())
        return BuildReport.from_json(d) if d.get("version") == REPORT_VERSION else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _from_child() -> BuildReport:
    from qeval.engine import probe  # noqa: PLC0415

    cached = _report_file()
    proc = probe.run_guarded(["build"], "the build check", timeout=300)
    line = next((line for line in proc.stdout.splitlines() if line.startswith(REPORT_PREFIX)), None)
    if proc.returncode != 0 or line is None:
        detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise QevalError(f"the llama.cpp build in {_library_text()} could not be checked: {detail}")
    report = BuildReport.from_json(json.loads(line[len(REPORT_PREFIX):]))
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(report.to_json()))
    except OSError:
        pass
    return report


def _library_text() -> str:
    return f"{loaded_folder()}" + (" (LLAMA_CPP_LIB_PATH)" if os.environ.get("LLAMA_CPP_LIB_PATH") else "")


@lru_cache(maxsize=4)
def _report(library: str) -> BuildReport:
    # a guarded child (the probe's, the build check's own) reads what its parent found, or checks here
    report = _cached_report() or (check_here() if os.environ.get("QEVAL_SKIP_PROBE") else _from_child())
    differs = report.differences()
    if differs:
        raise QevalError(f"the llama.cpp build in {library} does not match llama-cpp-python's bindings: "
                         f"{'; '.join(differs)}. Use a build of the llama.cpp commit llama-cpp-python "
                         "was written for (pip show llama-cpp-python), or unset LLAMA_CPP_LIB_PATH")
    return report


def build_report() -> BuildReport:
    """The loaded build's report, checked (an incompatible build refused), once per process and library."""
    return _report(_library_text())


def cache_type(name: str, flag: str = "-ctk/-ctv") -> cache_types.GgmlType:
    """The loaded build's KV cache type of that name (qeval.engine.cache_types); an unknown one refused with the
    build's cache types."""
    return cache_types.cache_type(name, flag, build_report().types)
