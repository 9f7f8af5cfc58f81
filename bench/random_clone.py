"""A GGUF with another GGUF's metadata and tensor shapes but random weights: the stand-in for a model that cannot
travel where it is measured (a lent GPU machine takes 64 MiB per call; Gemma-3-270M's quants are 220-280 MiB), for
figures that do not depend on the weights' values: the speed and memory of a dense model (issue 33's GPU table).
Its quality figures mean nothing and are never reported.

    python bench/random_clone.py skeleton SOURCE.gguf SKELETON.gguf   # every metadata key and the tensor list (MBs)
    python bench/random_clone.py expand SKELETON.gguf OUT-F16.gguf     # random weights: F32 vectors, F16 matrices
    python bench/random_clone.py expand SKELETON.gguf OUT-Q8_0.gguf --type Q8_0   # matrices in one type (gguf-py's
                                                                                     # quantizers: Q8_0, Q5_0, Q4_0...)

The skeleton holds no tensor data: its tensors' names and shapes travel as one metadata key (TENSORS). The expanded
model has the source's architecture, hyperparameters, tokenizer and tensor shapes; quantize it with llama.cpp's own
quantizer (qeval.orchestrate.demo.quantize) to the types being measured. Weights are N(0, 1/fan_in) (a matmul keeps
its input's size), norms are ones: speed and memory of a dense model depend on shapes and types alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gguf
import gguf.quants
import numpy as np

TENSORS = "qeval.random_clone.tensors"  # JSON [[name, ne (ggml order)], ...] of the source's tensors
BLOCK_ROWS = 4096


def skeleton(source: Path, out: Path) -> Path:
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[1] if len(field.types) > 1
                             else None)
    tensors = [[t.name, [int(n) for n in t.shape]] for t in reader.tensors]
    writer.add_string(TENSORS, json.dumps(tensors))
    return _finish(writer, out)


def expand(skeleton_path: Path, out: Path, seed: int = 0, matrix_type: str | None = None) -> Path:
    """The skeleton with random weights: vectors F32, matrices F16 or, with `matrix_type`, every matrix in that type
    (quantized by gguf-py, as llama.cpp's --pure quantization keeps one type)."""
    reader = gguf.GGUFReader(skeleton_path)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type", TENSORS):
            continue
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[1] if len(field.types) > 1
                             else None)
    qtype = getattr(gguf.GGMLQuantizationType, matrix_type) if matrix_type else None
    writer.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{matrix_type}") if matrix_type else
                         gguf.LlamaFileType.MOSTLY_F16)
    rng = np.random.default_rng(seed)
    for name, ne in json.loads(reader.fields[TENSORS].contents()):
        shape = tuple(reversed(ne))  # numpy's shape is ggml's ne reversed
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
            continue
        data = np.empty(shape, dtype=np.float16)
        rows = data.reshape(-1, shape[-1])
        for start in range(0, len(rows), BLOCK_ROWS):  # no float64 copy of a vocab-sized matrix
            block = rows[start:start + BLOCK_ROWS]
            block[...] = rng.normal(0.0, ne[0] ** -0.5, size=block.shape)
        if qtype is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)
    return _finish(writer, out)


def _finish(writer: gguf.GGUFWriter, out: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("skeleton", "expand"))
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", help="expand: every matrix in this type (Q8_0, Q5_0, Q4_0 ...), default F16")
    args = parser.parse_args(argv)
    done = skeleton(args.source, args.out) if args.step == "skeleton" else expand(args.source, args.out,
                                                                                   matrix_type=args.type)
    print(f"wrote {done} ({done.stat().st_size:,} bytes)")


if __name__ == "__main__":
    sys.exit(main())
