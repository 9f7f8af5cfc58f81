"""The GPU kit's invariants (tools/gpu), checked without building or downloading anything."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from qeval.errors import QevalError

GPU_TOOLS = Path(__file__).resolve().parents[1] / "tools" / "gpu"
sys.path.insert(0, str(GPU_TOOLS))
import kit
import missing_wheels

V = kit.VENDOR
MiB = kit.MiB


@pytest.mark.parametrize("path", [
    "CMakeLists.txt", "pyproject.toml", "README.md", "llama_cpp/llama.py", "llama_cpp/lib/.gitkeep",
    f"{V}/CMakeLists.txt", f"{V}/cmake/build-info.cmake", f"{V}/include/llama.h", f"{V}/src/llama-model.cpp",
    f"{V}/src/models/qwen35moe.cpp",  # "models" is dropped at the top of llama.cpp only: these are the architectures
    f"{V}/common/CMakeLists.txt", f"{V}/vendor/nlohmann/json.hpp", f"{V}/vendor/CMakeLists.txt",
    f"{V}/ggml/CMakeLists.txt", f"{V}/ggml/src/CMakeLists.txt", f"{V}/ggml/src/ggml.c",
    f"{V}/ggml/src/ggml-cpu/CMakeLists.txt", f"{V}/ggml/src/ggml-cuda/CMakeLists.txt",
    f"{V}/ggml/src/ggml-cuda/template-instances/fattn-vec-instance-q4_0-q4_0.cu",
    f"{V}/tools/CMakeLists.txt", f"{V}/tools/perplexity/CMakeLists.txt", f"{V}/tools/perplexity/perplexity.cpp",
    f"{V}/tools/llama-bench/CMakeLists.txt", f"{V}/tools/llama-bench/llama-bench.cpp",
])
def test_trim_keeps_what_the_build_reads(path):
    assert kit.kept(path)


@pytest.mark.parametrize("path", [
    "tests/test_llama.py", "docs/index.md", "examples/high_level_api/x.py", "docker/Dockerfile", ".git/HEAD",
    "Makefile", f"{V}/models/ggml-vocab-llama-spm.gguf", f"{V}/tests/test-backend-ops.cpp", f"{V}/docs/build.md",
    f"{V}/docs/ops/CUDA.csv", f"{V}/examples/simple/simple.cpp", f"{V}/gguf-py/gguf/gguf.py", f"{V}/media/llama0.png",
    f"{V}/.github/workflows/build.yml", f"{V}/convert_hf_to_gguf.py", f"{V}/tools/server/server.cpp",
    f"{V}/tools/mtmd/clip.cpp", f"{V}/tools/quantize/quantize.cpp", f"{V}/ggml/src/ggml-vulkan/CMakeLists.txt",
    f"{V}/ggml/src/ggml-metal/ggml-metal.m", f"{V}/ggml/src/ggml-sycl/CMakeLists.txt",
])
def test_trim_drops_models_tests_docs_and_other_backends(path):
    assert not kit.kept(path)


def test_trimmed_tools_cmakelists_adds_exactly_the_kept_tools():
    text = kit.rewrite(f"{V}/tools/CMakeLists.txt", "add_subdirectory(server)\nadd_subdirectory(mtmd)\n")
    added = [line[len("add_subdirectory("):-1] for line in text.splitlines() if line.startswith("add_subdirectory(")]
    assert added == ["llama-bench", "perplexity"]
    assert all(kit.kept(f"{V}/tools/{tool}/CMakeLists.txt") for tool in added)


def test_trimmed_top_cmakelists_builds_no_mtmd_by_default():
    original = f"project(llama_cpp)\n{kit.LLAVA_DEFAULT_ON}\n"
    assert kit.LLAVA_DEFAULT_OFF in kit.rewrite("CMakeLists.txt", original)
    assert not kit.kept(f"{V}/tools/mtmd/CMakeLists.txt")  # what LLAVA_BUILD=ON would add
    with pytest.raises(QevalError, match="LLAVA_BUILD"):
        kit.rewrite("CMakeLists.txt", "project(llama_cpp)\n")  # another version: refused, not silently kept


def test_a_piece_over_the_call_budget_is_refused():
    tree = 6 * MiB
    budget = kit.piece_budget(tree)
    assert budget == kit.CALL_LIMIT_BYTES - kit.MARGIN_BYTES - tree
    kit.check_pieces([kit.Piece("src", budget)], tree)
    with pytest.raises(QevalError, match="models-big"):
        kit.check_pieces([kit.Piece("src", 3 * MiB), kit.Piece("models-big", budget + 1)], tree)


def test_every_call_carries_the_build_inputs_and_stays_within_budget():
    tree = 6 * MiB
    base = [kit.Piece("src", 4 * MiB), kit.Piece("wheels", 7 * MiB)]
    models = [kit.Piece("models-a", 40 * MiB), kit.Piece("models-b", 30 * MiB), kit.Piece("models-c", 5 * MiB)]
    calls = kit.plan_calls(base, models, tree)
    assert [[p.name for p in call] for call in calls] == [
        ["src", "wheels", "models-a"], ["src", "wheels", "models-b", "models-c"]]
    assert all(sum(p.bytes for p in call) <= kit.piece_budget(tree) for call in calls)
    with pytest.raises(QevalError, match="models-a"):  # fits the budget alone, not beside the source and wheels
        kit.plan_calls(base, [kit.Piece("models-a", kit.piece_budget(tree) - 5 * MiB)], tree)


def test_run_script_builds_one_cuda_architecture_without_every_fa_quant():
    script = (GPU_TOOLS / "run.sh").read_text()
    assert "-DCMAKE_CUDA_ARCHITECTURES=$arch" in script and "arch=90" in script
    assert "-DGGML_CUDA_FA_ALL_QUANTS=OFF" in script
    assert "--no-index" in script and "-DLLAVA_BUILD=OFF" in script


def test_a_wheel_is_installed_only_where_its_requirement_is_unmet(tmp_path):
    (tmp_path / "requirements.json").write_text(
        '{"pytest-0-py3-none-any.whl": "pytest>=1", "pytest-999-py3-none-any.whl": "pytest>=999", '
        '"nothere-1-py3-none-any.whl": "surely-not-installed-dist"}')
    assert [p.name for p in missing_wheels.missing(tmp_path)] == [
        "pytest-999-py3-none-any.whl", "nothere-1-py3-none-any.whl"]


def test_a_pair_travels_as_its_compressed_reference_and_the_device_derives_the_candidate(tmp_path, gemma_tokenizer,
                                                                                         monkeypatch):
    """Both pairs fit one call only as compressed references (a second call may find the machine bare and rebuild):
    unpacking gives the reference byte for byte and a Q4_0 candidate from llama.cpp's own quantizer."""
    import checks  # noqa: PLC0415 - imports qeval's demo and the bench helpers
    import gguf  # noqa: PLC0415
    import models  # noqa: PLC0415

    monkeypatch.setattr(models, "gemma_tokenizer", lambda: gemma_tokenizer)
    spec = models.ModelSpec("dense-512", 512, models.build_dense)
    folder = models.build_pair(spec, tmp_path / "kit" / "models-dense-512", tmp_path / "cache")
    assert [p.name for p in folder.iterdir()] == [models.PACKED_REFERENCE] == [checks.PACKED_REFERENCE]
    pair = checks.unpack_pair(folder, tmp_path / "out" / folder.name)
    assert [p.name for p in folder.iterdir()] == [models.PACKED_REFERENCE]  # the kit is left as it was carried
    assert (pair / "reference.gguf").read_bytes() == (tmp_path / "cache" / "dense-512-Q8_0.gguf").read_bytes()
    file_type = gguf.GGUFReader(pair / "candidate.gguf").get_field("general.file_type").contents()
    assert file_type == gguf.LlamaFileType.MOSTLY_Q4_0
    assert checks.unpack_pair(folder, pair) == pair  # again: nothing to do
    assert checks.unpack_pair(tmp_path / "kit" / "models-none", tmp_path / "none") is None
