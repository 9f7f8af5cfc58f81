"""Matrix pairs without candidate logits (issue 25): each pair runs live uncoded and checkpoints its per-token
results chunk by chunk (qeval.storage.checkpoint), so a killed pair, or one stopped by a full disk, continues to
exactly the numbers of an uninterrupted run; --keep-logits keeps the candidate stores as before.

Most tests run the matrix on replayed logits (tests/replay_backend.py: no llama.cpp, seconds); the full-disk test
goes through the command line with Gemma-3-270M at -c 64, as a user would meet it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import replay_backend
from conftest import assert_cli_error, make_tokens, perturb, realistic_logits, run_cli

from qeval import api
from qeval.engine.engine import EngineSettings
from qeval.errors import QevalError
from qeval.orchestrate import matrix, sweep
from qeval.present import results
from qeval.storage import checkpoint
from qeval.storage.store import StoreReader

V, N_CTX, N = 300, 128, 6  # 63 scored tokens a chunk (--score half)
REPLAY = EngineSettings(backend=replay_backend.NAME, n_threads=1)


def replayed_models(d: Path, seed: int, n_chunks: int, n_ctx: int, n_vocab: int,
                    noise: dict[str, float]) -> tuple[dict[str, str], Path]:
    """Replayed 'models' over the same windows in `d`: the reference R and one candidate per entry of `noise`, R's
    logits plus Gaussian noise of that size; and a corpus file that tokenizes into the windows."""
    replay_backend.register()
    rng = np.random.default_rng(seed)
    windows = make_tokens(rng, n_chunks, n_ctx, n_vocab)
    ref = np.stack([realistic_logits(rng, n_ctx, n_vocab) for _ in range(n_chunks)])
    corpus = d / "ids.txt"
    corpus.write_text(replay_backend.corpus_text(windows))
    models = {"R": ref, **{name: perturb(rng, ref, sigma) for name, sigma in noise.items()}}
    return {name: str(replay_backend.save_replay(d / f"{name}.npz", windows, x)) for name, x in models.items()}, corpus


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """The reference R, candidates A and B (B noisier), and B2, another model for B's label."""
    return replayed_models(tmp_path_factory.mktemp("models"), 11, N, N_CTX, V, {"A": 0.3, "B": 1.0, "B2": 2.0})


@pytest.fixture(autouse=True)
def planned_as_replayed(request, monkeypatch):
    """A matrix plans a pair from its GGUF's facts (whether a saved result or store answers it); a replayed model
    is no GGUF: its facts and settings are planned here as the replay backend records them (not for real models)."""
    import hashlib

    if "models" in request.fixturenames:
        return

    def facts(path):
        return {"file_name": Path(path).name, "fingerprint": hashlib.sha256(Path(path).read_bytes()).hexdigest()}

    def fields(facts, settings, n_ctx):  # ReplayBackend's kv_rotation, numerics and batch sizes
        return {"kv": settings.validate().kv_block({"k": False, "v": False}), "numerics": {"replayed": True},
                "n_batch": n_ctx, "n_ubatch": n_ctx}

    monkeypatch.setattr(matrix, "model_facts", facts)
    monkeypatch.setattr(matrix, "planned_fields", fields)


def matrix_request(replayed, directory: Path, b: str = "B", **kw) -> matrix.MatrixRequest:
    models, corpus = replayed
    pairs = (("A", models["A"], "f16"), ("B", models[b], "f16"))
    return matrix.MatrixRequest(ref_label="R", ref_path=models["R"], pairs=pairs, directory=directory, n_ctx=N_CTX,
                                corpus=str(corpus), engine=REPLAY, **kw)


def run(replayed, directory: Path, **kw) -> tuple[dict, str]:
    return sweep.run_matrix(matrix_request(replayed, directory, **kw), progress=False)


@pytest.fixture(scope="module")
def uninterrupted(replayed, tmp_path_factory):
    d = tmp_path_factory.mktemp("uninterrupted")
    run(replayed, d)
    return d


