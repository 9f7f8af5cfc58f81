"""Lean hidden pieces (store format 7) and `qeval certify`, on Gemma-3-270M's real head and logits.

A capture keeps a hidden piece lean where llama.cpp's own kernel (ggml) gives its logits again here: no portable
replay. Here it reads as a full piece does; elsewhere it is refused with a message naming `qeval certify`, which
makes it the piece a capture that replayed portably would have written, field for field.
"""

from __future__ import annotations

import dataclasses
import shutil
from contextlib import closing

import numpy as np
import pytest
from conftest import assert_cli_error, run_cli
from test_hidden_form import HiddenCapture

from qeval.capture.capture import CaptureSpec, capture
from qeval.engine.engine import EngineSettings
from qeval.errors import QevalError, StoreFormatError
from qeval.orchestrate import certify
from qeval.storage import store as store_module
from qeval.storage.store import ChunkData, HiddenChunk, StoreReader, StoreWriter


def pieces(path) -> list[ChunkData]:
    with closing(StoreReader(path)) as reader:
        return [piece for index in reader.chunk_indices for piece in reader.iter_pieces(index)]


def reads(path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every chunk's coded planes and uncoded rows, as comparisons read them (copied: a logits piece's reader
    yields views of one buffer)."""
    with closing(StoreReader(path)) as reader:
        chunks = [reader.read_chunk(index) for index in reader.chunk_indices]
        n_vocab = reader.header.n_vocab
        return ([np.concatenate([b.copy() for _, b in c.iter_planes(n_vocab)]) for c in chunks],
                [np.stack([row.copy() for _, row, _ in c.iter_rows(n_vocab)]) for c in chunks])


def fields(piece: ChunkData) -> dict:
    """What a piece's record holds, field by field (the hidden rows' zstd frame included)."""
    arrays = lambda record: {k: v for k, v in vars(record).items() if isinstance(v, np.ndarray)}  # noqa: E731
    return {"frame": bytes(piece.codes_zst), "scalars": (piece.logprob_target, piece.logprob_max, piece.top_ids),
            "error": arrays(piece.error), "checksum": getattr(piece, "replay_checksum", None),
            "replays": [(r.engine, r.checksum, arrays(r.record)) for r in getattr(piece, "replays", ())]}


def assert_same(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    else:
        assert a == b


@pytest.fixture(scope="module")
def captured(models, tmp_path_factory):
    """One window of Gemma-3-270M Q8_0 captured twice with auto: lean (the default) and with the portable replay."""
    folder = tmp_path_factory.mktemp("certify")
    out = {}
    for name, lean in (("lean", True), ("full", False)):
        spec = CaptureSpec(model=str(models["Q8_0"]), out=str(folder / f"{name}.qeval"), label=name, chunks=1,
                           reference_form="auto", lean=lean, settings=EngineSettings(n_threads=2))
        capture(spec)
        out[name] = folder / f"{name}.qeval"
    return out


@pytest.fixture
def lean_copy(captured, tmp_path):
    path = tmp_path / "ref.qeval"
    shutil.copy(captured["lean"], path)
    return path


@pytest.fixture
def elsewhere(monkeypatch):
    """A machine whose ggml does not sum as the capturing one's: no ggml replay at hand."""
    monkeypatch.setattr(StoreReader, "_ggml_head", property(lambda self: None))


