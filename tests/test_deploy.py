"""Speed and memory as deployed (qeval.engine.deploy, qeval.engine.memory, qeval.orchestrate.deploy, the records of
qeval.storage.deployment): the spec, the formula against llama.cpp's own figures, the log parser, the reuse rules
(another machine, other settings, another model: measured again, never reused), and real llama.cpp runs on
Gemma-3-270M and the tiny qwen35moe, including a context that cannot be allocated under an address-space limit in a
child. No timing is asserted: only that the figures exist and are consistent."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import gguf
import pytest
import tinymodels
from conftest import assert_cli_error, run_cli

from qeval import api
from qeval.engine import deploy as engine_deploy
from qeval.engine import machine as machines
from qeval.engine import memory
from qeval.engine.deploy import DeployModel, SpeedTest
from qeval.engine.engine import ContextFailed, EngineSettings
from qeval.errors import QevalError, StoreFormatError
from qeval.orchestrate import deploy
from qeval.storage import deployment

MIB = 1 << 20
# llama.cpp prints each buffer in MiB to two decimals; a figure summed over n buffers is within n half-hundredths
ROUNDING = memory.LOG_PRECISION_BYTES


# -- the spec ------------------------------------------------------------------------------------------------------
def test_spec_defaults_are_llama_benchs():
    spec = deploy.parse_deploy_spec("")
    assert (spec.contexts, spec.depths, spec.pp, spec.tg, spec.reps, spec.n_batch, spec.n_ubatch) == \
        ((4096,), (0,), (512,), (128,), 5, 2048, 512)
    assert [(t.test, t.tokens, t.depth) for t in spec.tests] == [("pp", 512, 0), ("tg", 128, 0)]


def test_spec_parses_lists_and_round_trips():
    spec = deploy.parse_deploy_spec("ctx=32768,4096; depth=4096,0;pp=512;tg=128;reps=3;b=1024;ub=256;ncmoe=2;rss=1")
    assert spec == deploy.DeploySpec(contexts=(4096, 32768), depths=(0, 4096), pp=(512,), tg=(128,), reps=3,
                                     n_batch=1024, n_ubatch=256, n_cpu_moe=2, rss=True)
    assert [t.n_ctx for t in spec.tests] == [512, 128, 4608, 4224]  # llama-bench's n_prompt + n_gen + n_depth
    assert deploy.parse_deploy_spec(spec.text()) == spec
    none = deploy.parse_deploy_spec("ctx=0;pp=0;tg=64")
    assert none.contexts == () and none.pp == () and [t.test for t in none.tests] == ["tg"]


@pytest.mark.parametrize("text, fragment", [
    ("ctx=4096;foo=1", "'foo=1' is not KEY=VALUE"),
    ("ctx=4k", "whole numbers"),
    ("reps=0", "reps must be at least 1"),
    ("depth=-1", "depth must be >= 0"),
    ("reps=2,3", "reps takes one number"),
    ("rss=2", "rss is 0 or 1"),
    ("ctx=1;ctx=2", "ctx is given twice"),
    ("ctx=0;pp=0;tg=0", "nothing to measure"),
])
def test_spec_refuses_bad_input(text, fragment):
    with pytest.raises(QevalError, match=fragment):
        deploy.parse_deploy_spec(text)


@pytest.fixture
def no_proc(monkeypatch):
    """A platform without /proc (macOS, Windows): opening /proc/self/status fails as it does there."""
    def refuse(path, *args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(engine_deploy, "open", refuse, raising=False)


def test_the_resident_set_is_read_from_proc_where_there_is_one():
    with open("/proc/self/status", encoding="ascii") as fh:
        kib = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
    assert abs(engine_deploy.resident_bytes() - kib * 1024) < 64 << 20


def test_without_proc_the_resident_set_is_psutils(no_proc, monkeypatch):
    info = types.SimpleNamespace(rss=123 << 20)
    fake = types.SimpleNamespace(Process=lambda: types.SimpleNamespace(memory_info=lambda: info))
    monkeypatch.setitem(sys.modules, "psutil", fake)
    assert engine_deploy.resident_bytes() == 123 << 20


def test_without_proc_or_psutil_rss_is_refused_before_any_work(no_proc, monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # not installed: its import fails
    with pytest.raises(QevalError, match="resident set is unavailable on this platform.*pip install psutil"):
        engine_deploy.resident_bytes()
    with pytest.raises(QevalError, match="resident set is unavailable"):
        deploy.plan_rows([], deploy.parse_deploy_spec("rss=1"))
    deploy.plan_rows([], deploy.parse_deploy_spec("rss=0"))  # no RSS asked: nothing to refuse


def test_spec_beyond_the_trained_context_is_refused():
    facts = {"file_name": "m.gguf", "context_length": 8192}
    spec = deploy.parse_deploy_spec("ctx=4096;depth=0,8000;pp=512;tg=0")
    with pytest.raises(QevalError, match=r"pp=512 at depth=8000 \(a context of 8512\) is beyond m.gguf's trained "
                                         r"context of 8192 tokens.*--rope-scaling"):
        deploy.check_spec(spec, facts, EngineSettings())
    with pytest.raises(QevalError, match="ctx=16384 is beyond"):
        deploy.check_spec(deploy.parse_deploy_spec("ctx=16384;pp=0;tg=0"), facts, EngineSettings())
    deploy.check_spec(spec, facts, EngineSettings(rope_scaling="yarn"))  # opted in: measured


# -- the formula, against the figures llama.cpp logged ----------------------------------------------------------
def metadata_gguf(path: Path, arch: str, keys: dict) -> Path:
    """A GGUF of metadata alone: what the formula reads."""
    w = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        if isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        else:
            (w.add_uint32 if isinstance(value, int) else w.add_float32)(f"{arch}.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


GEMMA3_270M = {"block_count": 18, "embedding_length": 640, "attention.head_count": 4, "attention.head_count_kv": 1,
               "attention.key_length": 256, "attention.value_length": 256, "attention.sliding_window": 512,
               "context_length": 32768}
QWEN35MOE_TINY = {"block_count": 4, "embedding_length": 64, "attention.head_count": 2, "attention.head_count_kv": 1,
                  "attention.key_length": 32, "attention.value_length": 32, "full_attention_interval": 4,
                  "ssm.conv_kernel": 4, "ssm.state_size": 16, "ssm.group_count": 2, "ssm.time_step_rank": 2,
                  "ssm.inner_size": 32, "context_length": 4096}


@pytest.fixture
def geometry(tmp_path, monkeypatch):
    monkeypatch.setenv("QEVAL_CACHE_DIR", str(tmp_path / "cache"))

    def read(arch: str, keys: dict) -> dict:
        return memory.memory_geometry(metadata_gguf(tmp_path / f"{arch}.gguf", arch, keys))
    return read


@pytest.mark.parametrize("types, n_ctx, logged_mib", [
    # llama.cpp's log for Gemma-3-270M (vendored llama.cpp, -ub 512, swa_full off): its two KV caches' lines
    (("f16", "f16"), 32768, (96.00, 15.00)),
    (("q8_0", "q8_0"), 32768, (51.00, 7.97)),
    (("f16", "f16"), 4096, (12.00, 15.00)),
    (("q4_0", "q4_0"), 4096, (3.38, 4.22)),
])
def test_formula_matches_llamacpps_kv_buffers_for_gemma3(geometry, types, n_ctx, logged_mib):
    g = geometry("gemma3", GEMMA3_270M)
    assert [i for i, layer in enumerate(g["attention"]) if not layer["sliding"]] == [5, 11, 17]  # as llama.cpp logs
    kv = memory.formula_bytes(g, n_ctx, *types, n_ubatch=512)
    assert kv["recurrent"] == 0
    assert abs(kv["kv"] - round(sum(logged_mib) * MIB)) <= 2 * ROUNDING
    assert memory.cache_cells(g, n_ctx, 512) == (n_ctx, 1024)  # the SWA cache: n_swa + n_ubatch, padded to 256


def test_formula_counts_the_recurrent_state_of_a_gated_deltanet_hybrid(geometry):
    g = geometry("qwen35moe", QWEN35MOE_TINY)
    assert g["recurrent_layers"] == 3 and len(g["attention"]) == 1
    at = {n: memory.formula_bytes(g, n, "f16", "f16", 512) for n in (1024, 4096)}
    # conv rows (d_conv - 1) x (d_inner + 2 n_group d_state) and state rows d_state x d_inner, f32, per layer
    assert at[1024]["recurrent"] == at[4096]["recurrent"] == 3 * (3 * (32 + 2 * 2 * 16) + 16 * 32) * 4
    assert at[4096]["kv"] == 4 * at[1024]["kv"] == 4 * 1024 * 2 * 32 * 2  # llama.cpp logged 0.50 MiB at 4096


def test_formula_says_none_where_it_does_not_model_the_cache(geometry):
    g = geometry("gemma3n", {**GEMMA3_270M})
    assert memory.formula_bytes(g, 4096, "f16", "f16", 512) == {"kv": None, "recurrent": None}
    unknown = geometry("olmo", {**GEMMA3_270M})  # a sliding window, and no pattern known for the architecture
    assert "neither its GGUF nor the formula" in unknown["modelled"]


# -- llama.cpp's log ---------------------------------------------------------------------------------------------
LOG = """load_tensors:   CPU_Mapped model buffer size =   271.81 MiB
llama_context:        CPU  output buffer size =     1.00 MiB
llama_kv_cache_iswa: creating non-SWA KV cache, size = 32768 cells
llama_kv_cache:        CPU KV buffer size =    51.00 MiB
llama_kv_cache: size =   51.00 MiB ( 32768 cells,   3 layers,  1/1 seqs), K (q8_0):   25.50 MiB, V (q8_0):   25.50 MiB
llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells
llama_kv_cache:        CPU KV buffer size =     7.97 MiB
llama_kv_cache: size =    7.97 MiB (  1024 cells,  15 layers,  1/1 seqs), K (q8_0):    3.98 MiB, V (q8_0):    3.98 MiB
sched_reserve:        CPU compute buffer size =   514.50 MiB
"""
CUDA_LOG = """load_tensors:        CUDA0 model buffer size =  1021.11 MiB
load_tensors:   CPU_Mapped model buffer size =   170.00 MiB
llama_context:  CUDA_Host  output buffer size =     1.00 MiB
llama_kv_cache:      CUDA0 KV buffer size =    96.00 MiB
llama_memory_recurrent:      CUDA0 RS buffer size =    75.38 MiB
sched_reserve:      CUDA0 compute buffer size =   493.00 MiB
sched_reserve:  CUDA_Host compute buffer size =    12.01 MiB
"""


def test_buffer_sizes_per_device_and_component():
    lines = LOG.splitlines(keepends=True)
    assert memory.buffer_sizes(lines) == {"CPU_Mapped": {"model": round(271.81 * MIB)},
                                          "CPU": {"kv": round(51.00 * MIB) + round(7.97 * MIB),
                                                  "compute": round(514.50 * MIB), "output": MIB}}
    cuda = memory.buffer_sizes(CUDA_LOG.splitlines(keepends=True))
    assert cuda["CUDA0"] == {"model": round(1021.11 * MIB), "kv": 96 * MIB, "recurrent": round(75.38 * MIB),
                             "compute": 493 * MIB}
    assert cuda["CUDA_Host"] == {"compute": round(12.01 * MIB), "output": MIB}
    assert memory.cache_layout(lines) == ("full-attention KV cache of 32768 cells x 3 layers; sliding-window KV cache "
                                          "of 1024 cells x 15 layers; 1 sequence(s), swa_full off (llama.cpp tools' "
                                          "default)")


def test_failed_allocation_names_the_size_llamacpp_asked_for():
    cpu = ["ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 539494400\n",
           "llama_init_from_model: failed to initialize the context: failed to allocate compute pp buffers\n"]
    assert memory.failed_allocation(cpu) == (539494400, "failed to allocate compute pp buffers")
    cuda = ["ggml_backend_cuda_buffer_type_alloc_buffer: allocating 8192.00 MiB on device 0: cudaMalloc failed: "
            "out of memory\n"]
    assert memory.failed_allocation(cuda) == (8192 * MIB, None)
    assert memory.failed_allocation(["nothing\n"]) == (None, None)


# -- the machine ---------------------------------------------------------------------------------------------------
def test_machine_backend_gpus_and_id():
    assert machines.build_backend("CPU : SSE3 = 1 | AVX2 = 1 | OPENMP = 1 |") == "CPU"
    assert machines.build_backend("CUDA : ARCHS = 900 | USE_GRAPHS = 1 | CPU : SSE3 = 1 | AVX2 = 1 |") == "CUDA"
    gpu = machines.parse_gpu_line("NVIDIA H100 80GB HBM3, 580.65.06, 81559")
    assert gpu == {"name": "NVIDIA H100 80GB HBM3", "driver": "580.65.06", "memory_bytes": 81559 << 20}
    a = {"cpu": "X", "cpu_flags": ["avx2"], "cores": 2, "gpus": [gpu], "backend": "CUDA", "llama_cpp": {}}
    b = {**a, "gpus": [{**gpu, "driver": "590.1"}]}
    assert deployment.machine_id(a) != deployment.machine_id(b)  # another driver: another machine
    assert deployment.machine_id({**a, "id": "ignored"}) == deployment.machine_id(a)
    assert machines.nvidia_gpus("/nonexistent/nvidia-smi") == []


# -- records and their reuse ---------------------------------------------------------------------------------------
def machine_block(cpu: str = "CPU A") -> dict:
    fields = {"cpu": cpu, "cpu_flags": ["avx2"], "cores": 2, "gpus": [], "backend": "CPU",
              "llama_cpp": {"version": "0.3.36", "system_info": "CPU : AVX2 = 1"}}
    return {"id": deployment.machine_id(fields), **fields}


class FakeModel:
    """Stands in for DeployModel in the reuse tests: says what it was asked to measure; contexts in FAIL cannot be
    allocated."""

    asked: list = []
    FAIL = {65536}

    def __init__(self, path, settings, n_cpu_moe=0):
        self.n_ubatch, self.kv_rotation = 512, {"k": False, "v": False}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def measure_memory(self, n_ctx):
        FakeModel.asked.append(("memory", n_ctx))
        if n_ctx in self.FAIL:
            raise ContextFailed("no", asked=3 * MIB, what="failed to allocate buffer for kv cache")
        return {"CPU": {"kv": n_ctx * 10, "compute": 100}}, "one sequence"

    def measure_speed(self, test: SpeedTest, reps: int):
        FakeModel.asked.append((test.test, test.tokens, test.depth))
        return [100.0 + i for i in range(reps)]


@pytest.fixture
def fake(monkeypatch):
    state = {"machine": machine_block(), "fingerprint": "f" * 64}
    FakeModel.asked = []
    monkeypatch.setattr(deploy, "DeployModel", FakeModel)
    monkeypatch.setattr(deploy, "current_machine", lambda: state["machine"])
    monkeypatch.setattr(deploy, "model_facts", lambda path: {"fingerprint": state["fingerprint"], "file_name": "m.gguf",
                                                             "file_size": 123, "context_length": 1 << 20})
    monkeypatch.setattr(deploy.memory, "memory_geometry", lambda path: {"modelled": "not here"})
    return state


def measure(tmp_path, spec: str = "ctx=4096,32768;depth=0,4096;pp=512;tg=128;reps=3", threads: int = 2,
            force: bool = False) -> deploy.DeployRun:
    row = deploy.DeployRow("Q4_K_M", "m.gguf", EngineSettings(n_threads=threads))
    return deploy.measure_rows([row], deploy.parse_deploy_spec(spec), tmp_path, force)


def test_a_record_is_saved_per_machine_and_reused_only_there(tmp_path, fake):
    first = measure(tmp_path)
    assert len(FakeModel.asked) == 2 + 4
    record = first.records[0]
    path = deployment.record_path(tmp_path, "Q4_K_M", record.machine_id)
    assert path.name == f"Q4_K_M.{record.machine_id[:12]}.json" and path.parent.name == "deployment"
    assert deployment.load_records(tmp_path) == [record]
    fig = record.speed_of("tg", 128, 4096, 3)
    assert fig.tokens_per_s == {"median": 101.0, "min": 100.0, "max": 102.0, "values": [100.0, 101.0, 102.0]}
    assert fig.spread == pytest.approx(2 / 101)
    assert record.settings == {"threads": 2, "n_gpu_layers": 0, "n_batch": 2048, "n_ubatch": 512,
                               "flash_attn": "auto", "offload": None}

    FakeModel.asked = []
    again = measure(tmp_path)
    assert FakeModel.asked == [] and again.records[0].memory == record.memory
    assert "reused" in again.lines[0]

    fake["machine"] = machine_block("CPU B")  # another machine: its own figures, the first machine's left alone
    other = measure(tmp_path)
    assert len(FakeModel.asked) == 6
    assert len(deployment.load_records(tmp_path)) == 2
    assert deployment.load_record(path) == record
    assert other.records[0].machine_id != record.machine_id


@pytest.mark.parametrize("change, note", [
    (lambda state: None, "settings"),  # threads 3 instead of 2 (below)
    (lambda state: state.update(fingerprint="e" * 64), "model"),
])
def test_other_settings_or_another_model_are_measured_again(tmp_path, fake, change, note):
    measure(tmp_path)
    FakeModel.asked = []
    change(fake)
    run = measure(tmp_path, threads=3 if note == "settings" else 2)
    assert len(FakeModel.asked) == 6
    assert f"holds another {note}" in run.lines[0]


def test_only_missing_or_failed_figures_are_measured(tmp_path, fake):
    measure(tmp_path, "ctx=4096;pp=512;tg=0;reps=3")
    FakeModel.asked = []
    measure(tmp_path, "ctx=4096,8192;pp=512;tg=0;reps=3")
    assert FakeModel.asked == [("memory", 8192)]
    FakeModel.asked = []
    measure(tmp_path, "ctx=4096;pp=512;tg=0;reps=5")  # other repetitions: another figure
    assert FakeModel.asked == [("pp", 512, 0)]
    FakeModel.asked = []
    measure(tmp_path, "ctx=4096;pp=512;tg=0;reps=5", force=True)
    assert len(FakeModel.asked) == 2


def test_a_context_that_cannot_be_allocated_is_named_and_the_rest_measured(tmp_path, fake):
    run = measure(tmp_path, "ctx=4096,65536;pp=512;tg=0;reps=1")
    fail = run.records[0].memory_at(65536)
    assert fail.devices is None and fail.total_bytes is None
    assert fail.error == ("a context of 65536 tokens cannot be allocated: llama.cpp asked for 3.00 MiB (3,145,728 "
                          "bytes) and could not allocate it (failed to allocate buffer for kv cache)")
    assert run.errors == [f"deploy Q4_K_M: {fail.error}"]
    assert run.records[0].memory_at(4096).total_bytes == 41060 and run.records[0].speed
    FakeModel.asked = []
    measure(tmp_path, "ctx=4096,65536;pp=512;tg=0;reps=1")  # tried again, the rest reused
    assert FakeModel.asked == [("memory", 65536)]


def test_records_refuse_a_tampered_machine_and_other_formats(tmp_path, fake):
    record = measure(tmp_path, "ctx=4096;pp=0;tg=16;reps=1").records[0]
    path = deployment.record_path(tmp_path, record.label, record.machine_id)
    data = json.loads(path.read_text())
    assert deployment.DeploymentRecord.from_json(data) == record
    data["machine"]["cores"] = 64  # a record moved to another machine's fields keeps its id: refused
    path.write_text(json.dumps(data))
    with pytest.raises(StoreFormatError, match="machine id does not match"):
        deployment.load_records(tmp_path)
    path.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(StoreFormatError, match="version 99"):
        deployment.load_record(path)


def test_matrix_request_is_built_with_keywords_only():
    from qeval.orchestrate import matrix  # noqa: PLC0415

    with pytest.raises(TypeError):
        matrix.MatrixRequest("R", "r.gguf", (), Path("."))
    request = matrix.MatrixRequest(ref_label="R", ref_path="r.gguf", pairs=(), directory=Path("."),
                                   deploy=deploy.DeploySpec())
    assert request.deploy.reps == 5


# -- real llama.cpp --------------------------------------------------------------------------------------------------
def test_memory_of_gemma_matches_the_formula_and_grows_with_the_context(models):
    with DeployModel(models["Q8_0"], EngineSettings(type_k="q8_0", type_v="q8_0", flash_attn="on",
                                                     n_threads=2)) as model:
        figures = {n: model.measure_memory(n) for n in (4096, 32768)}
        rotation = model.kv_rotation
    geometry = memory.memory_geometry(models["Q8_0"])
    for n, (devices, layout) in figures.items():
        kv = sum(d.get("kv", 0) for d in devices.values())
        assert abs(kv - memory.formula_bytes(geometry, n, "q8_0", "q8_0", 512)["kv"]) <= 2 * ROUNDING
        assert f"{n} cells x 3 layers" in layout and "1024 cells x 15 layers" in layout
        assert devices["CPU"]["compute"] > 0 and devices["CPU"]["output"] > 0
        assert 0.9 < sum(d.get("model", 0) for d in devices.values()) / Path(models["Q8_0"]).stat().st_size < 1.0
    assert rotation == {"k": True, "v": True}  # Gemma's 256-wide heads: llama.cpp rotates a q8_0 cache


def test_deploy_command_measures_speed_and_memory_and_reuses_them(models, tmp_path):
    spec = "ctx=1024;depth=0,64;pp=16;tg=2;reps=2"
    res = run_cli("deploy", f"Q4_0={models['Q4_0']}", "--kv", "f16,q4_0", "--spec", spec, "-t", "2",
                  "--runs-dir", tmp_path, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    records = out["deployment"]["records"]
    assert [r["label"] for r in records] == ["Q4_0", "Q4_0+kv-q4_0"]
    assert records[1]["kv"] == {"type_k": "q4_0", "type_v": "q4_0", "flash_attn": "on",
                                "rotation": {"k": True, "v": True}}
    for r in records:
        assert [(s["test"], s["tokens"], s["depth"]) for s in r["speed"]] == \
            [("pp", 16, 0), ("pp", 16, 64), ("tg", 2, 0), ("tg", 2, 64)]
        assert all(len(s["tokens_per_s"]["values"]) == 2 and s["tokens_per_s"]["min"] > 0 for s in r["speed"])
        assert r["machine"]["id"] == out["deployment"]["machine"]["id"]
    again = run_cli("deploy", f"Q4_0={models['Q4_0']}", "--kv", "f16,q4_0", "--spec", spec, "-t", "2",
                    "--runs-dir", tmp_path)
    assert again.returncode == 0 and again.stdout.count("measured earlier on this machine, reused") == 2
    assert "| Q4_0+kv-q4_0 | q4_0/q4_0 | 1024 |" in again.stdout


def test_deploy_command_bad_input(models, tmp_path):
    assert_cli_error(run_cli("deploy", models["Q8_0"], "--spec", "ctx=65536", "--runs-dir", tmp_path),
                     "ctx=65536 is beyond", "trained context of 32768")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(Path(models["Q2_K"]).read_bytes()[:4 << 20])
    assert_cli_error(run_cli("deploy", truncated, "--runs-dir", tmp_path), "truncated.gguf")
    assert_cli_error(run_cli("deploy", models["Q8_0"], "--spec", "ctx=4096;ncmoe=1;pp=0;tg=0",
                             "--runs-dir", tmp_path), "no expert tensors")
    assert not deployment.load_records(tmp_path)


def test_a_model_llamacpp_cannot_load_gets_its_message_and_the_others_are_measured(gemma_tokenizer, tmp_path,
                                                                                 monkeypatch):
    class MissingExperts(tinymodels.TinyGGUF):
        def tensor(self, kind, ne, bid=None, **kw):
            if not (kind == tinymodels.T.FFN_UP_EXP and bid == 0):
                super().tensor(kind, ne, bid, **kw)

    good = tinymodels.build_qwen35moe(tmp_path / "good.gguf", gemma_tokenizer)
    monkeypatch.setattr(tinymodels, "TinyGGUF", MissingExperts)
    broken = tinymodels.build_qwen35moe(tmp_path / "broken.gguf", gemma_tokenizer)
    res = run_cli("deploy", f"B={broken}", f"G={good}", "--spec", "ctx=1024;pp=0;tg=0", "--runs-dir", tmp_path)
    msg = assert_cli_error(res, "deploy B: llama.cpp could not load", "broken.gguf", "not found")
    assert "blk.0.ffn_up_exps" in msg
    assert [r.label for r in deployment.load_records(tmp_path)] == ["G"]
    assert "| G | f16/f16 | 1024 |" in res.stdout


AS_LIMIT_CHILD = textwrap.dedent("""
    import json, resource, sys
    import qeval.engine.deploy as engine_deploy
    from qeval.engine.engine import EngineSettings
    from qeval.orchestrate import deploy

    def address_space():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    loaded = engine_deploy.DeployModel._load_model
    def load_then_limit(self, vocab_only):  # Linux overcommits: only an address-space limit makes a context fail
        model = loaded(self, vocab_only)
        resource.setrlimit(resource.RLIMIT_AS, (address_space() + 700 * 2**20, resource.RLIM_INFINITY))
        return model
    engine_deploy.DeployModel._load_model = load_then_limit
    row = deploy.DeployRow("Q8_0+kv-f32", sys.argv[1], EngineSettings(type_k="f32", type_v="f32", flash_attn="off",
                                                                      n_threads=2))
    run = deploy.measure_rows([row], deploy.parse_deploy_spec("ctx=4096,32768;pp=0;tg=0"), sys.argv[2])
    print(json.dumps(run.to_json()))
