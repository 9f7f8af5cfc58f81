"""Build flags for the CPU at hand, and crashing llama.cpp builds caught in every path that runs one.

The crash tests use real child processes that die by each signal a bad build dies by; the flag
tests use /proc/cpuinfo lines of the two machine kinds this project has seen (AMD EPYC Zen 3
without AVX-512, Intel Sapphire Rapids with AVX-512 and AMX) and of this machine.
"""

from __future__ import annotations

import signal
import sys

import pytest
from conftest import assert_cli_error, run_cli

from qeval.engine import buildflags, probe
from qeval.errors import QevalError
from qeval.orchestrate import demo

ZEN3_FLAGS = ("fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 popcnt aes xsave avx f16c rdrand bmi1 avx2 bmi2 "
              "sha_ni vaes vpclmulqdq")
SAPPHIRE_RAPIDS_FLAGS = ("fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 avx512f avx512dq "
                         "avx512cd avx512bw avx512vl avx512ifma avx512vbmi avx512_vnni avx512_bf16 avx_vnni "
                         "amx_bf16 amx_tile amx_int8")


def options(flags: str, machine: str = "x86_64", gpu: str | None = None) -> dict[str, str]:
    cpuinfo = f"processor\t: 0\nvendor_id\t: X\nflags\t\t: {flags}\n"
    opts = buildflags.cmake_options(buildflags.cpu_flags(cpuinfo), machine, gpu)
    return dict(o.removeprefix("-D").split("=") for o in opts)


