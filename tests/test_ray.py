"""qeval merge, and `qeval matrix --executor ray` on a real local Ray (2 CPUs) with Gemma-3-270M.

Merge refusals use synthetic stores (tests/conftest.py). The Ray tests run the same small matrix
(Q8_0 reference, Q2_K at KV f16 and q8_0, n_ctx 64, 4 chunks) locally once and compare: through
Ray, with the reference in 4 shards merged back, with workers SIGKILLed mid-task, and with a
task that fails for good.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_cli_error, make_tokens, run_cli, synth_logits, write_store

from qeval import api
from qeval.errors import QevalError
from qeval.orchestrate.merge import merge_stores
from qeval.present import results
from qeval.storage import checkpoint
from qeval.storage.store import StoreReader

N_CTX, CHUNKS = 64, 4
KV = ["f16", "q8_0"]


# --------------------------------------------------------------------------------------------------
# merge, on synthetic stores
# --------------------------------------------------------------------------------------------------
V, CTX, N = 900, 16, 6


@pytest.fixture
def synth(tmp_path):
    rng = np.random.default_rng(7)
    tokens = make_tokens(rng, N, CTX, V)
    logits = synth_logits(rng, tokens, V)
    whole = write_store(tmp_path / "whole.qeval", tokens, logits, V, label="REF")

    def part(a: int, b: int, name: str | None = None, finish: bool = True, **kw):
        path = tmp_path / (name or f"p{a}-{b}.qeval")
        if path.exists():
            return path
        return write_store(path, tokens, {c: logits[c] for c in range(a, b)}, V,
                           label="REF", chunk_range=(a, b), finish=finish, **kw).path

    return tmp_path, whole, part


def chunk_records(path: Path) -> dict[int, bytes]:
    with StoreReader(path) as r:
        return {i: r._record_at(r.chunk_offsets[i], b"CHNK")[0] for i in r.chunk_indices}


def test_merge_cli_copies_chunks_verbatim(synth):
    d, whole, part = synth
    parts = [part(3, 6), part(0, 2), part(2, 3)]  # any order on the command line
    res = run_cli("merge", *parts, d / "merged.qeval")
    assert res.returncode == 0, res.stderr
    assert "6 chunks from 3 parts" in res.stdout
    with StoreReader(d / "merged.qeval", verify_chunks=True) as m, StoreReader(whole.path) as w:
        assert m.complete and m.chunk_indices == list(range(N))
        assert (m.header.chunk_start, m.header.chunk_stop, m.header.label) == (0, N, "REF")
        assert [p["chunk_range"] for p in m.header.capture["merged_from"]] == [[0, 2], [2, 3], [3, 6]]
        np.testing.assert_array_equal(m.tokens, w.tokens)
        np.testing.assert_array_equal(m.lut, w.lut)
    assert chunk_records(d / "merged.qeval") == chunk_records(whole.path)  # byte for byte
    assert not list(d.glob("*.merging"))


def test_merge_refuses_overlap(synth):
    d, _, part = synth
    a, b = part(0, 4), part(3, 6)
    with pytest.raises(QevalError, match=r"overlap.*3:4 are in both") as exc:
        merge_stores([a, b], d / "out.qeval")
    assert str(a) in str(exc.value) and str(b) in str(exc.value)
    assert not (d / "out.qeval").exists()


def test_merge_refuses_gaps_naming_the_missing_range(synth):
    d, _, part = synth
    res = run_cli("merge", part(0, 2), part(4, 5), d / "out.qeval")
    assert_cli_error(res, "chunks 2:4, 5:6 of the 6 are in no part", "p0-2.qeval", "p4-5.qeval")
    assert not (d / "out.qeval").exists() and not (d / "out.qeval.merging").exists()


def test_merge_refuses_incomplete_parts(synth):
    d, _, part = synth
    torn = part(2, 6, finish=False, order=[2, 3])
    with open(torn, "ab") as fh:
        fh.write(b"CHNK\0\0")  # interrupted mid-record
    with pytest.raises(QevalError, match=r"p2-6.qeval is incomplete \(it holds 2 of the 4 chunks of its range 2:6"):
        merge_stores([part(0, 2), torn], d / "out.qeval")
    assert not (d / "out.qeval").exists()


@pytest.mark.parametrize("field, extra", [
    ("model", {"model": {"file_name": "other.gguf"}}),
    ("kv", {"kv": {"type_k": "q4_0", "type_v": "q4_0", "flash_attn": "on"}}),
    ("tokenizer_sha256", {"tokenizer_sha256": "ab" * 32}),
])
def test_merge_refuses_parts_of_different_captures(synth, field, extra):
    d, _, part = synth
    other = part(3, 6, name="other.qeval", **extra)
    with pytest.raises(QevalError, match=f"different captures \\({field} differ"):
        merge_stores([part(0, 3), other], d / "out.qeval")


def test_merge_refuses_other_tokens_code_or_existing_output(synth, tmp_path):
    from qeval.storage.codec import SqrtLogCode

    d, whole, part = synth
    rng = np.random.default_rng(8)
    tokens = make_tokens(rng, N, CTX, V)
    alien = write_store(d / "alien.qeval", tokens, synth_logits(rng, tokens, V, (3, 6)), V, label="REF",
                        chunk_range=(3, 6)).path
    with pytest.raises(QevalError, match="tokens_sha256 differ"):
        merge_stores([part(0, 3), alien], d / "out.qeval")
    knee = part(3, 6, name="knee.qeval", code=SqrtLogCode(knee=-6.0))
    with pytest.raises(QevalError, match="codec differ"):
        merge_stores([part(0, 3), knee], d / "out.qeval")
    with pytest.raises(QevalError, match="already exists"):
        merge_stores([part(0, 3), part(3, 6)], whole.path)


def test_failed_merge_leaves_nothing_that_looks_complete(synth):
    d, _, part = synth
    a, b = part(0, 3), part(3, 6)
    with StoreReader(b) as r:
        offset = r.chunk_offsets[5] + 200
    data = bytearray(b.read_bytes())
    data[offset] ^= 0xFF  # a flipped bit inside the last chunk: found only while copying
    b.write_bytes(bytes(data))
    with pytest.raises(QevalError, match="checksum mismatch"):
        merge_stores([a, b], d / "out.qeval")
    assert not (d / "out.qeval").exists() and not (d / "out.qeval.merging").exists()


def test_shard_ranges_cover_every_chunk_once():
    from qeval.orchestrate.distributed import shard_ranges

    assert shard_ranges(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert shard_ranges(3, 8) == [(0, 1), (1, 2), (2, 3)]
    for n in range(1, 40):
        for k in range(1, 9):
            r = shard_ranges(n, k)
            assert r[0][0] == 0 and r[-1][1] == n and all(a < b for a, b in r)
            assert all(x[1] == y[0] for x, y in zip(r, r[1:]))


# --------------------------------------------------------------------------------------------------
# without Ray
# --------------------------------------------------------------------------------------------------
def test_missing_ray_gives_install_hint(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(QevalError, match=r"pip install 'qeval\[ray\]'"):
        api.matrix_report(f"R={tmp_path / 'r.gguf'}", [f"C={tmp_path / 'c.gguf'}"], ["f16"], chunks=2,
                          runs_dir=tmp_path / "runs", progress=False, executor="ray")


def test_missing_ray_cli_message(tmp_path):
    fake = tmp_path / "fakeray"
    fake.mkdir()
    (fake / "ray.py").write_text("raise ImportError('simulated: no ray here')\n")
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("QEVAL_RUNS_DIR", None)
    res = subprocess.run([sys.executable, "-m", "qeval", "matrix", "--ref", "r.gguf", "-m", "c.gguf", "--executor",
                          "ray", "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True, env=env,
                         timeout=120)
    assert_cli_error(res, "needs Ray", "pip install 'qeval[ray]'")
    res = run_cli("matrix", "--ref", "r.gguf", "-m", "c.gguf", "--shard-chunks", "4", "--runs-dir", tmp_path / "r")
    assert_cli_error(res, "need --executor ray")


# --------------------------------------------------------------------------------------------------
# a real local Ray, Gemma-3-270M
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_session():
    try:
        import ray
    except ImportError:
        pytest.skip("Ray is not installed (pip install 'qeval[ray]'); the Ray executor tests need it")
    ray.init(num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


def matrix(models, runs_dir, executor=None):
    return api.matrix_report(f"Q8_0={models['Q8_0']}", [f"Q2_K={models['Q2_K']}"], KV, chunks=CHUNKS, n_ctx=N_CTX,
                             runs_dir=runs_dir, progress=False, executor=executor)


@pytest.fixture(scope="module")
def local_run(models, tmp_path_factory):
    """The matrix on one machine, its reference then certified: a cluster captures it without lean pieces (its
    readers run on nodes of any kind), so the stores compare piece for piece only once this one is certified too
    (tests/test_certify.py: certified pieces are a portable capture's, field for field)."""
    from qeval.orchestrate.certify import certify_store

    d = tmp_path_factory.mktemp("local")
    result, _ = matrix(models, d)
    assert certify_store(d / "Q8_0.qeval").lean_pieces > 0
    return d, result


@pytest.fixture(scope="module")
def ray_run(ray_session, models, local_run, tmp_path_factory):
    from qeval.orchestrate.distributed import RayExecutor

    d = tmp_path_factory.mktemp("ray")
    lines: list[str] = []
    ex = RayExecutor(shard_chunks=4, progress_interval=0.5, log=lines.append)
    result, text = matrix(models, d, ex)
    return d, result, text, lines


def numbers(summary: dict) -> dict:
    """A result summary without where its files are."""
    out = {k: v for k, v in summary.items() if k != "per_token_file"}
    out["reference"] = {k: v for k, v in summary["reference"].items() if k != "path"}
    out["candidate"] = {k: v for k, v in summary["candidate"].items() if k != "path"}
    return out


def assert_same_results(local_dir: Path, other_dir: Path, labels) -> None:
    for label in labels:
        a = results.load_result(local_dir / "results" / f"{label}.vs.Q8_0.json")
        b = results.load_result(other_dir / "results" / f"{label}.vs.Q8_0.json")
        assert numbers(a.summary.to_json()) == numbers(b.summary.to_json())
        assert a.per_token.keys() == b.per_token.keys()
        for k in a.per_token:
            np.testing.assert_array_equal(a.per_token[k], b.per_token[k])


def assert_same_codes(store: Path, local_store: Path) -> None:
    """`store` is complete, its chunks whole, and its codes those of the local run's store, chunk by chunk."""
    with StoreReader(store, verify_chunks=True) as s, StoreReader(local_store) as w:
        assert s.complete and s.chunk_indices == w.chunk_indices == list(range(CHUNKS))
        v = s.header.n_vocab
        for i in range(CHUNKS):
            np.testing.assert_array_equal(s.read_chunk(i).codes(v), w.read_chunk(i).codes(v))


def test_ray_matrix_equals_local(local_run, ray_run):
    local_dir, local = local_run
    ray_dir, remote, text, lines = ray_run
    assert [numbers(r) for r in remote["results"]] == [numbers(r) for r in local["results"]]
    assert remote["rows"] == local["rows"]
    assert_same_results(local_dir, ray_dir, ["Q2_K", "Q2_K+kv-q8_0"])
    assert "4 shards (Ray tasks), merged" in text and "6 tasks (4 captures, 2 comparisons)" in text
    # fleet progress: task states, chunk counts of the stores being written, an ETA
    assert any("running" in line and "eta" in line for line in lines)
    assert "tasks 6/6 done, 0 running, 0 pending, 0 failed | chunks 12/12" in lines[-1]


def test_shards_merge_to_the_unsharded_store(models, local_run, ray_run):
    local_dir, _ = local_run
    ray_dir = ray_run[0]
    merged, whole = ray_dir / "Q8_0.qeval", local_dir / "Q8_0.qeval"
    assert not (ray_dir / "shards").exists()  # shards are removed once merged
    with StoreReader(merged, verify_chunks=True) as m, StoreReader(whole) as w:
        assert m.complete and m.header.chunk_range == w.header.chunk_range == range(CHUNKS)
        assert len(m.header.capture["merged_from"]) == 4
        for name in ("n_vocab", "n_ctx", "n_chunks", "tokens_sha256", "tokenizer_sha256", "codec", "model", "kv"):
            assert getattr(m.header, name) == getattr(w.header, name)
        for i in range(CHUNKS):
            a, b = m.read_chunk(i), w.read_chunk(i)
            np.testing.assert_array_equal(a.codes(m.header.n_vocab), b.codes(w.header.n_vocab))
            np.testing.assert_array_equal(a.logprob_target, b.logprob_target)
            np.testing.assert_array_equal(a.top_ids, b.top_ids)
    # `qeval kld` against the merged reference = against the unsharded one, token for token (a candidate store:
    # the matrix keeps none by default)
    if not (ray_dir / "cand" / "Q2_K.qeval").exists():
        api.kld_report(str(whole), str(models["Q2_K"]), runs_dir=ray_dir / "cand", save="Q2_K")
    cand = ray_dir / "cand" / "Q2_K.qeval"
    got, _ = api.kld_report(str(merged), str(cand), per_token=ray_dir / "merged.npz")
    want, _ = api.kld_report(str(whole), str(cand), per_token=ray_dir / "whole.npz")
    assert numbers(got) == numbers(want)
    with np.load(ray_dir / "merged.npz") as a, np.load(ray_dir / "whole.npz") as b:
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k])


