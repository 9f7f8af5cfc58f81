"""Hand-written deployment records for board tests: JSON files in the schema of docs/deployment-format.md (version 1,
RUNS_DIR/deployment/<label>.<machine id, 12 digits>.json), read by the real reader (qeval.storage.deployment).

Every figure is chosen here; what a test expects is computed from these numbers, never by the code under test.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MIB = 2**20


def machine(cpu: str = "AMD EPYC 9B14", gpus: tuple = (), backend: str = "CPU", cores: int = 2) -> dict:
    """A machine block whose id is the sha256 of the canonical JSON of its other fields."""
    facts = {"cpu": cpu, "cpu_flags": ["avx2", "avx512f"], "cores": cores, "gpus": list(gpus), "backend": backend,
             "llama_cpp": {"version": "0.3.36", "system_info": "CPU : AVX2 = 1 | AVX512 = 1"}}
    return {"id": hashlib.sha256(json.dumps(facts, sort_keys=True, separators=(",", ":")).encode()).hexdigest(),
            **facts}


def memory_entry(n_ctx: int, parts: dict[str, float] | str, device: str = "CPU") -> dict:
    """A memory entry at n_ctx: parts in MiB ({"model": 270, "kv": 12, "compute": 500}) on one device, or the
    sentence of a context that could not be made."""
    if isinstance(parts, str):
        return {"n_ctx": n_ctx, "layout": None, "devices": None, "total_bytes": None, "formula": None,
                "rss_growth_bytes": None, "error": parts}
    devices = {device: {k: int(v * MIB) for k, v in parts.items()}}
    total = sum(devices[device].values())
    return {"n_ctx": n_ctx, "layout": "unified, SWA layers at their window (llama.cpp tools default)",
            "devices": devices, "total_bytes": total, "formula": {"kv": devices[device].get("kv"), "recurrent": 0},
            "rss_growth_bytes": total + 7 * MIB, "error": None}


def speed_entry(test: str, tokens: int, depth: int, tps: float | str, spread: float | None = 0.04) -> dict:
    """A speed entry: its median tokens/s (min and max spread around it), or the sentence of a test that failed."""
    if isinstance(tps, str):
        return {"test": test, "tokens": tokens, "depth": depth, "reps": 5, "tokens_per_s": None, "spread": None,
                "error": tps}
    low, high = tps * (1 - (spread or 0) / 2), tps * (1 + (spread or 0) / 2)
    return {"test": test, "tokens": tokens, "depth": depth, "reps": 5,
            "tokens_per_s": {"median": tps, "min": low, "max": high, "values": [low, tps, tps, tps, high]},
            "spread": spread, "error": None}


def record_json(label: str, fingerprint: str, type_kv: str, on: dict, memory: list[dict], speed: list[dict],
                threads: int = 2) -> dict:
    return {"format": "qeval-deployment", "version": 1, "label": label,
            "model": {"fingerprint": fingerprint, "file_name": f"{label}.gguf", "size_bytes": 123},
            "kv": {"type_k": type_kv, "type_v": type_kv, "flash_attn": "auto", "rotation": {"k": False, "v": False}},
            "machine": on,
            "settings": {"threads": threads, "n_gpu_layers": 0, "n_batch": 2048, "n_ubatch": 512,
                         "flash_attn": "auto", "offload": None},
            "memory": memory, "speed": speed, "measured_at": "2026-11-26T14:00:00Z"}


def write_record(runs: Path, record: dict) -> Path:
    path = runs / "deployment" / f"{record['label']}.{record['machine']['id'][:12]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return path