def test_a_lean_capture_reads_here_as_a_full_one_and_certifies_into_it(captured, lean_copy):
    lean, full = pieces(captured["lean"]), pieces(captured["full"])
    assert all(isinstance(p, HiddenChunk) and p.lean and [r.engine for r in p.replays] == ["ggml"] for p in lean)
    assert all(not p.lean and [r.engine for r in p.replays] == ["ggml", "portable"] for p in full)
    (lean_planes, lean_rows), (full_planes, full_rows) = reads(captured["lean"]), reads(captured["full"])
    assert_same(lean_rows, full_rows)  # uncoded: ggml's rows, llama.cpp's logits, in both
    # coded: the lean piece codes those rows themselves, the full one its portable replay: a few codes move
    assert all(0 < np.count_nonzero(a != b) < a.size // 1000 for a, b in zip(lean_planes, full_planes))

    res = certify.certify_store(lean_copy)
    assert (res.lean_pieces, res.kept_hidden, res.coded) == (len(lean), len(lean), 0)
    assert_same([fields(p) for p in pieces(lean_copy)], [fields(p) for p in full])
    assert_same(reads(lean_copy), (full_planes, full_rows))
    with closing(StoreReader(lean_copy)) as certified, closing(StoreReader(captured["lean"])) as original:
        assert certified.header == original.header  # the measurement and its identity are untouched
    assert certify.certify_store(lean_copy).lean_pieces == 0  # nothing left to do


def test_a_lean_piece_elsewhere_names_certify_and_certified_it_reads_there(captured, lean_copy, elsewhere):
    with pytest.raises(StoreFormatError, match=r"is lean.*qeval certify"):
        reads(lean_copy)
    before = lean_copy.read_bytes()
    with pytest.raises(StoreFormatError, match="is lean"):  # certified only where ggml gives the capture's rows
        certify.certify_store(lean_copy)
    assert lean_copy.read_bytes() == before and [p.name for p in lean_copy.parent.iterdir()] == ["ref.qeval"]
    shutil.copy(captured["full"], lean_copy)  # as certified (the test above): the portable replay reads anywhere
    planes, rows = reads(lean_copy)
    assert_same(planes, reads(captured["full"])[0])


def test_an_auto_piece_whose_portable_replay_misses_is_coded_as_logits(captured, lean_copy, monkeypatch):
    monkeypatch.setattr(certify, "AUTO_REPLAY_KL", 0.0)  # every portable replay misses
    lean_planes, lean_rows = reads(lean_copy)
    lean = pieces(lean_copy)
    res = certify.certify_store(lean_copy)
    assert (res.kept_hidden, res.coded) == (0, len(lean))
    coded = pieces(lean_copy)
    assert all(type(p) is ChunkData for p in coded)
    for a, b in zip(coded, lean):  # the exact rows' codes, their error record and the scalars, as the lean piece's
        assert_same((a.logprob_target, a.logprob_max, a.top_ids), (b.logprob_target, b.logprob_max, b.top_ids))
        assert_same(fields(a)["error"], fields(b)["error"])
    assert_same(reads(lean_copy)[0], lean_planes)


def test_a_version_6_store_holds_no_lean_piece(captured, tmp_path, monkeypatch):
    """A file qeval's writer would not make (it refuses a lean piece there): the reader trusts nothing."""
    with closing(StoreReader(captured["lean"])) as reader, monkeypatch.context() as patched:
        patched.setattr(store_module, "LEAN_VERSION", 6)
        header = dataclasses.replace(reader.header, format_version=6)
        with StoreWriter.open(tmp_path / "v6.qeval", header, reader.tokens, reader.lut,
                              head=reader.output_head) as writer:
            for index in reader.chunk_indices:
                for piece in reader.iter_pieces(index):
                    writer.write_chunk(piece)
            writer.finish()
    with pytest.raises(StoreFormatError, match="no portable replay, which every hidden piece of a version 6"):
        pieces(tmp_path / "v6.qeval")


def test_certify_refuses_an_incomplete_store_and_the_cli_says_what_it_did(captured, lean_copy, tmp_path):
    partial = tmp_path / "partial.qeval"
    HiddenCapture(seed=3).write(partial, finish=False)
    with pytest.raises(QevalError, match="incomplete"):
        certify.certify_store(partial)
    assert "lean       : 1 hidden pieces replayed by llama.cpp's own kernel only" in run_cli("info", lean_copy).stdout
    res = run_cli("certify", lean_copy)
    assert res.returncode == 0 and f"certified {lean_copy}: 1 lean pieces now read on any machine" in res.stdout
    assert "holds no lean piece" in run_cli("certify", lean_copy).stdout
    assert "lean       :" not in run_cli("info", lean_copy).stdout
    assert_cli_error(run_cli("certify", tmp_path / "none.qeval"), "none.qeval")
    assert_cli_error(run_cli("certify", "hf:someone/ref"), "certified already")


def test_a_version_6_store_resumed_or_grown_gets_no_lean_piece(models, captured, tmp_path):
    """A capture that resumes (or grows) a store of version 6, made before lean pieces, writes full pieces: a lean
    one would make it unreadable there. The writer refuses a lean piece in such a store outright."""
    with closing(StoreReader(captured["lean"])) as reader:
        header = dataclasses.replace(reader.header, format_version=6)
        lean_piece = next(reader.iter_pieces(0))
        with StoreWriter.open(tmp_path / "lean.qeval", header, reader.tokens, reader.lut,
                              head=reader.output_head) as writer:
            with pytest.raises(ValueError, match="a lean piece in a version 6 store"):
                writer.write_chunk(lean_piece)
    with closing(StoreReader(tmp_path / "lean.qeval", tolerate_torn_tail=True)) as started:
        assert not started.complete and not started.chunk_indices  # started, nothing written
    spec = CaptureSpec(model=str(models["Q8_0"]), out=str(tmp_path / "lean.qeval"), label="lean", chunks=1,
                       reference_form="auto", settings=EngineSettings(n_threads=2))
    assert capture(spec).chunks_written == 1
    (piece,) = pieces(tmp_path / "lean.qeval")
    assert not piece.lean and [r.engine for r in piece.replays] == ["ggml", "portable"]
    with closing(StoreReader(tmp_path / "lean.qeval")) as resumed:
        assert resumed.header.format_version == 6