def on_first_attempt(task, after: dict[str, int], act):
    """Ray task function `task` (capture_task or compare_task) whose first attempt of a task named in `after` calls
    act(name) in its worker once it has stored (a capture) or checkpointed (a pair) that many chunks: act kills the
    worker (killing), or stops it there until its node is removed (tests/test_ray_cluster.py). A closure, so that Ray
    ships it by value: a worker cannot import this test module."""
    def task_on_first_attempt(spec, name, tracker):
        import ray

        from qeval.storage.checkpoint import Checkpoint
        from qeval.storage.store import StoreWriter

        if name not in after or name in ray.get(tracker.snapshot.remote()):  # not its first attempt
            return task(spec, name, tracker)
        write_chunk, append, stored = StoreWriter.write_chunk, Checkpoint.append, []

        def write_then_act(writer, piece):
            write_chunk(writer, piece)
            if piece.first_row + piece.n_tokens == writer.header.n_scored:
                stored.append(piece.index)
            if len(stored) == after[name]:
                act(name)

        def append_then_act(ckpt, index, columns):
            append(ckpt, index, columns)
            if len(ckpt.parts) == after[name]:
                act(name)

        # in this worker alone, for this attempt
        StoreWriter.write_chunk, Checkpoint.append = write_then_act, append_then_act
        try:
            return task(spec, name, tracker)
        finally:
            StoreWriter.write_chunk, Checkpoint.append = write_chunk, append

    return task_on_first_attempt