""")


def test_a_context_beyond_an_address_space_limit_fails_alone(models, tmp_path):
    """4096 needs ~610 MiB of address space beyond the loaded model, 32768 ~780 MiB (an f32 cache, no flash
    attention): under a limit of 700 MiB the first is measured, the second named with the bytes llama.cpp asked for."""
    proc = subprocess.run([sys.executable, "-c", AS_LIMIT_CHILD, str(models["Q8_0"]), str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    small, large = run["records"][0]["memory"]
    assert small["n_ctx"] == 4096 and small["error"] is None and small["total_bytes"] > 0
    assert large["n_ctx"] == 32768 and large["devices"] is None
    assert large["error"].startswith("a context of 32768 tokens cannot be allocated: llama.cpp asked for ")
    assert "MiB" in large["error"] and "bytes) and could not allocate it" in large["error"]
    assert run["errors"] == [f"deploy Q8_0+kv-f32: {large['error']}"]
    assert deployment.load_records(tmp_path)[0].memory_at(4096).total_bytes == small["total_bytes"]


WIDE_STATE = tinymodels.Qwen35MoeDims(ssm_head_dim=64, ssm_k_heads=4, ssm_v_heads=8)


def test_hybrid_recurrent_state_is_flat_while_attention_kv_grows(gemma_tokenizer, tmp_path):
    """The tiny qwen35moe with a recurrent state wide enough to show at llama.cpp's two decimals of MiB."""
    model = tinymodels.build_qwen35moe(tmp_path / "qwen35moe.gguf", gemma_tokenizer, WIDE_STATE)
    geometry = memory.memory_geometry(model)
    with DeployModel(model, EngineSettings(n_threads=2)) as deployed:
        at = {n: deployed.measure_memory(n)[0]["CPU"] for n in (1024, 4096)}
    formula = {n: memory.formula_bytes(geometry, n, "f16", "f16", 512) for n in at}
    assert at[1024]["recurrent"] == at[4096]["recurrent"] > 100_000
    assert abs(at[4096]["recurrent"] - formula[4096]["recurrent"]) <= ROUNDING
    assert abs(at[4096]["kv"] - formula[4096]["kv"]) <= ROUNDING
    assert at[4096]["kv"] > 3.5 * at[1024]["kv"]
    with DeployModel(model, EngineSettings(n_threads=2), n_cpu_moe=2) as offloaded:
        assert set(offloaded.offloaded_experts) == {f"blk.{i}.ffn_{w}_exps.weight" for i in (0, 1)
                                                    for w in ("gate", "up", "down")}
        assert set(offloaded.offloaded_experts.values()) == {"CPU"}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, gemma_tokenizer) -> Path:
    """The tests' tiny qwen35moe, F16."""
    return tinymodels.build_qwen35moe(tmp_path_factory.mktemp("deploy-hybrid") / "q.gguf", gemma_tokenizer)


