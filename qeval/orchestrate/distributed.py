"""`qeval matrix --executor ray`: the same matrix, every capture and comparison a Ray task.

It executes the same qeval.orchestrate.matrix plan as a local run. Tasks are pure functions of serialisable
specs: a reference capture (or each of its shards) is a CaptureSpec, a model x KV pair is a
CompareSpec, run by the same function as locally (qeval.orchestrate.matrix.run_pair). Every task writes into
the runs directory, which must be one shared filesystem path, mounted at the same place on every
node (NFS, Lustre, ...): stores and pairs' checkpoints are resumable, so a task that dies (worker killed, node
lost, OOM) is retried by Ray (`max_retries`) and continues from its last complete chunk. Shards of the
reference are merged (qeval.orchestrate.merge) only once every shard is complete; a store is never made to
look complete early.

The driver (the `qeval matrix` process) only submits tasks, merges shards, and counts the chunks of the stores
and checkpoints being written to report progress for the whole fleet.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from qeval.capture.capture import CaptureSpec, capture, corpus_windows
from qeval.engine.engine import EngineSettings, LlamaModel
from qeval.errors import QevalError
from qeval.orchestrate.matrix import (
    SKIP,
    MatrixPlan,
    MatrixRun,
    PairPlan,
    plan_pairs,
    progress_path,
    run_pair,
    saved_summaries,
)
from qeval.orchestrate.merge import merge_stores
from qeval.storage import checkpoint, runs
from qeval.storage.store import StoreReader, replacement_path

SHARDS_SUBDIR = "shards"
INSTALL_HINT = "pip install 'qeval[ray]'"


def import_ray():
    try:
        import ray  # noqa: PLC0415 - optional dependency
    except ImportError:
        raise QevalError(f"--executor ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


# ------------------------------------------------------------------------------------------------
# task specs and task bodies (plain functions: they run the same in a Ray worker or in-process)
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class CompareSpec:
    """One model x KV pair of a matrix plan (not skipped) against a reference store, saved as a result."""

    ref: str  # reference: label in runs_dir, or store path
    pair: PairPlan  # its result <label>.vs.<ref> (and checkpoint), or with keep_logits its store RUNS/<label>.qeval
    runs_dir: str
    chunks: int
    threads: int = 2  # metrics threads (as `qeval kld`)


def run_compare(spec: CompareSpec, on_chunk: Callable[[int], None] | None = None) -> dict:
    """What `qeval kld --ref REF --cand MODEL --save-result` does, resumable: a retried task's live run continues
    from the chunks its killed attempt checkpointed (or stored, keep_logits)."""
    directory = Path(spec.runs_dir)
    with contextlib.closing(runs.open_source(spec.ref, directory)) as ref:
        done = run_pair(spec.pair, ref, spec.chunks, directory, spec.threads, on_chunk)
    return {"result": str(done.result), "chunks": done.chunks, "resumed_chunks": done.resumed_chunks,
            "resumed_from": done.resumed_from, "note": done.note}


def this_node() -> str:
    """The Ray node this process runs on, as the fleet's lines name it: its IP and the start of its node id (nodes
    of one machine share the IP)."""
    import ray  # noqa: PLC0415

    return f"{ray.util.get_node_ip_address()}/{ray.get_runtime_context().get_node_id()[:8]}"


def _start(tracker, name: str) -> dict:
    """The attempt's number (1 for the first, more on retries) and where it runs."""
    if tracker is None:
        return {"attempt": 1, "host": socket.gethostname()}
    import ray  # noqa: PLC0415

    node = this_node()
    return {"attempt": ray.get(tracker.start.remote(name, node)), "host": socket.gethostname(), "node": node}


def capture_task(spec: CaptureSpec, name: str, tracker=None) -> dict:
    where = _start(tracker, name)
    plan = {}
    res = capture(spec, on_plan=lambda total, done: plan.update(total=total, done=done))
    return {"name": name, "path": str(res.path), "status": res.status, "chunks_total": res.chunks_total,
            "chunks_written": res.chunks_written, "chunks_before": plan.get("done", res.chunks_total),
            "seconds": res.seconds, **where}


def compare_task(spec: CompareSpec, name: str, tracker=None) -> dict:
    where = _start(tracker, name)
    t0 = time.perf_counter()
    out = run_compare(spec)
    return {"name": name, **out, "seconds": time.perf_counter() - t0, **where}


def count_windows_task(spec: CaptureSpec) -> int:
    """Chunks the capture's corpus gives (to plan shards when --chunks is not given): vocab only."""
    with LlamaModel(spec.model) as vocab:  # no context: the vocabulary alone
        windows, _, _ = corpus_windows(spec, vocab)
        return len(windows)