def killing():
    """An act for on_first_attempt: SIGKILL the worker (a real crash). Made here, so that it is a closure too."""
    def kill(name: str) -> None:
        os.kill(os.getpid(), signal.SIGKILL)
    return kill


@contextlib.contextmanager
def first_attempts(after: dict[str, int], act):
    """Ray tasks of the names in `after` (task name -> chunks) call act on their first attempt (on_first_attempt)."""
    from qeval.orchestrate import distributed

    real = {fn: getattr(distributed, fn) for fn in ("capture_task", "compare_task")}
    for fn, task in real.items():
        setattr(distributed, fn, on_first_attempt(task, after, act))
    try:
        yield
    finally:
        for fn, task in real.items():
            setattr(distributed, fn, task)


def workers_dying(kill_after: dict[str, int]):
    """Ray tasks of the names in kill_after (task name -> chunks) die on their first attempt."""
    return first_attempts(kill_after, killing())


def test_killed_tasks_are_retried_and_resume(ray_session, models, local_run, tmp_path):
    """SIGKILL the reference capture's worker after 2 chunks and the pair's after 1: Ray retries
    both, the capture resumes at chunk 2, the comparison reads its checkpointed chunk back."""
    from qeval.orchestrate.distributed import RayExecutor

    local_dir, local = local_run
    ex = RayExecutor(progress_interval=0.5, log=lambda line: None)
    with workers_dying({"Q8_0": 2, "Q2_K": 1}):
        result, text = api.matrix_report(f"Q8_0={models['Q8_0']}", [f"Q2_K={models['Q2_K']}"], ["f16"],
                                         chunks=CHUNKS, n_ctx=N_CTX, runs_dir=tmp_path, progress=False, executor=ex)
    assert "Q8_0: 1 failed attempt(s) retried, succeeded on attempt 2, resumed at chunk 2 of 4" in text
    assert "Q2_K: resumed after a failed attempt (1 chunks read back from its checkpoint)" in text
    assert_same_codes(tmp_path / "Q8_0.qeval", local_dir / "Q8_0.qeval")
    assert_same_results(local_dir, tmp_path, ["Q2_K"])