def test_matrix_and_kld_deploy_their_rows(hybrid, tmp_path):
    f16 = hybrid
    runs = tmp_path / "runs"
    spec = "ctx=1024;pp=8;tg=2;reps=1"
    result, text = api.matrix_report(f"REF={f16}", [f"C={f16}"], ["q8_0"], chunks=1, n_ctx=64, runs_dir=runs,
                                     engine=EngineSettings(n_threads=2), progress=False, deploy=spec)
    records = result["deployment"]["records"]
    assert [r["label"] for r in records] == ["REF", "C+kv-q8_0"]
    assert records[1]["kv"]["type_k"] == "q8_0" and records[1]["memory"][0]["devices"]["CPU"]["recurrent"] > 0
    assert "Speed (tokens per second)" in text and "| C+kv-q8_0 | q8_0/q8_0 | 1024 |" in text
    result, _ = api.kld_report("REF", str(f16), chunks=1, runs_dir=runs, settings=EngineSettings(n_threads=2),
                               save="again", deploy=deploy.parse_deploy_spec(spec))
    assert [r["label"] for r in result["deployment"]["records"]] == ["again"]
    assert {r.label for r in deployment.load_records(runs)} == {"REF", "C+kv-q8_0", "again"}
    with pytest.raises(QevalError, match="is a store"):
        api.kld_report("REF", "REF", runs_dir=runs, deploy=spec)