@pytest.fixture
def decoded(monkeypatch):
    """Windows each replayed model decodes (its file name -> count): the forward passes a run spends."""
    counts: dict[str, int] = {}
    real = replay_backend.ReplayBackend.iter_calls

    def counting(self, windows, scored=None):
        name = Path(self.facts["file_name"]).stem
        for call in real(self, windows, scored):
            counts[name] = counts.get(name, 0) + len(call)
            yield call

    monkeypatch.setattr(replay_backend.ReplayBackend, "iter_calls", counting)
    return counts


def without_paths(summary: dict) -> dict:
    out = dict(summary)
    out.pop("per_token_file", None)
    for side in ("reference", "candidate"):
        out[side] = {k: v for k, v in out[side].items() if k != "path"}
    return out


def assert_same_result(a_dir: Path, b_dir: Path, label: str) -> None:
    """Every per-token array and the whole summary (but where its files are) bit for bit."""
    a = results.load_result(a_dir / "results" / f"{label}.vs.R.json")
    b = results.load_result(b_dir / "results" / f"{label}.vs.R.json")
    assert without_paths(a.summary.to_json()) == without_paths(b.summary.to_json())
    assert list(a.per_token) == list(b.per_token)
    for k in a.per_token:
        assert a.per_token[k].dtype == b.per_token[k].dtype
        np.testing.assert_array_equal(a.per_token[k], b.per_token[k], err_msg=k)


def run_killed(replayed, directory: Path, label: str, chunks: int) -> None:
    """Run a matrix whose pair `label` dies (an exception no one catches, as a kill) once its checkpoint holds
    `chunks` chunks."""
    real = checkpoint.Checkpoint.append

    def append(self, index, columns):
        real(self, index, columns)
        if self.path.name.startswith(f"{label}.vs.") and len(self.parts) == chunks:
            raise KeyboardInterrupt("killed")

    with pytest.MonkeyPatch.context() as mp, pytest.raises(KeyboardInterrupt):
        mp.setattr(checkpoint.Checkpoint, "append", append)
        run(replayed, directory)