def test_task_that_keeps_dying_is_reported_and_resumable(ray_session, models, local_run, tmp_path):
    from qeval.orchestrate.distributed import RayExecutor

    local_dir, _ = local_run
    shutil.copy(local_dir / "Q8_0.qeval", tmp_path / "Q8_0.qeval")  # reference done earlier
    args = (f"Q8_0={models['Q8_0']}", [f"Q2_K={models['Q2_K']}"], ["f16"])
    ex = RayExecutor(max_retries=0, log=lambda line: None)
    # 3 tasks: the reference store is checked by its capture task (it holds the request: nothing captured)
    failed = r"2 of 3 tasks failed: .*resumable: .*Q2_K\.vs\.Q8_0\.partial \(1 chunks\)"
    with workers_dying({"Q2_K": 1}), pytest.raises(QevalError, match=failed) as exc:
        api.matrix_report(args[0], [*args[1], f"BAD={tmp_path / 'missing.gguf'}"], args[2], chunks=CHUNKS,
                          n_ctx=N_CTX, runs_dir=tmp_path, progress=False, executor=ex)
    msg = str(exc.value)
    assert re.search(r"Q2_K: \w+: the worker died", msg)
    assert f"BAD: model file {tmp_path / 'missing.gguf'} does not exist" in msg  # the task's own QevalError
    assert "re-run the same command to resume" in msg
    assert checkpoint.chunks_in(tmp_path / "results" / "Q2_K.vs.Q8_0.partial") == 1
    assert not (tmp_path / "results" / "Q2_K.vs.Q8_0.json").exists()
    # the same command again finishes it
    result, text = api.matrix_report(*args, chunks=CHUNKS, n_ctx=N_CTX, runs_dir=tmp_path, progress=False,
                                     executor=RayExecutor(log=lambda line: None))
    assert "already complete" in text and "Q2_K: resumed after a failed attempt" in text
    assert_same_results(local_dir, tmp_path, ["Q2_K"])


