"""qeval's GGUF reader (storage/gguf_file.py) against gguf-py's GGUFReader: every field's value, every tensor's
name, shape, type, size and bytes, on files gguf-py writes (every value type, both byte orders) and on a real model;
files it cannot read get one message naming them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from qeval.errors import QevalError
from qeval.storage.gguf_file import read_gguf


def write_every_kind(path: Path, endianess=gguf.GGUFEndian.LITTLE) -> Path:
    writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
    writer.add_uint8("k.u8", 200)
    writer.add_int8("k.i8", -5)
    writer.add_uint16("k.u16", 60000)
    writer.add_int16("k.i16", -30000)
    writer.add_uint32("k.u32", 4_000_000_000)
    writer.add_int32("k.i32", -2_000_000_000)
    writer.add_float32("k.f32", 1.5)
    writer.add_uint64("k.u64", 2**63 + 7)
    writer.add_int64("k.i64", -(2**62))
    writer.add_float64("k.f64", -2.25e-300)
    writer.add_bool("k.bool", True)
    writer.add_string("k.str", "naïve | text ✓")
    writer.add_array("k.strings", ["a", "", "ünïcode", "x" * 300])
    writer.add_array("k.ints", [1, -2, 3])
    writer.add_array("k.floats", [0.5, -1.25])
    writer.add_array("k.bools", [True, False])
    writer.add_uint32("general.alignment", 64)
    rng = np.random.default_rng(0)
    writer.add_tensor("t.f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("t.f16", rng.standard_normal((2, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("t.q8_0", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_same_as_gguf_py(path: Path):
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    expected = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert list(ours.fields) == list(expected)
    for key, value in expected.items():
        assert ours.fields[key] == value, key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.shape, a.type_name) == (b.name, tuple(int(x) for x in b.shape), b.tensor_type.name)
        assert (a.n_elements, a.n_bytes, a.offset) == (int(b.n_elements), int(b.n_bytes), int(b.data_offset))
        assert np.array_equal(ours.tensor_bytes(a), np.ascontiguousarray(b.data).view(np.uint8).reshape(-1))
    return ours


@pytest.mark.parametrize("order", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little", "big"])
def test_every_value_type_and_tensor_reads_as_gguf_py_reads_it(tmp_path, order):
    ours = assert_same_as_gguf_py(write_every_kind(tmp_path / "every.gguf", order))
    assert ours.field("k.u64") == 2**63 + 7 and ours.field("k.strings")[2] == "ünïcode"
    assert ours.field("no.such.key") is None
    if order == gguf.GGUFEndian.LITTLE:  # float tensors as values (gguf-py gives big-endian data unswapped)
        f16 = next(t for t in ours.tensors if t.name == "t.f16")
        assert ours.float_values(f16).dtype == np.float32 and ours.float_values(f16).shape == (64,)
        q8 = next(t for t in ours.tensors if t.name == "t.q8_0")
        with pytest.raises(QevalError, match="t.q8_0 is Q8_0, not F32 or F16"):
            ours.float_values(q8)


def test_a_real_model_reads_as_gguf_py_reads_it(models):
    ours = assert_same_as_gguf_py(models["Q8_0"])
    assert len(ours.field("tokenizer.ggml.tokens")) == 262_144


@pytest.mark.parametrize("damage", ["empty", "magic", "version", "truncated-fields", "truncated-tensor"])
def test_a_file_that_is_no_readable_gguf_gets_one_message(tmp_path, damage):
    data = bytearray(write_every_kind(tmp_path / "good.gguf").read_bytes())
    if damage == "empty":
        data = bytearray()
    elif damage == "magic":
        data[:4] = b"GGML"
    elif damage == "version":
        data[4:8] = (9).to_bytes(4, "little")
    elif damage == "truncated-fields":
        data = data[:200]
    else:
        data = data[:-100]  # past the padding after the last tensor
    path = tmp_path / f"{damage}.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(QevalError, match=f"{damage}.gguf is not a readable GGUF file"):
        read_gguf(path)