# --------------------------------------------------------------------------------------------------
# no candidate logits by default
# --------------------------------------------------------------------------------------------------
def test_pairs_keep_no_logits_and_write_under_1kb_per_scored_token(replayed, tmp_path, monkeypatch, decoded):
    """Everything a pair writes: its checkpoint (measured at its largest, just before it is removed: it only grows)
    and its result; nothing else lands in the runs directory but the reference's store."""
    largest: dict[str, int] = {}
    real_remove = checkpoint.Checkpoint.remove

    def remove(self):
        largest[self.path.name] = self.size
        real_remove(self)

    monkeypatch.setattr(checkpoint.Checkpoint, "remove", remove)
    result, _ = run(replayed, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["R.qeval", "results"]
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == [
        "A.vs.R.json", "A.vs.R.npz", "B.vs.R.json", "B.vs.R.npz"]
    assert decoded == {"R": N, "A": N, "B": N}  # one forward pass per window and model
    for label in ("A", "B"):
        tokens = next(r["scored_tokens"] for r in result["results"] if r["candidate"]["label"] == label)
        written = largest[f"{label}.vs.R{checkpoint.SUFFIX}"] + sum(
            (tmp_path / "results" / f"{label}.vs.R{ext}").stat().st_size for ext in (".json", ".npz"))
        per_token = written / tokens
        print(f"{label}: {written} bytes for {tokens} scored tokens: {per_token:.0f} bytes per token")
        assert per_token <= 1024
        assert result["results"][0]["candidate"]["path"].endswith("(live)")


def test_live_pairs_read_float32_rows_as_qeval_kld_does(replayed, uninterrupted, tmp_path):
    """A pair's numbers are `qeval kld --cand MODEL`'s (the uncoded live path), per token."""
    models, _ = replayed
    with StoreReader(uninterrupted / "R.qeval") as ref:
        from qeval.capture.capture import open_live
        from qeval.compare import metrics

        engine, live = open_live(models["B"], ref, None, REPLAY, "B", None)
        try:
            direct = metrics.compare(ref, live, threads=1).per_token
        finally:
            live.close()
            engine.close()
    saved = results.load_result(uninterrupted / "results" / "B.vs.R.json").per_token
    for k in direct:
        np.testing.assert_array_equal(saved[k], direct[k], err_msg=k)


# --------------------------------------------------------------------------------------------------
# a killed pair continues from its checkpoint
# --------------------------------------------------------------------------------------------------
def test_a_killed_pair_resumes_to_the_uninterrupted_numbers(replayed, uninterrupted, tmp_path, monkeypatch, decoded):
    run_killed(replayed, tmp_path, "B", 3)
    assert_same_result(uninterrupted, tmp_path, "A")  # finished before the kill: kept
    assert not (tmp_path / "results" / "B.vs.R.json").exists()
    partial = tmp_path / "results" / f"B.vs.R{checkpoint.SUFFIX}"
    assert checkpoint.chunks_in(partial) == 3
    with open(partial, "ab") as fh:  # a record torn by the kill: dropped on reading
        fh.write(b"CHNK\x40\x00\x00\x00\x00\x00\x00\x00torn")

    decoded.clear()
    _, text = run(replayed, tmp_path)
    assert "A: done earlier, skipped" in text
    assert "B: resumed: 3 of 6 chunks read back from its checkpoint" in text
    assert decoded == {"B": N - 3}  # only the chunks its checkpoint lacked
    assert_same_result(uninterrupted, tmp_path, "B")
    assert not partial.exists()  # the result holds it all now


def test_more_chunks_grow_the_reference_and_extend_each_saved_result(replayed, uninterrupted, tmp_path, decoded):
    """A matrix run again over more chunks (the demo after --chunks 3) runs only the new windows: the reference store
    grows and each pair's saved result seeds its checkpoint, to the numbers of a run over every chunk at once."""
    run(replayed, tmp_path, chunks=3)
    decoded.clear()
    _, text = run(replayed, tmp_path)
    assert f"A: 3 of {N} chunks reused from its saved result" in text and "B: 3 of" in text
    assert decoded == {"R": N - 3, "A": N - 3, "B": N - 3}
    for label in ("A", "B"):
        assert_same_result(tmp_path, uninterrupted, label)


def test_a_checkpoint_of_another_request_is_never_resumed(replayed, tmp_path, monkeypatch, decoded):
    run_killed(replayed, tmp_path, "B", 2)
    decoded.clear()
    _, text = run(replayed, tmp_path, b="B2")  # B's label now names another model
    assert re.search(r"B: its checkpoint answers another request \(candidate model fingerprint: \w+… vs \w+…, saved "
                     r"vs now\): started over", text), text
    assert decoded == {"B2": N}
    other = tmp_path / "other"
    run(replayed, other, b="B2")
    assert_same_result(other, tmp_path, "B")


def test_a_pair_visits_given_chunks_in_order_and_stops_with_its_checkpoint_whole(replayed, uninterrupted, tmp_path,
                                                                                 decoded):
    """The seam of decided-early boards: run_pair over chunks in another order, stopped after a few; then the full
    run extends it (only the chunks missing are run) and gives the uninterrupted numbers."""
    run(replayed, tmp_path)
    (tmp_path / "results" / "B.vs.R.json").unlink()
    plan = matrix.plan_matrix(matrix_request(replayed, tmp_path))
    _, pairs = matrix.plan_pairs(plan)
    pair = next(p for p in pairs if p.label == "B")
    seen = []
    decoded.clear()
    with StoreReader(tmp_path / "R.qeval") as ref:
        stopped = matrix.run_pair(pair, ref, N, tmp_path, 1, order=[4, 1, 5, 0, 2, 3],
                                  stop=lambda parts: seen.append(list(parts)) or len(parts) == 3)
        assert stopped.result is None and stopped.chunks == 3
        assert seen == [[], [4], [4, 1], [4, 1, 5]] and decoded == {"B": 3}  # asked before the first chunk too
        assert checkpoint.chunks_in(tmp_path / "results" / f"B.vs.R{checkpoint.SUFFIX}") == 3
        done = matrix.run_pair(pair, ref, N, tmp_path, 1)
    assert done.resumed_chunks == 3 and decoded == {"B": N}
    assert_same_result(uninterrupted, tmp_path, "B")


# --------------------------------------------------------------------------------------------------
# --keep-logits, stored pairs and samplers
# --------------------------------------------------------------------------------------------------
def test_keep_logits_keeps_the_stores_and_a_stored_pair_is_compared_again(replayed, uninterrupted, tmp_path,
                                                                          decoded):
    run(replayed, tmp_path, keep_logits=True)
    for label in ("A", "B"):
        with StoreReader(tmp_path / f"{label}.qeval") as store:
            assert store.complete and store.header.label == label
        stored, _ = api.kld_report("R", label, runs_dir=tmp_path, threads=1)  # store vs store: the same numbers
        saved = json.loads((tmp_path / "results" / f"{label}.vs.R.json").read_text())
        assert stored["kld"] == saved["kld"] and stored["request"] == saved["request"]
        # the coded candidate differs from the float32 one by the code's error only
        plain = json.loads((uninterrupted / "results" / f"{label}.vs.R.json").read_text())
        assert saved["request"] == plain["request"]
        assert saved["kld"]["mean"] == pytest.approx(plain["kld"]["mean"], rel=1e-3)
    kept = results.load_result(tmp_path / "results" / "B.vs.R.json")
    for label in ("A", "B"):
        (tmp_path / "results" / f"{label}.vs.R.json").unlink()
    decoded.clear()
    run(replayed, tmp_path)  # without --keep-logits: the complete stores are compared, no model is run
    assert "A" not in decoded and "B" not in decoded
    again = results.load_result(tmp_path / "results" / "B.vs.R.json")
    for k in kept.per_token:
        np.testing.assert_array_equal(kept.per_token[k], again.per_token[k])
    # asked to keep logits, a pair whose result was saved without its store is run again for it
    other = tmp_path / "other"
    run(replayed, other)
    _, text = run(replayed, other, keep_logits=True)
    assert "B: run again to keep its logits (--keep-logits): its result was saved without its store" in text
    assert (other / "B.qeval").is_file()


def test_an_interrupted_keep_logits_store_is_named_not_used(replayed, tmp_path):
    run(replayed, tmp_path, keep_logits=True)
    store = tmp_path / "B.qeval"
    store.write_bytes(store.read_bytes()[:-200])  # an interrupted capture: no index, no trailer
    (tmp_path / "results" / "B.vs.R.json").unlink()
    _, text = run(replayed, tmp_path)
    assert f"B: its store {store} is incomplete: left as it is, not used (--keep-logits replaces or resumes it)" in text


def test_a_sampler_that_reads_the_distribution_codes_the_rows_and_only_then(replayed, tmp_path, monkeypatch):
    """A non-greedy sampler reads codes: the live rows are coded (not saved), giving the numbers of the stored
    candidate exactly; a greedy one reads only argmaxes: the rows stay float32, as without samplers."""
    from qeval.capture import capture as capture_mod

    coded = []
    real = capture_mod.LiveSource.__init__

    def init(self, *args, **kw):
        real(self, *args, **kw)
        coded.append(self.coded)

    monkeypatch.setattr(capture_mod.LiveSource, "__init__", init)
    sampled = tmp_path / "sampled"
    run(replayed, sampled, samplers=("temp=0.6,top_k=20,top_p=0.95",))
    assert coded == [True, True]
    stored = tmp_path / "stored"
    run(replayed, stored, samplers=("temp=0.6,top_k=20,top_p=0.95",), keep_logits=True)
    assert_same_result(sampled, stored, "B")
    coded.clear()
    run(replayed, tmp_path / "greedy", samplers=("greedy",))
    assert coded == [False, False]


# --------------------------------------------------------------------------------------------------
# a full disk
# --------------------------------------------------------------------------------------------------
def test_the_checkpoint_drops_a_failed_write_and_keeps_every_chunk_before(tmp_path):
    ident = {"request": {"x": 1}, "rows": "float32"}
    path = tmp_path / f"P.vs.R{checkpoint.SUFFIX}"
    cols = {"kld": np.arange(5, dtype=np.float64), "same_top1": np.array([1, 0, 1, 1, 0], dtype=bool)}
    with contextlib.closing(checkpoint.Checkpoint(path, ident)) as ckpt:
        ckpt.append(0, cols)
        size = path.stat().st_size
        with pytest.MonkeyPatch.context() as mp, pytest.raises(QevalError, match="full") as exc:
            mp.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
            ckpt.append(1, cols)
        assert exc.value.errno == errno.ENOSPC and exc.value.size > 0
        assert path.stat().st_size == size  # cut back to its last whole chunk
        ckpt.append(2, cols)
    with contextlib.closing(checkpoint.Checkpoint(path, ident)) as again:
        assert list(again.parts) == [0, 2] and again.note == ""
        for k in cols:
            np.testing.assert_array_equal(again.parts[2][k], cols[k])
            assert again.parts[2][k].dtype == cols[k].dtype


def test_a_pairs_write_error_survives_pickling(tmp_path):
    """A Ray task's error travels pickled: its message and figures must come back whole."""
    err = matrix.PairWriteFailed("", tmp_path / "x", errno.ENOSPC, 10, head="matrix pair B: no space", kept="k",
                                 needed=5000, pair_bytes=9000)
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and (back.needed, back.pair_bytes, back.errno) == (5000, 9000, errno.ENOSPC)
    assert back.text(2, 1) == err.text(2, 1) == (
        "matrix pair B: no space: it needs about 5 kB more to finish, and the 2 pairs after it about 18 kB "
        "(23 kB in all); the 1 pair finished before it and k are kept: free space and re-run the same command to "
        "continue where it stopped")


def test_a_full_disk_at_the_first_pair_counts_the_pairs_after_it(replayed, tmp_path):
    with pytest.MonkeyPatch.context() as mp, pytest.raises(QevalError) as exc:
        _failing_fsync(mp, f"A.vs.R{checkpoint.SUFFIX}", 2)  # 1: its header, 2: its first chunk
        run(replayed, tmp_path)
    assert re.fullmatch(r"matrix pair A: no space left on device writing \S+A\.vs\.R\.partial: it needs about "
                        r"[\d.]+ kB more to finish, and the 1 pair after it about [\d.]+ kB \([\d.]+ kB in all\); "
                        r"its checkpoint \(0 of 6 chunks\) is kept: free space and re-run the same command to "
                        r"continue where it stopped", str(exc.value)), str(exc.value)


def test_another_write_fault_names_no_size(replayed, tmp_path):
    with pytest.MonkeyPatch.context() as mp, pytest.raises(QevalError) as exc:
        _failing_fsync(mp, f"B.vs.R{checkpoint.SUFFIX}", 3, errno.EIO)
        run(replayed, tmp_path)
    assert str(exc.value) == (f"matrix pair B: writing {tmp_path / 'results' / 'B.vs.R.partial'} failed "
                              "(Input/output error); the 1 pair finished before it and its checkpoint (1 of 6 chunks) "
                              "are kept: fix that and re-run the same command to continue where it stopped")


def test_a_full_disk_at_a_result_names_the_pair_and_the_next_run_needs_no_model(replayed, uninterrupted, tmp_path,
                                                                              decoded):
    real = np.savez_compressed

    def full(fh, **arrays):
        if "B.vs.R" in getattr(fh, "name", ""):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fh, **arrays)

    with pytest.MonkeyPatch.context() as mp, pytest.raises(QevalError) as exc:
        mp.setattr(results.np, "savez_compressed", full)
        run(replayed, tmp_path)
    msg = str(exc.value)
    assert msg.startswith(f"matrix pair B: no space left on device writing {tmp_path / 'results' / 'B.vs.R.json'}: "
                          "it needs about ")
    assert msg.endswith("; the 1 pair finished before it and its checkpoint (6 of 6 chunks) are kept: free space and "
                        "re-run the same command to continue where it stopped")
    assert not list((tmp_path / "results").glob("*.part"))
    decoded.clear()
    _, text = run(replayed, tmp_path)
    assert decoded == {} and "B: resumed: 6 of 6 chunks read back from its checkpoint" in text
    assert_same_result(uninterrupted, tmp_path, "B")