def test_pair_whose_label_now_names_another_model_is_recomputed(ray_session, models, local_run, tmp_path):
    """-m Q2_K=<Q4_0 file> after a run with the Q2_K file: its saved result and store answer another request,
    so the pair is recomputed through Ray (the planning is the local matrix's) and the run says so."""
    from qeval.orchestrate.distributed import RayExecutor

    local_dir, _ = local_run
    shutil.copy(local_dir / "Q8_0.qeval", tmp_path / "Q8_0.qeval")
    shutil.copytree(local_dir / "results", tmp_path / "results")
    result, text = api.matrix_report(f"Q8_0={models['Q8_0']}", [f"Q2_K={models['Q4_0']}"], ["f16"], chunks=CHUNKS,
                                     n_ctx=N_CTX, runs_dir=tmp_path, progress=False,
                                     executor=RayExecutor(log=lambda line: None))
    assert "Q2_K: recomputed: its saved result answers another request (candidate model fingerprint" in text
    assert result["results"][0]["candidate"]["model"]["file_name"] == models["Q4_0"].name
    assert not (tmp_path / "Q2_K.qeval").exists()  # run live, its logits not kept


def test_ray_keeps_the_logits_when_asked(ray_session, models, local_run, tmp_path):
    """--keep-logits through Ray: the pair's store is written (by the task) and the numbers are the coded
    candidate's, as `qeval kld` against that store gives them."""
    from qeval.orchestrate.distributed import RayExecutor

    shutil.copy(local_run[0] / "Q8_0.qeval", tmp_path / "Q8_0.qeval")
    result, _ = api.matrix_report(f"Q8_0={models['Q8_0']}", [f"Q2_K={models['Q2_K']}"], ["f16"], chunks=CHUNKS,
                                  n_ctx=N_CTX, runs_dir=tmp_path, progress=False, keep_logits=True,
                                  executor=RayExecutor(log=lambda line: None))
    with StoreReader(tmp_path / "Q2_K.qeval") as store:
        assert store.complete and store.header.model["file_name"] == models["Q2_K"].name
    stored, _ = api.kld_report("Q8_0", "Q2_K", runs_dir=tmp_path)
    assert result["results"][0]["kld"] == stored["kld"]


def test_shard_planning_counts_windows_like_a_capture(models, local_run):
    from qeval.capture.capture import CaptureSpec
    from qeval.orchestrate.distributed import count_windows_task

    with StoreReader(local_run[0] / "Q8_0.qeval") as r:
        spec = CaptureSpec(model=str(models["Q8_0"]), out="", label="", n_ctx=N_CTX)
        assert count_windows_task(spec) == r.header.corpus["chunks_available"]
