"""`qeval matrix --executor ray` on a Ray cluster of several nodes (ray.cluster_utils.Cluster, one machine), with
nodes lost mid-task.

The cluster: a head node with no CPUs (it holds the driver, this process, and the executor's tracker, and runs no
task) and three worker nodes of 1 CPU each, added afresh for every test; all of them see the runs directory (one
machine's filesystem stands for the shared one). The matrix is tests/test_ray.py's (Gemma-3-270M, Q8_0 reference,
Q2_K at KV f16 and q8_0, n_ctx 64, 4 chunks), compared with its local run:

* spread over the nodes, with the reference in 4 shards, it equals the local run;
* with the reference in 2 shards, the node running shard 2:4 is removed (`Cluster.remove_node`, every process of
  the node killed) once the shard has stored 1 of its 2 chunks, and later the node running pair Q2_K once the pair
  has checkpointed 1 of 4 chunks: Ray retries both on the nodes left, the shard resumes at its chunk 1, the pair
  reads its checkpointed chunk back, and the board equals the local one. While a node is being lost its files are
  checked to look incomplete, and at the end every file in the runs directory is complete;
* with no retries, a pair whose node is lost stops the run with a message naming the loss and its checkpoint, and
  the same command again resumes it to the local run's numbers;
* the executor's attempt counter is placed on the driver's node, which no test removes.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_ray import (  # local_run: the fixture of the single-machine run, shared
    CHUNKS,
    assert_same_codes,
    assert_same_results,
    first_attempts,
    local_run,  # noqa: F401
    matrix,
    numbers,
)

from qeval.present import results
from qeval.storage import checkpoint
from qeval.storage.store import StoreReader

WORKER_NODES = 3
OBJECT_STORE = 80 * 1024 * 1024  # bytes per node: tasks pass specs and small dicts only
# Health checks every 0.5 s, a node dead after 4 missed: a lost node is noticed in ~2 s instead of Ray's ~15-30 s
HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
STOPPED_S = 300  # a stopped first attempt waits this long for its node to go, then kills itself
RUN_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def cluster():
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError:
        pytest.skip("Ray is not installed (pip install 'qeval[ray]'); the Ray executor tests need it")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": OBJECT_STORE,
                                                      "include_dashboard": False, "_system_config": HEALTH})
    ray.init(address=c.address)  # the driver: on the head node
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture
def nodes(cluster):
    """Three fresh worker nodes of 1 CPU each."""
    added = [cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE) for _ in range(WORKER_NODES)]
    cluster.wait_for_nodes()
    yield added
    for node in added:
        if node in cluster.worker_nodes:
            cluster.remove_node(node, allow_graceful=False)


def node_of(result: dict) -> str:
    """The node id prefix of a task's result ("IP/ID" as distributed.this_node writes it)."""
    return result["node"].split("/")[1]


def assert_attempt_counter_on_the_drivers_node() -> None:
    """The executor's Tracker is pinned to the driver's node: left to Ray, an actor of no CPU lands on any node
    (on this cluster mostly on a worker node), whose loss would then fail every task started after it."""
    import ray

    from qeval.orchestrate.distributed import RayExecutor

    driver = ray.get_runtime_context().get_node_id()
    for _ in range(6):
        tracker = RayExecutor._tracker(ray)
        assert ray.get(tracker.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())) == driver
        ray.kill(tracker)


def test_matrix_over_three_nodes_equals_one_machine(cluster, nodes, models, local_run, tmp_path):
    from qeval.orchestrate.distributed import RayExecutor

    local_dir, local = local_run
    ex = RayExecutor(shard_chunks=4, progress_interval=0.5, log=lambda line: None)
    result, text = matrix(models, tmp_path, ex)
    assert [numbers(r) for r in result["results"]] == [numbers(r) for r in local["results"]]
    assert result["rows"] == local["rows"]
    assert_same_results(local_dir, tmp_path, ["Q2_K", "Q2_K+kv-q8_0"])
    assert_same_codes(tmp_path / "Q8_0.qeval", local_dir / "Q8_0.qeval")
    # 4 shards and 2 pairs ran on the worker nodes (the head has no CPU), on more than one of them
    used = {node_of(t.result) for t in ex.tasks}
    assert used <= {n.node_id[:8] for n in nodes} and len(used) >= 2
    assert f"6 tasks (4 captures, 2 comparisons) on {len(used)} node(s)" in text
    # on the same worker nodes: three fresh ones for this check alone cost 40-90 s
    assert_attempt_counter_on_the_drivers_node()


