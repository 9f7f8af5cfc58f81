"""Deployment records: the speed and memory of one board row, measured on one machine (spec:
docs/deployment-format.md).

A record is one JSON file, RUNS_DIR/deployment/<label>.<machine id, 12 hex digits>.json, holding what llama.cpp
allocated at each deployment context (by buffer and component) and how fast it processed a prompt and generated
tokens at each depth, with the machine, the model and the settings they were measured with. A figure belongs to its
machine: a record is reused, and shown as measured, only where its machine id is the current machine's; this module
reads and writes records and says what a record answers, nothing more (the engine measures, orchestrate decides).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from qeval.errors import StoreFormatError, WriteFailed
from qeval.storage.runs import check_label

FORMAT = "qeval-deployment"
VERSION = 1
DEPLOYMENT_SUBDIR = "deployment"
MACHINE_ID_DIGITS = 12  # of the machine id, in a record's file name
COMPONENTS = ("model", "kv", "recurrent", "compute", "output")  # a device's buffers, as llama.cpp names their use
TESTS = ("pp", "tg")  # prompt processing (a prompt in batches), token generation (one token per call)


def machine_id(machine: dict) -> str:
    """sha256 of the canonical JSON of a machine block's fields other than `id`: equal only for equal machines."""
    fields = {k: v for k, v in machine.items() if k != "id"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class _Figure:
    """A figure's JSON is its fields (a field the JSON lacks: None)."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict):
        return cls(**{f.name: d.get(f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class MemoryFigure(_Figure):
    """What llama.cpp allocated for a context of n_ctx tokens: per buffer (CPU, CPU_Mapped, CUDA0, ...) the bytes of
    each of COMPONENTS, as its log reports them; the KV and recurrent-state bytes of the model's hyperparameters
    (formula; None where they do not tell) and the RSS growth of a child that filled such a context (None: not
    measured). A context that could not be made carries `error` and no figures."""

    n_ctx: int
    layout: str | None = None  # the cache layout used, in words
    devices: dict | None = None  # buffer name -> {component: bytes}
    total_bytes: int | None = None
    formula: dict | None = None  # {"kv": bytes or None, "recurrent": bytes or None}
    rss_growth_bytes: int | None = None
    error: str | None = None

    def component_bytes(self, component: str) -> int | None:
        """One component's bytes over every buffer (None where the context was not made)."""
        if self.devices is None:
            return None
        return sum(parts.get(component, 0) for parts in self.devices.values())



@dataclass(frozen=True)
class SpeedFigure(_Figure):
    """Tokens per second of one test (TESTS) of `tokens` tokens after an untimed prefill to `depth`: the median, min,
    max and every value over `reps` timed repetitions after one untimed warm-up; spread = (max - min) / median. A test
    that could not run carries `error` and no figures."""

    test: str
    tokens: int
    depth: int
    reps: int
    tokens_per_s: dict | None = None  # {"median", "min", "max", "values"}
    spread: float | None = None
    error: str | None = None

    @property
    def key(self) -> tuple[str, int, int, int]:
        return self.test, self.tokens, self.depth, self.reps

    @property
    def name(self) -> str:
        """llama-bench's name of the test: pp512, tg128 @ d4096."""
        return f"{self.test}{self.tokens}" + (f" @ d{self.depth}" if self.depth else "")

    @property
    def median(self) -> float | None:
        return None if self.tokens_per_s is None else self.tokens_per_s["median"]



@dataclass(frozen=True)
class DeploymentRecord:
    """The speed and memory of one board row (`label`) on one machine (docs/deployment-format.md)."""

    label: str
    model: dict  # {"fingerprint", "file_name", "size_bytes"}
    kv: dict  # {"type_k", "type_v", "flash_attn", "rotation": {"k", "v"}}
    machine: dict  # {"id", "cpu", "cpu_flags", "cores", "gpus", "backend", "llama_cpp"}
    settings: dict  # {"threads", "n_gpu_layers", "n_batch", "n_ubatch", "flash_attn", "offload"}
    memory: tuple[MemoryFigure, ...] = ()
    speed: tuple[SpeedFigure, ...] = ()
    measured_at: str = ""  # UTC, ISO 8601, of the last figure measured
    load_average: list | None = None  # os.getloadavg() when the last measurement began (a shared machine says so)

    @property
    def machine_id(self) -> str:
        return self.machine["id"]

    def measured_as(self, fingerprint: str, kv: dict, machine: str, settings: dict) -> bool:
        """Whether this record's figures were measured of the model with this fingerprint, with this KV cache, on
        the machine with this id, under these settings: only then are they reused."""
        return (self.model.get("fingerprint") == fingerprint and self.kv == kv and self.machine_id == machine
                and self.settings == settings)

    def memory_at(self, n_ctx: int) -> MemoryFigure | None:
        return next((m for m in self.memory if m.n_ctx == n_ctx), None)

    def speed_of(self, test: str, tokens: int, depth: int, reps: int) -> SpeedFigure | None:
        return next((s for s in self.speed if s.key == (test, tokens, depth, reps)), None)

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "label": self.label, "model": self.model, "kv": self.kv,
                "machine": self.machine, "settings": self.settings,
                "memory": [m.to_json() for m in self.memory], "speed": [s.to_json() for s in self.speed],
                "measured_at": self.measured_at, "load_average": self.load_average}

    @classmethod
    def from_json(cls, d: dict) -> "DeploymentRecord":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} record")
        if d.get("version") != VERSION:
            raise ValueError(f"version {d.get('version')} (this qeval reads version {VERSION})")
        machine = d["machine"]
        if machine.get("id") != machine_id(machine):
            raise ValueError("its machine id does not match its machine fields")
        return cls(label=d["label"], model=d["model"], kv=d["kv"], machine=machine, settings=d["settings"],
                   memory=tuple(MemoryFigure.from_json(m) for m in d.get("memory", ())),
                   speed=tuple(SpeedFigure.from_json(s) for s in d.get("speed", ())),
                   measured_at=d.get("measured_at", ""), load_average=d.get("load_average"))