def _failing_fsync(monkeypatch, name: str, nth: int, code: int = errno.ENOSPC):
    """os.fsync fails (a full disk) on the nth sync of the file called `name` (the write before it reached the
    file: the writer must cut it back)."""
    real, counter = os.fsync, {}

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(name):
            counter[name] = counter.get(name, 0) + 1
            if counter[name] == nth:
                raise OSError(code, os.strerror(code))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_full_disk_mid_matrix_through_the_cli(models, tmp_path):
    """Q8_0 reference, Q4_0 then Q2_K, 3 chunks of 64: the disk fills while Q2_K's second chunk is checkpointed.
    One message naming the pair and the bytes it (and none after it) needs, exit 2, Q4_0's result kept, Q2_K's
    first chunk kept; the same command again finishes with the uninterrupted run's numbers."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to tell which file is synced")

    def matrix_cli(runs: Path):
        return run_cli("matrix", "--ref", f"Q8_0={models['Q8_0']}", "-m", f"Q4_0={models['Q4_0']}", "-m",
                       f"Q2_K={models['Q2_K']}", "-c", "64", "--chunks", "3", "--no-control", "--floor", "none",
                       "-t", "2", "--runs-dir", runs)

    whole = matrix_cli(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    runs = tmp_path / "runs"
    with pytest.MonkeyPatch.context() as mp:
        _failing_fsync(mp, f"Q2_K.vs.Q8_0{checkpoint.SUFFIX}", 3)  # 1: its header, 2: chunk 0, 3: chunk 1
        full = matrix_cli(runs)
    msg = assert_cli_error(full, "matrix pair Q2_K: no space left on device writing",
                           f"Q2_K.vs.Q8_0{checkpoint.SUFFIX}", "more to finish",
                           "the 1 pair finished before it and its checkpoint", "(1 of 3 chunks) are kept",
                           "re-run the same command")
    assert full.returncode == 2 and len(msg.strip().splitlines()) == 1
    needed = re.search(r"it needs about ([\d.]+) (bytes|kB|MB) more to finish;", msg)
    assert needed, msg
    print("qeval: error:" + msg.rstrip())
    assert checkpoint.chunks_in(runs / "results" / f"Q2_K.vs.Q8_0{checkpoint.SUFFIX}") == 1
    saved = (runs / "results" / "Q4_0.vs.Q8_0.npz").read_bytes()
    again = matrix_cli(runs)
    assert again.returncode == 0, again.stderr
    assert "Q4_0: done earlier, skipped" in again.stdout
    assert "Q2_K: resumed: 1 of 3 chunks read back from its checkpoint" in again.stdout
    assert (runs / "results" / "Q4_0.vs.Q8_0.npz").read_bytes() == saved
    # what it needed: two chunks more in its checkpoint (about one's bytes each) and its result; "about"
    wrote = sum((runs / "results" / f"Q2_K.vs.Q8_0{ext}").stat().st_size for ext in (".json", ".npz"))
    estimate = float(needed[1]) * {"bytes": 1, "kB": 1e3, "MB": 1e6}[needed[2]]
    print(f"estimated {estimate:.0f} bytes, the result alone {wrote}")
    assert wrote <= estimate <= 4 * wrote
    for label in ("Q4_0", "Q2_K"):
        a = results.load_result(tmp_path / "whole" / "results" / f"{label}.vs.Q8_0.json")
        b = results.load_result(runs / "results" / f"{label}.vs.Q8_0.json")
        assert without_paths(a.summary.to_json()) == without_paths(b.summary.to_json())
        for k in a.per_token:
            np.testing.assert_array_equal(a.per_token[k], b.per_token[k], err_msg=k)
    assert [p.name for p in runs.glob("*.qeval")] == ["Q8_0.qeval"]  # no candidate logits