def stopping_until_removed(marker_dir: Path):
    """An act for test_ray.on_first_attempt: write the worker's node id to marker_dir/<task name>, then wait there
    (its files as they are) for the test to remove the node, which kills this worker. A closure: shipped by value."""
    def stop(name: str) -> None:
        import ray

        marker = marker_dir / name
        marker.with_suffix(".tmp").write_text(ray.get_runtime_context().get_node_id())
        os.replace(marker.with_suffix(".tmp"), marker)  # whole, or not there
        time.sleep(STOPPED_S)
        os.kill(os.getpid(), signal.SIGKILL)  # never go on writing: the retry owns the files now
    return stop


class Background:
    """fn() in a thread; its return value or exception."""

    def __init__(self, fn):
        self.value, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn) -> None:
        try:
            self.value = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            self.error = exc

    def result(self, timeout: float):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the run did not finish in {timeout} s"
        if self.error is not None:
            raise self.error
        return self.value


def remove_nodes_as_tasks_stop(cluster, marker_dir: Path, run: Background, check) -> dict[str, str]:
    """Whenever a task stops (its marker appears), check(task name) its files, then remove the node it runs on.
    Returns task name -> id of the node removed under it."""
    lost: dict[str, str] = {}
    deadline = time.time() + RUN_TIMEOUT_S
    while run.thread.is_alive() and time.time() < deadline:
        for marker in marker_dir.iterdir():
            if marker.suffix == ".tmp" or marker.name in lost:
                continue
            node_id = marker.read_text()
            check(marker.name)
            node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
            cluster.remove_node(node, allow_graceful=False)
            lost[marker.name] = node_id
        time.sleep(0.2)
    return lost


