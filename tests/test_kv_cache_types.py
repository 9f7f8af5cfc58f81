"""Issue 43, items 1-3: the KV-cache types of the loaded build from its own ggml type table, the types llama.cpp
allocated verified from its log, and a build of the user's own checked against the bindings in a child."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from qeval.engine import build_check, cache_types, memory
from qeval.engine.engine import Engine, EngineSettings
from qeval.errors import QevalError
from qeval.orchestrate import matrix
from qeval.storage.llama_libraries import library_file, loaded_folder

# llama.cpp's own log lines (llama-cpp-python 0.3.36's build, Gemma-3-270M Q8_0, n_ctx 64), as the engine records
# them while it creates a context: -ctk q8_0 -ctv q4_0 -fa on, then -fa auto with an f16 cache, then -fa off.
ASYMMETRIC_LOG = [
    "llama_context: flash_attn            = enabled\n",
    "llama_kv_cache: size =    0.61 MiB (   256 cells,   3 layers,  2/2 seqs), K (q8_0):    0.40 MiB, "
    "V (q4_0):    0.21 MiB\n",
    "llama_kv_cache: attn_rot_k = 1, n_embd_head_k_all = 256\n",
    "llama_kv_cache: attn_rot_v = 1, n_embd_head_k_all = 256\n",
    "llama_kv_cache: size =    3.05 MiB (   256 cells,  15 layers,  2/2 seqs), K (q8_0):    1.99 MiB, "
    "V (q4_0):    1.05 MiB\n",
]
AUTO_LOG = [
    "llama_context: flash_attn            = auto\n",
    "llama_kv_cache: size =    7.50 MiB (   256 cells,  15 layers,  2/2 seqs), K (f16):    3.75 MiB, "
    "V (f16):    3.75 MiB\n",
    "resolve_fused_ops: Flash Attention enabled\n",
]
OFF_LOG = [
    "llama_context: flash_attn            = disabled\n",
    "llama_kv_cache: size =    4.80 MiB (   256 cells,  15 layers,  2/2 seqs), K (q4_K):    1.05 MiB, "
    "V (f16):    3.75 MiB\n",
]


def _table() -> list[cache_types.GgmlType]:
    return build_check.build_report().types


def test_the_type_table_is_the_builds_own():
    """Read through ggml's own calls: ids, names and block sizes as ggml.h has them, removed slots left out, and the
    count the build's installed header names, where it has one."""
    table = _table()
    by_name = {t.name: t for t in table}
    assert (by_name["q8_0"].block_size, by_name["q8_0"].type_size) == (32, 34)
    assert (by_name["f16"].block_size, by_name["f16"].type_size, by_name["f16"].quantized) == (1, 2, False)
    assert by_name["q4_0"].row_bytes(256) == 8 * 18
    assert not {4, 5, 31, 32, 33} & {t.id for t in table}  # removed types
    header = loaded_folder().parent.parent / "include" / "ggml.h"
    if header.is_file():
        count = int(re.search(r"GGML_TYPE_COUNT\s*=\s*(\d+)", header.read_text()).group(1))
        assert max(t.id for t in table) == count - 1
        declared = dict(re.findall(r"^\s*GGML_TYPE_(\w+)\s*=\s*(\d+),", header.read_text(), re.M))
        assert all(int(declared[t.name.upper()]) == t.id for t in table)
    # the nine types qeval had fixed, and more: whatever the build's CPU backend can write and read back
    kv = set(cache_types.cache_types(table))
    assert {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"} < kv
    assert not {"i32", "q8_K", "iq2_xxs"} & kv  # no from_float or no vec_dot
    assert cache_types.table_from_json(cache_types.table_json(table)) == table


def test_a_forks_types_by_its_own_ids_and_an_unknown_name_listed():
    fork = [cache_types.GgmlType(0, "f32", 1, 4, False, True), cache_types.GgmlType(1, "f16", 1, 2, False, True),
            cache_types.GgmlType(105, "turbo3", 32, 14, True, True)]
    assert cache_types.cache_type("turbo3", "-ctk", fork).id == 105
    with pytest.raises(QevalError, match=r"unknown KV cache type 'q8_0' for -ctv: this llama.cpp build's cache "
                                         r"types are f32, f16, turbo3$"):
        cache_types.cache_type("q8_0", "-ctv", fork)
    with pytest.raises(QevalError, match="unknown KV cache type 'turbo3' for -ctk: this llama.cpp build's cache "
                                         "types are f32, f16, q4_0"):
        EngineSettings(type_k="turbo3", type_v="f16").validate()


def test_asymmetric_kv_is_a_matrix_axis_labelled_with_both_types(tmp_path):
    pairs = tuple((matrix.pair_label("Q", k), "q.gguf", k) for k in ("q8_0/q4_0", "q4_0", "q4_0/q8_0:norot"))
    plan = matrix.plan_matrix(matrix.MatrixRequest(ref_label="R", ref_path="r.gguf", pairs=pairs,
                                                   directory=tmp_path, chunks=2, n_ctx=64, floor="none"))
    assert [p.label for p in plan.pairs] == ["Q+kv-q8_0-q4_0", "Q+kv-q4_0", "Q+kv-q4_0-q8_0-norot"]
    assert [(p.settings.type_k, p.settings.type_v, p.settings.flash_attn, p.settings.kv_rotation)
            for p in plan.pairs] == [("q8_0", "q4_0", "on", "auto"), ("q4_0", "q4_0", "on", "auto"),
                                     ("q4_0", "q8_0", "on", "off")]
    assert matrix.pair_settings("q8_0/f16").flash_attn == "on"  # a quantized K alone is a quantized cache
    for bad, message in (("q8_0/turbo3", "unknown KV cache type 'turbo3' for --kv"),
                         ("q8_0/", "K and V types apart are written K/V")):
        with pytest.raises(QevalError, match=message):
            matrix.model_kv_pairs(["Q=q.gguf"], [bad], "r.gguf")


def test_the_cache_llama_cpp_allocated_is_read_from_its_log():
    assert memory.allocated_cache(ASYMMETRIC_LOG) == {"types": [("q8_0", "q4_0")] * 2, "flash_attn": True}
    assert memory.allocated_cache(AUTO_LOG) == {"types": [("f16", "f16")], "flash_attn": True}
    assert memory.allocated_cache(OFF_LOG) == {"types": [("q4_K", "f16")], "flash_attn": False}
    assert memory.allocated_cache(AUTO_LOG[:2]) == {"types": [("f16", "f16")], "flash_attn": None}  # unresolved
    unsupported = AUTO_LOG[:2] + ["resolve_fused_ops: Flash Attention not supported, set to disabled\n"]
    assert memory.allocated_cache(unsupported)["flash_attn"] is False


def test_what_llama_cpp_did_not_allocate_is_refused():
    allocated = memory.allocated_cache(ASYMMETRIC_LOG)
    rotation = {"k": True, "v": True}
    assert cache_types.verified_cache(allocated, "q8_0", "q4_0", "on", True, "m.gguf", rotation, "auto") == \
        {"type_k": "q8_0", "type_v": "q4_0", "flash_attn": True}
    with pytest.raises(QevalError, match=r"llama.cpp allocated a KV cache of K q8_0, V q4_0 for m.gguf, not the "
                                         r"-ctk q4_0 -ctv q4_0 -fa on asked for: it fell back or ignored the type"):
        cache_types.verified_cache(allocated, "q4_0", "q4_0", "on", True, "m.gguf")
    fell_back = memory.allocated_cache([ASYMMETRIC_LOG[0], AUTO_LOG[1]])  # a fork that quietly keeps f16
    with pytest.raises(QevalError, match="allocated a KV cache of K f16, V f16 for m.gguf, not the -ctk turbo3"):
        cache_types.verified_cache(fell_back, "turbo3", "turbo3", "on", True, "m.gguf")
    with pytest.raises(QevalError, match="ran m.gguf with flash attention off, not the -fa on asked for"):
        cache_types.verified_cache(memory.allocated_cache(OFF_LOG), "q4_K", "f16", "on", True, "m.gguf")
    with pytest.raises(QevalError, match="log did not say which KV cache types it allocated"):
        cache_types.verified_cache(memory.allocated_cache([]), "q8_0", "q8_0", "on", True, "m.gguf")
    assert cache_types.verified_cache(memory.allocated_cache([]), "f16", "f16", "auto", False, "m.gguf")  # no cache
    with pytest.raises(QevalError, match="llama.cpp rotated the K/V cache of m.gguf, not the --kv-rotation off"):
        cache_types.verified_cache(allocated, "q8_0", "q4_0", "on", True, "m.gguf", rotation, "off")


def test_the_functions_the_bindings_bind_are_read_from_their_source():
    source = ('@ctypes_function("llama_a", [], None)\ndef llama_a(): ...\n\n'
              '@ctypes_function(\n    "llama_b",\n    [ctypes.c_int],\n    None,\n)\ndef llama_b(x): ...\n'
              '@other("llama_c")\ndef llama_c(): ...\n')
    assert build_check.bound_functions(source) == ["llama_a", "llama_b"]
    assert len(build_check.bound_functions(build_check.bindings_file().read_text())) > 200


def test_the_loaded_build_matches_its_bindings_and_is_recorded():
    report = build_check.build_report()
    assert report.differences() == [] and report.missing == []
    if report.structs:  # x86-64: the sizes the build writes, as the bindings declare them
        assert report.structs["llama_context_params"][0] == report.structs["llama_context_params"][1] > 100
    identity = report.identity()
    assert identity["llama_version"] and identity["ggml_commit"] and len(identity["type_table"]) == 16
    from qeval.engine import numerics  # noqa: PLC0415

    import llama_cpp  # noqa: PLC0415

    assert numerics.build_info(llama_cpp).items() >= identity.items()


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the fake build")
def test_an_incompatible_build_is_refused_naming_what_differs(tmp_path, monkeypatch):
    """A folder whose libllama lacks nearly every function the bindings call (and whose ggml is the real one)."""
    (tmp_path / "llama.c").write_text("const char * llama_version(void) { return \"fake\"; }\n"
                                      "void llama_backend_init(void) {}\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library_file(tmp_path, "llama")), str(tmp_path / "llama.c")],
                   check=True)
    for name in ("ggml-base", "ggml-cpu", "ggml"):
        real = library_file(loaded_folder(), name)
        if real.exists():
            (library_file(tmp_path, name)).symlink_to(real)
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))
    monkeypatch.setenv("QEVAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("QEVAL_SKIP_PROBE", raising=False)
    build_check._report.cache_clear()
    try:
        with pytest.raises(QevalError, match=rf"the llama.cpp build in {tmp_path} \(LLAMA_CPP_LIB_PATH\) does not "
                                             r"match llama-cpp-python's bindings: \d+ function\(s\) the bindings call "
                                             r"are not in its libllama: llama_\w+, .* and \d+ more. Use a build"):
            EngineSettings(type_k="q8_0", type_v="q8_0", flash_attn="on").validate()
    finally:
        build_check._report.cache_clear()


def test_a_run_records_the_cache_llama_cpp_allocated(models):
    """-ctk q8_0 -ctv q4_0 -fa on on Gemma-3-270M: what llama.cpp allocated, read from its log, verified and
    recorded in the engine's provenance (a store's capture block) and its KV block."""
    settings = EngineSettings(type_k="q8_0", type_v="q4_0", flash_attn="on", n_threads=2)
    with Engine(models["Q8_0"], 64, settings) as engine:
        assert engine.allocated == {"type_k": "q8_0", "type_v": "q4_0", "flash_attn": True}
        assert engine.provenance["kv_allocated"] == engine.allocated
        assert memory.allocated_cache(engine.context_log)["types"] == [("q8_0", "q4_0")] * 2  # SWA and full caches
        kv = engine.settings.kv_block(engine.kv_rotation)
        assert (kv["type_k"], kv["type_v"], kv["rotation"]) == ("q8_0", "q4_0", {"k": True, "v": True})
        assert engine.numerics["build"]["type_table"] == build_check.build_report().identity()["type_table"]