def deployment_dir(runs_dir: str | os.PathLike) -> Path:
    return Path(runs_dir) / DEPLOYMENT_SUBDIR


def record_path(runs_dir: str | os.PathLike, label: str, machine: str) -> Path:
    """RUNS_DIR/deployment/<label>.<machine id, 12 hex digits>.json"""
    return deployment_dir(runs_dir) / f"{check_label(label)}.{machine[:MACHINE_ID_DIGITS]}.json"


def load_record(path: str | os.PathLike) -> DeploymentRecord:
    path = Path(path)
    try:
        return DeploymentRecord.from_json(json.loads(path.read_text()))
    except OSError as exc:
        raise StoreFormatError(f"cannot read the deployment record {path}: {exc.strerror}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StoreFormatError(f"{path} is not a readable deployment record ({exc}): measure it again with "
                               "`qeval deploy --force`, or remove it") from None


def load_records(runs_dir: str | os.PathLike) -> list[DeploymentRecord]:
    """Every record of the runs directory, of any machine, ordered by file name."""
    directory = deployment_dir(runs_dir)
    return [load_record(p) for p in sorted(directory.glob("*.json"))] if directory.is_dir() else []


def find_record(runs_dir: str | os.PathLike, label: str, machine: str) -> DeploymentRecord | None:
    """The record of `label` on the machine with this id, None when there is none (or it is unreadable: measuring
    again replaces it)."""
    path = record_path(runs_dir, label, machine)
    if not path.is_file():
        return None
    try:
        return load_record(path)
    except StoreFormatError:
        return None


def save_record(runs_dir: str | os.PathLike, record: DeploymentRecord) -> Path:
    """Write the record in its place, atomically: a failed write (WriteFailed: a full disk) leaves what was there."""
    path = record_path(runs_dir, record.label, record.machine_id)
    tmp = path.with_suffix(".json.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record.to_json(), indent=2) + "\n")
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise WriteFailed(f"writing the deployment record {path} failed ({exc.strerror or exc})", path,
                          exc.errno) from None
    tmp.replace(path)
    return path