class Tracker:
    """Ray actor: records task starts (attempts) and the node of each, so the driver can tell running and retried
    tasks, and where a lost attempt ran. It lives on the driver's node (RayExecutor._tracker): a node lost with the
    tracker on it would fail every task that starts afterwards."""

    def __init__(self):
        self.starts: dict[str, list[str]] = {}

    def start(self, name: str, node: str) -> int:
        self.starts.setdefault(name, []).append(node)
        return len(self.starts[name])

    def snapshot(self) -> dict[str, list[str]]:
        """Task name -> the node of each attempt, in order."""
        return {name: list(nodes) for name, nodes in self.starts.items()}


def shard_ranges(n_chunks: int, shards: int) -> list[tuple[int, int]]:
    """`shards` contiguous chunk ranges covering [0, n_chunks), sizes differing by at most one."""
    k = max(1, min(shards, n_chunks))
    bounds = [round(i * n_chunks / k) for i in range(k + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:])]


def count_chunks(path: Path) -> int:
    """Chunks of a pair's checkpoint; whole CHNK records of a store being written (0 while it does not exist or has
    no header yet), of its replacement while one is being written."""
    if path.suffix == checkpoint.SUFFIX:
        return checkpoint.chunks_in(path)
    if replacement_path(path).exists():
        path = replacement_path(path)
    try:
        with StoreReader(path, tolerate_torn_tail=True) as r:
            return len(r.chunk_indices)
    except (QevalError, OSError):
        return 0


def on_cluster(plan: MatrixPlan, cpus_per_task: float) -> MatrixPlan:
    """`plan` as Ray tasks run it: paths absolute (every node sees them on the shared filesystem), unless -t the
    threads of a task's own CPUs, not those of the whole node, and a reference whose hidden pieces are certified as
    they are captured (not lean): its shards and its readers may run on nodes of any CPU kind."""
    threads = max(1, int(cpus_per_task))
    corpus = plan.reference.corpus
    directory = Path(plan.directory).resolve()
    reference = replace(plan.reference, model=os.path.abspath(plan.reference.model),
                        out=str(runs.store_path(plan.reference.label, directory)),
                        corpus=os.path.abspath(corpus) if corpus and Path(corpus).is_file() else corpus,
                        settings=_with_threads(plan.reference.settings, threads), threads=threads, lean=False)
    pairs = tuple(replace(p, model=os.path.abspath(p.model), settings=_with_threads(p.settings, threads))
                  for p in plan.pairs)
    return replace(plan, reference=reference, pairs=pairs, directory=directory)


def _with_threads(settings: EngineSettings, threads: int) -> EngineSettings:
    return replace(settings, n_threads=settings.n_threads or threads)