def test_nodes_lost_mid_task_are_retried_elsewhere_and_resume(cluster, nodes, models, local_run, tmp_path):
    from qeval.orchestrate.distributed import RayExecutor

    local_dir, local = local_run
    runs, markers = tmp_path / "runs", tmp_path / "stopped"
    markers.mkdir()
    shard = runs / "shards" / "Q8_0.000002-000004.qeval"
    pair_result, pair_checkpoint = runs / "results" / "Q2_K.vs.Q8_0.json", runs / "results" / "Q2_K.vs.Q8_0.partial"

    def looks_incomplete(name: str) -> None:
        """What a node being lost leaves: a store without its trailer, a checkpoint and no result."""
        if name == "Q8_0[2:4]":
            with StoreReader(shard, tolerate_torn_tail=True) as r:
                assert not r.complete and r.chunk_indices == [2]
            assert not (runs / "Q8_0.qeval").exists()  # not merged from a shard that is not done
        else:
            assert checkpoint.chunks_in(pair_checkpoint) == 1 and not pair_result.exists()

    lines: list[str] = []
    ex = RayExecutor(shard_chunks=2, progress_interval=0.5, log=lines.append)
    with first_attempts({"Q8_0[2:4]": 1, "Q2_K": 1}, stopping_until_removed(markers)):
        run = Background(lambda: matrix(models, runs, ex))
        lost = remove_nodes_as_tasks_stop(cluster, markers, run, looks_incomplete)
        result, text = run.result(timeout=60)

    assert set(lost) == {"Q8_0[2:4]", "Q2_K"} and len(set(lost.values())) == 2  # two nodes lost, one per task
    assert len(cluster.worker_nodes) == WORKER_NODES - 2
    by_name = {t.name: t.result for t in ex.tasks}
    for name, node_id in lost.items():  # each retried once, on another worker node
        assert by_name[name]["attempt"] == 2
        assert node_of(by_name[name]) in {n.node_id[:8] for n in nodes} - {node_id[:8]}
    retried = next(line for line in text.splitlines() if line.startswith("Q8_0[2:4]: "))
    assert retried.startswith("Q8_0[2:4]: 1 failed attempt(s) retried, succeeded on attempt 2, resumed at chunk 1 of 2")
    assert f"/{lost['Q8_0[2:4]'][:8]} -> " in retried  # the lost node first, then the one it succeeded on
    assert "Q2_K: resumed after a failed attempt (1 chunks read back from its checkpoint)" in text
    assert any("(1 retried)" in line for line in lines)
    # the board and every number equal the uninterrupted single-machine run's
    assert [numbers(r) for r in result["results"]] == [numbers(r) for r in local["results"]]
    assert result["rows"] == local["rows"]
    assert_same_results(local_dir, runs, ["Q2_K", "Q2_K+kv-q8_0"])
    assert_same_codes(runs / "Q8_0.qeval", local_dir / "Q8_0.qeval")
    # nothing left that looks complete and is not: one complete store, whole results, no shard or checkpoint
    assert [p.name for p in runs.glob("*.qeval")] == ["Q8_0.qeval"] and not (runs / "shards").exists()
    assert not list(runs.rglob("*.partial")) and not list(runs.rglob("*.tmp"))
    for label in ("Q2_K", "Q2_K+kv-q8_0"):
        saved = results.load_result(runs / "results" / f"{label}.vs.Q8_0.json")
        assert sorted(np.unique(saved.per_token["chunk"])) == list(range(CHUNKS))


def test_node_lost_without_retries_stops_and_the_same_command_resumes(cluster, nodes, models, local_run, tmp_path):
    """max_retries=0: the pair whose node is lost fails for good; the run says so, naming its node loss and the
    checkpoint it leaves, keeps the pair that finished, saves nothing for the lost one; the same command again (on
    the nodes left) resumes the pair from its checkpoint, and the board equals the local one."""
    from qeval.errors import QevalError
    from qeval.orchestrate.distributed import RayExecutor

    local_dir, local = local_run
    runs, markers = tmp_path / "runs", tmp_path / "stopped"
    runs.mkdir()
    markers.mkdir()
    shutil.copy(local_dir / "Q8_0.qeval", runs / "Q8_0.qeval")  # the reference, done earlier
    ex = RayExecutor(max_retries=0, log=lambda line: None)
    with first_attempts({"Q2_K": 2}, stopping_until_removed(markers)):
        run = Background(lambda: matrix(models, runs, ex))
        lost = remove_nodes_as_tasks_stop(cluster, markers, run, lambda name: None)
        with pytest.raises(QevalError) as exc:
            run.result(timeout=60)
    assert list(lost) == ["Q2_K"]
    msg = str(exc.value)
    assert msg.startswith("1 of 3 tasks failed: Q2_K: NodeDiedError: its node was lost (")
    assert lost["Q2_K"] in msg  # Ray's text names the node
    assert "resumable: " in msg and "Q2_K.vs.Q8_0.partial (2 chunks)" in msg
    assert (runs / "results" / "Q2_K+kv-q8_0.vs.Q8_0.json").exists()
    assert not (runs / "results" / "Q2_K.vs.Q8_0.json").exists()

    result, text = matrix(models, runs, RayExecutor(log=lambda line: None))
    assert "Q2_K: resumed after a failed attempt (2 chunks read back from its checkpoint)" in text
    assert [numbers(r) for r in result["results"]] == [numbers(r) for r in local["results"]]
    assert result["rows"] == local["rows"]
    assert_same_results(local_dir, runs, ["Q2_K", "Q2_K+kv-q8_0"])
    assert not list(runs.rglob("*.partial"))