def test_amd_without_avx512_gets_avx2_and_no_avx512():
    opts = options(ZEN3_FLAGS)
    assert opts["GGML_NATIVE"] == "OFF"
    assert {opts[k] for k in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_SSE42")} == {"ON"}
    assert {opts[k] for k in opts if "AVX512" in k or "AMX" in k or k == "GGML_AVX_VNNI"} == {"OFF"}


def test_intel_with_avx512_gets_it_but_never_amx():
    opts = options(SAPPHIRE_RAPIDS_FLAGS)
    for option in ("GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX_VNNI"):
        assert opts[option] == "ON", option
    assert opts["GGML_AMX_TILE"] == opts["GGML_AMX_INT8"] == opts["GGML_AMX_BF16"] == "OFF"


def test_partial_avx512_is_not_enough():
    # GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw: a CPU with only avx512f must not get it
    assert options(ZEN3_FLAGS + " avx512f")["GGML_AVX512"] == "OFF"


def test_unknown_cpu_flags_give_the_safe_build_and_other_machines_keep_llama_defaults():
    assert {v for k, v in options("").items() if k != "GGML_NATIVE"} == {"OFF"}
    assert options(ZEN3_FLAGS, machine="aarch64") == {}
    assert options(ZEN3_FLAGS, gpu="cuda")["GGML_CUDA"] == "ON"
    with pytest.raises(ValueError, match="unknown GPU backend"):
        options(ZEN3_FLAGS, gpu="opencl")


def test_this_machines_command_matches_this_cpu():
    command = buildflags.reinstall_command()
    assert "--no-cache-dir" in command and "--force-reinstall" in command and buildflags.LLAMA_CPP_PYTHON in command
    if buildflags.is_x86_64():
        has_avx512 = "avx512bw" in buildflags.cpu_flags()
        assert f"-DGGML_AVX512={'ON' if has_avx512 else 'OFF'}" in command
        assert "-DGGML_AMX_INT8=OFF" in command


def test_missing_instructions_names_what_the_cpu_lacks():
    info = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 |"
    zen3 = set(ZEN3_FLAGS.split())
    assert probe.missing_instructions(info, zen3) == ["AVX512", "AVX512_VNNI"]
    assert probe.missing_instructions(info, set(SAPPHIRE_RAPIDS_FLAGS.split())) == []
    assert probe.missing_instructions(info.replace("AVX512 = 1", "AVX512 = 0"), zen3) == ["AVX512_VNNI"]


CRASH_SIGNALS = [signal.SIGILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGABRT]


@pytest.fixture
def crashing_child(monkeypatch, tmp_path):
    """Every guarded child prints a system-info line claiming AVX-512, then dies by `sig`."""
    monkeypatch.setattr(probe, "build_id", lambda: f"never-probed-{tmp_path.name}")  # no success marker
    monkeypatch.delenv("QEVAL_SKIP_PROBE", raising=False)

    def arm(sig: signal.Signals) -> None:
        code = (f"print({probe.SYSTEM_INFO_PREFIX!r} + 'CPU : AVX2 = 1 | AVX512 = 1 |', flush=True); "
                f"import os; os.kill(os.getpid(), {int(sig)})")
        monkeypatch.setattr(probe, "child_command", lambda args: [sys.executable, "-c", code])
    return arm


def assert_crash_message(message: str, sig: signal.Signals, what: str) -> None:
    assert sig.name in message and what in message
    assert buildflags.reinstall_command() in message  # the command for THIS cpu, cache bypassed
    if buildflags.is_x86_64() and "avx512bw" not in buildflags.cpu_flags():
        assert "compiled for AVX512, which this CPU does not have" in message


@pytest.mark.parametrize("sig", CRASH_SIGNALS, ids=lambda s: s.name)
def test_crash_before_capture_or_live_candidate_is_a_message(crashing_child, sig):
    crashing_child(sig)
    with pytest.raises(QevalError) as err:
        probe.ensure_llama_runs("model.gguf")
    assert_crash_message(str(err.value), sig, "the first decode")


@pytest.mark.parametrize("sig", CRASH_SIGNALS, ids=lambda s: s.name)
def test_crash_in_demo_quantization_is_a_message_and_leaves_no_file(crashing_child, sig, tmp_path):
    crashing_child(sig)
    src, dst = tmp_path / "src.gguf", tmp_path / "dst.gguf"
    src.write_bytes(b"GGUF")
    with pytest.raises(QevalError) as err:
        demo.quantize(src, dst, 7)
    assert_crash_message(str(err.value), sig, "quantization of src.gguf")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["src.gguf"]


def test_a_failing_quantization_is_a_message(monkeypatch, tmp_path):
    monkeypatch.setattr(probe, "child_command",
                        lambda args: [sys.executable, "-c", "import sys; sys.exit('llama_model_quantize returned 1')"])
    with pytest.raises(QevalError, match="could not quantize src.gguf to ftype 7: llama_model_quantize returned 1"):
        demo.quantize(tmp_path / "src.gguf", tmp_path / "dst.gguf", 7)


def test_sigill_before_the_system_info_still_says_why(monkeypatch, tmp_path):
    # a build for AVX-512 dies in llama.cpp's CPU feature report already (seen on AMD EPYC Zen 3)
    monkeypatch.setenv("QEVAL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("QEVAL_SKIP_PROBE", raising=False)
    monkeypatch.setattr(probe, "child_command", lambda args: [
        sys.executable, "-c", f"import os; os.kill(os.getpid(), {int(signal.SIGILL)})"])
    with pytest.raises(QevalError, match="instruction this CPU does not have"):
        probe.ensure_llama_runs("model.gguf")


def test_crash_reaches_the_cli_as_one_message(crashing_child, models, tmp_path):
    crashing_child(signal.SIGILL)
    proc = run_cli("capture", models["Q8_0"], "--label", "x", "-c", "32", "--chunks", "1",
                   "--runs-dir", tmp_path / "runs")
    assert_cli_error(proc, "SIGILL", "Rebuild it for this machine")
    assert not (tmp_path / "runs" / "x.qeval").exists()


def test_libraries_loaded_from_llama_cpp_lib_path_are_a_new_build(monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    packaged = probe.build_id()
    (tmp_path / "libggml-cpu.so").write_bytes(b"another build")
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))
    assert probe.build_id() != packaged  # so the probe runs again for them


def test_every_command_has_working_help():
    # typer renders help with rich markup: a bracket in a help text ([/CONFIG]) once crashed `--help`
    commands = ["capture", "kld", "ppl", "info", "matrix", "demo", "compare", "check", "leaderboard", "merge",
                "import-llamacpp", "baseline show", "baseline from-result"]
    for command in commands:
        proc = run_cli(*command.split(), "--help")
        assert proc.returncode == 0 and "Usage" in proc.stdout and "Traceback" not in proc.stderr, command


def test_help_shows_the_option_groups_as_panels():
    # each option group (qeval.cli.OptionGroup) is listed in a panel of its own, its brackets printed as written
    proc = run_cli("kld", "--help")
    assert proc.returncode == 0, proc.stderr
    for panel in ("Engine", "Deployment", "Output"):
        assert f"─ {panel} ─" in proc.stdout, panel
    assert "--cache-type-k" in proc.stdout and "--deploy" in proc.stdout and "--runs-dir" in proc.stdout
    proc = run_cli("capture", "--help")
    assert "─ Corpus and windows ─" in proc.stdout and "hf:DATASET[/CONFIG][:SPLIT][#COLUMN]" in proc.stdout
    proc = run_cli("recipe", "fit", "--help")
    for panel in ("Variants", "Sweep", "Search", "Early decisions", "Deployment", "Output"):
        assert f"─ {panel} ─" in proc.stdout, panel


def test_a_build_whose_libraries_carry_their_own_cxx_runtime_is_named_as_the_cause(monkeypatch, tmp_path):
    """Seen on an NVIDIA H200 machine: libllama linked with -static-libstdc++ (no libstdc++.so.6 needed) crashed in
    llama_model::print_info inside libggml-cuda's copy of the runtime; the message says so and how to run anyway."""
    from qeval.storage import llama_libraries  # noqa: PLC0415

    real = llama_libraries.library_path("llama")
    assert "libstdc++.so.6" in llama_libraries.needed_libraries(real) and not llama_libraries.private_cxx_runtime()
    # the same library, its needed C++ runtime renamed in its string table: it now loads none
    (tmp_path / "libllama.so").write_bytes(real.read_bytes().replace(b"libstdc++.so.6\0", b"libstdX++.so.6\0"))
    assert "libstdX++.so.6" in llama_libraries.needed_libraries(tmp_path / "libllama.so")
    assert llama_libraries.private_cxx_runtime(tmp_path)
    (tmp_path / "libllama.so").write_bytes(b"MZ not an ELF file")
    assert llama_libraries.needed_libraries(tmp_path / "libllama.so") is None
    assert not llama_libraries.private_cxx_runtime(tmp_path)

    monkeypatch.setattr(probe, "private_cxx_runtime", lambda: True)
    message = probe.crash_message(-int(signal.SIGSEGV), "", "the first decode")
    assert "own copy of the C++ runtime" in message and "LD_PRELOAD=libstdc++.so.6" in message
    assert buildflags.reinstall_command() in message