def _is_complete(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        with StoreReader(path) as store:
            return store.complete
    except QevalError:
        return False


# ------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------
@dataclass
class _Task:
    name: str
    kind: str  # "capture" or "compare"
    store: Path  # the store or checkpoint whose chunks count as this task's progress (count_chunks)
    chunks: int | None  # chunks it has to hold when done
    ref: object = None  # Ray ObjectRef
    state: str = "pending"  # pending, running, done, failed
    result: dict | None = None
    error: str = ""


def _describe_error(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, QevalError):
        return str(cause)
    name = type(exc).__name__
    text = str(exc).strip().splitlines()
    if "NodeDied" in name:
        return f"{name}: its node was lost ({text[0] if text else 'no message'})"
    if "WorkerCrashed" in name or "OutOfMemory" in name or "ActorDied" in name:
        return f"{name}: the worker died ({text[0] if text else 'no message'})"
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    return f"{name}: {text[-1] if text else ''}"


class RayExecutor:
    """Runs a matrix plan (qeval.orchestrate.matrix) as Ray tasks. One task per reference capture or shard and per
    model x KV pair, each with `num_gpus=gpus_per_task, num_cpus=cpus_per_task`."""

    def __init__(self, address: str | None = None, gpus_per_task: float = 0, cpus_per_task: float = 1,
                 shard_chunks: int = 1, max_retries: int = 3, progress_interval: float = 10.0,
                 log: Callable[[str], None] | None = None):
        if gpus_per_task < 0 or cpus_per_task < 0:
            raise QevalError("--gpus-per-task and --cpus-per-task must not be negative")
        if shard_chunks < 1:
            raise QevalError("--shard-chunks must be at least 1")
        if max_retries < 0:
            raise QevalError("max_retries must not be negative")
        self.address, self.gpus, self.cpus = address, gpus_per_task, cpus_per_task
        self.shards, self.max_retries, self.interval = shard_chunks, max_retries, progress_interval
        self._log = log
        self.report: list[str] = []  # one line per task of the last run: name, state, error
        self.notes: list[str] = []
        self.tasks: list[_Task] = []

    # -- Ray plumbing ----------------------------------------------------------------------------
    def _connect(self):
        ray = import_ray()
        started = False
        if not ray.is_initialized():
            kwargs = {} if self.address else {"include_dashboard": False}
            try:
                ray.init(address=self.address, **kwargs)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise QevalError(f"cannot connect to Ray at {self.address or '(a new local instance)'}: {exc}") \
                    from None
            started = True
        return ray, started

    def _remote(self, ray, fn, name: str, **extra):
        opts = {"num_cpus": self.cpus, "num_gpus": self.gpus, "max_retries": self.max_retries, "name": name}
        opts.update(extra)
        return ray.remote(fn).options(**opts)

    @staticmethod
    def _tracker(ray):
        """A Tracker on this (the driver's) node: if it is lost the run is lost anyway, while any other node may go."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return ray.remote(num_cpus=0)(Tracker).options(scheduling_strategy=here).remote()

    def _say(self, line: str, progress: bool) -> None:
        if self._log is not None:
            self._log(line)
        elif progress:
            print(line, file=sys.stderr, flush=True)

    # -- the matrix ------------------------------------------------------------------------------
    def run(self, plan: MatrixPlan, progress: bool) -> MatrixRun:
        """Execute `plan` as Ray tasks; reports as qeval.orchestrate.matrix.run_local does, plus the fleet's lines."""
        ray, started = self._connect()
        try:
            return self._run(ray, on_cluster(plan, self.cpus), progress)
        finally:
            if started:
                ray.shutdown()

    def _run(self, ray, plan: MatrixPlan, progress: bool) -> MatrixRun:
        t0 = time.time()
        tracker = self._tracker(ray)
        base, directory = plan.reference, plan.directory
        ref_store = Path(base.out)
        self.tasks, self.notes = [], []
        fleet = _Fleet(self, ray, tracker, progress, t0)
        fleet.planned(len(plan.pairs), base.chunks)  # at most; so that progress counts them before they are submitted

        # 1. the reference: whole, or K shards then merged. A store (or shard) already there goes through a
        # capture task too: only a capture, which tokenizes the corpus, can tell whether it holds the request.
        shard_specs = self._plan_shards(ray, base, ref_store, directory)
        if shard_specs is None:
            fleet.submit_capture(base.label, base, ref_store)
        else:
            for spec in shard_specs:
                fleet.submit_capture(f"{base.label}[{spec.chunk_range[0]}:{spec.chunk_range[1]}]", spec,
                                     Path(spec.out))
        fleet.wait()
        if fleet.failed():
            self.report = fleet.summary_lines()
            raise QevalError(self._failure_text(fleet, "the reference capture failed, no pair was started"))
        if shard_specs is None and fleet.tasks[0].result["status"] == "already complete":
            ref_text = f"{ref_store} is already complete: nothing to do"
        else:
            if shard_specs is not None:
                parts = [spec.out for spec in shard_specs]
                for p in parts:
                    self._check_visible(Path(p), fleet)
                merge_stores(parts, ref_store, label=base.label)
                for p in parts:
                    Path(p).unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    (directory / SHARDS_SUBDIR).rmdir()
                how = f"{len(parts)} shards (Ray tasks), merged"
            else:
                self._check_visible(ref_store, fleet)
                how = "1 Ray task"
            written = sum(t.result["chunks_written"] for t in fleet.tasks if t.kind == "capture")
            ref_text = "\n".join([*self.notes, f"wrote {ref_store}: {self._chunks_of(ref_store)} chunks ({written} "
                                  f"captured now, {how}) in {time.time() - t0:.1f} s"])

        # 2. every model x KV pair whose saved result does not answer its request
        n_chunks, pairs = plan_pairs(plan)
        todo = [pair for pair in pairs if pair.action != SKIP]
        # skipped pairs are reported first: they are settled before any task is submitted
        done_lines = [pair.note for pair in pairs if pair.action == SKIP] + [pair.note for pair in todo if pair.note]
        fleet.planned(len(todo), n_chunks)
        for pair in todo:
            spec = CompareSpec(ref=base.label, pair=pair, runs_dir=str(directory), chunks=n_chunks)
            fleet.submit_compare(pair.label, spec, progress_path(pair, directory, base.label), n_chunks)
        fleet.wait()
        for t in fleet.tasks:
            if t.kind == "compare" and t.state == "done" and t.result.get("note"):
                done_lines.append(t.result["note"])
            if t.kind == "compare" and t.state == "done" and t.result.get("resumed_chunks"):
                done_lines.append(f"{t.name}: resumed after a failed attempt ({t.result['resumed_chunks']} chunks "
                                  f"read back from its {t.result.get('resumed_from', 'store')})")
        done_lines += fleet.retry_lines()
        self.report = fleet.summary_lines()
        if fleet.failed():
            raise QevalError(self._failure_text(fleet, f"{len(fleet.failed())} of {len(fleet.tasks)} tasks failed"))
        done_lines.append(fleet.final_line())
        return MatrixRun(ref_text, done_lines, saved_summaries(plan))

    def _plan_shards(self, ray, base: CaptureSpec, ref_store: Path, directory: Path):
        if self.shards <= 1:
            return None
        if ref_store.exists():  # reused or resumed (or replaced) in one task: resuming beats starting over
            if not _is_complete(ref_store):
                self.notes.append(f"{ref_store} exists (an interrupted capture): resumed in one task instead of "
                                  f"{self.shards} shards")
            return None
        n = base.chunks
        if n is None:
            counter = ray.remote(count_windows_task).options(num_cpus=min(1, self.cpus), name="count-windows")
            try:
                n = ray.get(counter.remote(base))
            except Exception as exc:  # noqa: BLE001 - Ray wraps the task's exception
                raise QevalError(f"planning shards failed: {_describe_error(exc)}") from None
        ranges = shard_ranges(n, self.shards)
        if len(ranges) == 1:
            return None
        shard_dir = directory / SHARDS_SUBDIR
        shard_dir.mkdir(parents=True, exist_ok=True)
        return [replace(base, out=str(shard_dir / f"{base.label}.{a:06d}-{b:06d}.qeval"), chunks=n, chunk_range=(a, b))
                for a, b in ranges]

    @staticmethod
    def _chunks_of(path: Path) -> int:
        with StoreReader(path) as r:
            return r.header.n_chunks

    @staticmethod
    def _check_visible(path: Path, fleet: "_Fleet") -> None:
        if not path.is_file():
            hosts = sorted({t.result.get("host", "?") for t in fleet.tasks if t.result})
            raise QevalError(f"a Ray task on {', '.join(hosts)} wrote {path}, but this machine cannot see it: "
                             "--runs-dir must be a shared filesystem path, mounted at the same place on every node")

    @staticmethod
    def _failure_text(fleet: "_Fleet", head: str) -> str:
        lines = [f"{t.name}: {t.error}" for t in fleet.failed()]
        partial = [f"{t.store} ({count_chunks(t.store)} chunks)" for t in fleet.failed() if t.store.exists()]
        tail = (" Their checkpoints and partial stores are kept, resumable: " + ", ".join(partial) + ".") if partial \
            else ""
        return (f"{head}: " + "; ".join(lines) + "." + tail + " Finished stores and results are kept: re-run the "
                "same command to resume.")


class _Fleet:
    """Submitted tasks, their states, and the progress line."""

    def __init__(self, ex: RayExecutor, ray, tracker, progress: bool, t0: float):
        self.ex, self.ray, self.tracker, self.progress, self.t0 = ex, ray, tracker, progress, t0
        self.tasks = ex.tasks
        self.starts: dict[str, list[str]] = {}  # task name -> the node of each attempt (Tracker.snapshot)
        self._last_line = 0.0
        self._chunks0: int | None = None
        self._future_tasks, self._future_chunks = 0, 0  # planned pairs, not submitted yet

    def planned(self, n_tasks: int, chunks_each: int | None) -> None:
        self._future_tasks = n_tasks
        self._future_chunks = n_tasks * chunks_each if chunks_each is not None else (None if n_tasks else 0)

    def submit_capture(self, name: str, spec: CaptureSpec, store: Path) -> None:
        chunks = (spec.chunk_range[1] - spec.chunk_range[0]) if spec.chunk_range else spec.chunks
        fn = self.ex._remote(self.ray, capture_task, name)
        ref = fn.remote(spec, name, self.tracker)
        self.tasks.append(_Task(name=name, kind="capture", store=store, chunks=chunks, ref=ref))

    def submit_compare(self, name: str, spec: CompareSpec, store: Path, chunks: int) -> None:
        self._future_tasks -= 1
        if self._future_chunks is not None:
            self._future_chunks -= chunks
        fn = self.ex._remote(self.ray, compare_task, name)
        ref = fn.remote(spec, name, self.tracker)
        self.tasks.append(_Task(name=name, kind="compare", store=store, chunks=chunks, ref=ref))

    def failed(self) -> list[_Task]:
        return [t for t in self.tasks if t.state == "failed"]

    def wait(self) -> None:
        waiting = {t.ref: t for t in self.tasks if t.state in ("pending", "running")}
        self.line(force=True)
        while waiting:
            ready, _ = self.ray.wait(list(waiting), num_returns=1, timeout=min(1.0, self.ex.interval))
            for ref in ready:
                task = waiting.pop(ref)
                try:
                    task.result, task.state = self.ray.get(ref), "done"
                except Exception as exc:  # noqa: BLE001 - RayTaskError, WorkerCrashedError, OutOfMemoryError ...
                    task.state, task.error = "failed", _describe_error(exc)
                    self.ex._say(f"qeval ray: task {task.name} failed: {task.error}", self.progress)
            self.line(force=not waiting)

    def _refresh(self) -> None:
        with contextlib.suppress(Exception):
            self.starts = self.ray.get(self.tracker.snapshot.remote(), timeout=10)
        for t in self.tasks:
            if t.state == "pending" and t.name in self.starts:
                t.state = "running"

    def chunk_counts(self) -> tuple[int, int | None]:
        done, total = 0, self._future_chunks
        for t in self.tasks:
            if t.chunks is None:
                total = None
            elif total is not None:
                total += t.chunks
            if t.state == "done" and t.chunks is not None:
                done += t.chunks
            else:  # a pending task's store may hold chunks of an earlier run
                done += count_chunks(t.store)
        return done, total

    def line(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_line < self.ex.interval:
            return
        self._last_line = now
        self._refresh()
        states = {s: sum(t.state == s for t in self.tasks) for s in ("done", "running", "pending", "failed")}
        states["pending"] += self._future_tasks
        n_tasks = len(self.tasks) + self._future_tasks
        retried = sum(1 for nodes in self.starts.values() if len(nodes) > 1)
        done, total = self.chunk_counts()
        if self._chunks0 is None:
            self._chunks0 = done
        elapsed = now - self.t0
        rate = (done - self._chunks0) / elapsed if elapsed > 0 else 0.0
        eta = "?"
        if total is not None and rate > 0:
            eta = _hms((total - done) / rate)
        elif total is not None and done >= total:
            eta = "0:00:00"
        self.ex._say(f"qeval ray [{_hms(elapsed)}]: tasks {states['done']}/{n_tasks} done, "
                     f"{states['running']} running, {states['pending']} pending, {states['failed']} failed"
                     f"{f' ({retried} retried)' if retried else ''} | chunks {done}/"
                     f"{total if total is not None else '?'} ({rate:.2f}/s) | eta {eta}", self.progress)

    def retry_lines(self) -> list[str]:
        out = []
        for t in self.tasks:
            nodes = self.starts.get(t.name, [])
            n = len(nodes)
            if n > 1:
                what = "succeeded" if t.state == "done" else "failed"
                extra = ""
                if t.state == "done" and t.kind == "capture":
                    extra = f", resumed at chunk {t.result['chunks_before']} of {t.result['chunks_total']}"
                out.append(f"{t.name}: {n - 1} failed attempt(s) retried, {what} on attempt {n}{extra} "
                           f"(attempts on nodes {' -> '.join(nodes)})")
        return out

    def summary_lines(self) -> list[str]:
        return [f"{t.name}: {t.state}{' (' + t.error + ')' if t.error else ''}" for t in self.tasks]

    def final_line(self) -> str:
        done, total = self.chunk_counts()
        self._refresh()
        nodes = {node for attempts in self.starts.values() for node in attempts}
        return (f"ray: {len(self.tasks)} tasks ({sum(t.kind == 'capture' for t in self.tasks)} captures, "
                f"{sum(t.kind == 'compare' for t in self.tasks)} comparisons) on {len(nodes)} node(s), {done} chunks, "
                f"{time.time() - self.t0:.1f} s")


def _hms(seconds: float) -> str:
    s = int(round(max(seconds, 0)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def as_executor(executor) -> RayExecutor:
    """`"ray"` (defaults: local Ray or RAY_ADDRESS, 1 CPU per task) or an executor object."""
    if executor == "ray":
        return RayExecutor()
    if isinstance(executor, str):
        raise QevalError(f"unknown executor {executor!r}: choose local or ray")
    return executor