def test_recipe_deploys_each_variant_while_its_gguf_is_on_disk(hybrid, tmp_path):
    runs = tmp_path / "runs"
    api.capture_store(str(hybrid), "REF", runs_dir=runs, n_ctx=64, chunks=1,
                      settings=EngineSettings(flash_attn="off", n_threads=2))
    request = api.recipe_request(ref="REF", source=str(hybrid), recipes=["Q8_0"], chunks=1, runs_dir=runs, threads=2,
                                 deploy="ctx=1024;pp=0;tg=2;reps=1")
    result, text = api.recipe_measure_report(request)
    [record] = result["deployment"]["records"]
    assert record["label"] == "Q8_0" and record["speed"][0]["tokens_per_s"]["median"] > 0
    assert "| Q8_0 | f16/f16 | 1024 |" in text
    assert not list((runs / "recipes").glob("*.gguf"))  # deleted once measured, as without --deploy
    path = deployment.record_path(runs, "Q8_0", record["machine"]["id"])
    path.unlink()  # its quality result is reused; its speed and memory are missing: the variant is built again
    result, _ = api.recipe_measure_report(request)
    assert [r["label"] for r in result["deployment"]["records"]] == ["Q8_0"] and path.is_file()
    assert not list((runs / "recipes").glob("*.gguf"))
