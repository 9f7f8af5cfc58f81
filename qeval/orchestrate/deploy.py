"""Speed and memory of board rows as they are deployed: `qeval deploy`, and `--deploy SPEC` of `matrix`, `kld` and
`recipe`.

A DeploySpec says what to measure (the deployment contexts for memory; the pp and tg tests, their depths and
repetitions for speed; the deployment's batch sizes and expert offload), parsed from one compact text:

    ctx=4096,32768;depth=0,4096;pp=512;tg=128;reps=5;b=2048;ub=512;ncmoe=0;rss=0

Each row (a label, its GGUF, its engine settings) is measured by qeval.engine.deploy, one row after another, here,
after (never beside) any quality work, and its figures are saved as a deployment record of this machine
(qeval.storage.deployment). A record is reused only on this machine (its id: qeval.engine.machine), for the same
model fingerprint, KV cache and settings; then only the figures it lacks are measured, and one that failed before is
tried again. Another machine's record is never reused: it stays in its own file.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from qeval.engine import memory, numerics
from qeval.engine.deploy import DEPLOY_BATCH, DEPLOY_UBATCH, DeployModel, SpeedTest, resident_bytes, rss_growth
from qeval.engine.engine import PROMPT, ContextFailed, EngineSettings, available_cores
from qeval.engine.machine import current_machine
from qeval.engine.modelinfo import model_facts
from qeval.errors import QevalError
from qeval.present import deploy_text
from qeval.storage.deployment import DeploymentRecord, MemoryFigure, SpeedFigure, find_record, save_record

SPEC_KEYS = {"ctx": "deployment contexts of the memory figures", "depth": "depths of the speed tests",
             "pp": "prompt tokens of a pp test (0: none)", "tg": "generated tokens of a tg test (0: none)",
             "reps": "timed repetitions of each test", "b": "n_batch", "ub": "n_ubatch",
             "ncmoe": "llama.cpp's --n-cpu-moe: the experts of the first N layers kept on the CPU",
             "rss": "1: also fill each context in a child and measure its RSS growth"}


@dataclass(frozen=True, kw_only=True)
class DeploySpec:
    """What to measure of every row (the module's docstring; defaults: llama-bench's and llama.cpp's)."""

    contexts: tuple[int, ...] = (4096,)  # memory at each (llama.cpp's default n_ctx); () none
    depths: tuple[int, ...] = (0,)
    pp: tuple[int, ...] = (512,)  # llama-bench's -p
    tg: tuple[int, ...] = (128,)  # llama-bench's -n
    reps: int = 5  # llama-bench's -r
    n_batch: int = DEPLOY_BATCH
    n_ubatch: int = DEPLOY_UBATCH
    n_cpu_moe: int = 0
    rss: bool = False

    @property
    def tests(self) -> list[SpeedTest]:
        """Every speed test, depth by depth (one prefill per depth, restored for the others, as llama-bench)."""
        return [SpeedTest(kind, n, d) for d in self.depths for kind, sizes in (("pp", self.pp), ("tg", self.tg))
                for n in sizes]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def text(self) -> str:
        """The spec as parse_deploy_spec reads it."""
        lists = {"ctx": self.contexts, "depth": self.depths, "pp": self.pp or (0,), "tg": self.tg or (0,)}
        parts = [f"{k}={','.join(map(str, v or (0,)))}" for k, v in lists.items()]
        return ";".join(parts + [f"reps={self.reps}", f"b={self.n_batch}", f"ub={self.n_ubatch}",
                                 f"ncmoe={self.n_cpu_moe}", f"rss={int(self.rss)}"])


def parse_deploy_spec(text: str, option: str = "--deploy") -> DeploySpec:
    """`key=value[,value...];...` (SPEC_KEYS) into a DeploySpec; keys left out keep their defaults. Every bad key or
    value is refused with the option's name."""
    values: dict[str, list[int]] = {}
    for part in filter(None, (p.strip() for p in text.replace(" ", "").split(";"))):
        key, sep, value = part.partition("=")
        if not sep or key not in SPEC_KEYS:
            raise QevalError(f"{option} {text}: {part!r} is not KEY=VALUE with a key of: "
                             f"{', '.join(f'{k} ({v})' for k, v in SPEC_KEYS.items())}")
        if key in values:
            raise QevalError(f"{option} {text}: {key} is given twice")
        try:
            numbers = [int(v) for v in value.split(",")]
        except ValueError:
            raise QevalError(f"{option} {text}: {key} takes whole numbers separated by commas, not {value!r}") from None
        if any(n < 0 for n in numbers) or (key in ("reps", "b", "ub") and min(numbers) < 1):
            raise QevalError(f"{option} {text}: {key} must be {'at least 1' if key in ('reps', 'b', 'ub') else '>= 0'}")
        if key in ("reps", "b", "ub", "ncmoe", "rss") and len(numbers) != 1:
            raise QevalError(f"{option} {text}: {key} takes one number")
        if key == "rss" and numbers[0] not in (0, 1):
            raise QevalError(f"{option} {text}: rss is 0 or 1")
        values[key] = numbers

    def listed(key: str, default: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted(set(n for n in values[key] if n))) if key in values else default

    spec = DeploySpec(contexts=listed("ctx", DeploySpec.contexts), pp=listed("pp", DeploySpec.pp),
                      tg=listed("tg", DeploySpec.tg),
                      depths=tuple(sorted(set(values["depth"]))) if "depth" in values else DeploySpec.depths,
                      **{field: values[key][0] for key, field in (("reps", "reps"), ("b", "n_batch"),
                                                                 ("ub", "n_ubatch"), ("ncmoe", "n_cpu_moe"))
                         if key in values}, rss=bool(values.get("rss", [0])[0]))
    if not spec.contexts and not spec.tests:
        raise QevalError(f"{option} {text}: nothing to measure (no ctx, and pp and tg are 0)")
    return spec


def check_spec(spec: DeploySpec, facts: dict, settings: EngineSettings) -> None:
    """Refuse, before any work, a deployment context or a test's context beyond the model's trained context without
    RoPE scaling (the engine's rule, qeval.engine.engine.check_context), naming the spec's key."""
    trained = facts.get("context_length")
    if settings.rope_scaling or not isinstance(trained, int):
        return
    asked = [(f"ctx={n}", n) for n in spec.contexts] + \
            [(f"{t.test}={t.tokens} at depth={t.depth} (a context of {t.n_ctx})", t.n_ctx) for t in spec.tests]
    beyond = [what for what, n in asked if n > trained]
    if beyond:
        raise QevalError(f"deployment {beyond[0]} is beyond {facts.get('file_name')}'s trained context of {trained} "
                         f"tokens: measure at {trained} or less, or opt into RoPE scaling as llama.cpp does "
                         "(--rope-scaling yarn|linear)")


@dataclass(frozen=True)
class DeployRow:
    """One row to measure: its board label, its GGUF, and the engine settings its quality was measured with (the KV
    cache, flash attention, the rotation, threads, -ngl; batch sizes are the spec's)."""

    label: str
    model: str
    settings: EngineSettings


def deploy_settings(settings: EngineSettings, spec: DeploySpec) -> EngineSettings:
    """The engine settings a row is deployed with: its own, with the spec's batch sizes, prompt decoding and no
    decode-ahead (nothing else of qeval runs while timing)."""
    return dataclasses.replace(settings, n_batch=spec.n_batch, n_ubatch=min(spec.n_ubatch, spec.n_batch),
                               decode=PROMPT, decode_ahead=False).validate()


def settings_block(settings: EngineSettings, spec: DeploySpec) -> dict:
    """A record's settings: what a figure depends on beyond the model, its KV cache and the machine."""
    out = {"threads": settings.n_threads or available_cores(), "n_gpu_layers": settings.n_gpu_layers,
           "n_batch": settings.n_batch, "n_ubatch": settings.n_ubatch, "flash_attn": settings.flash_attn,
           "offload": {"n_cpu_moe": spec.n_cpu_moe} if spec.n_cpu_moe else None}
    if settings.rope_scaling:
        out.update(rope_scaling=settings.rope_scaling, rope_scale=settings.rope_scale)
    return out


def kv_block(settings: EngineSettings, rotation: dict) -> dict:
    return {"type_k": settings.type_k, "type_v": settings.type_v, "flash_attn": settings.flash_attn,
            "rotation": dict(rotation)}


def model_block(facts: dict) -> dict:
    return {"fingerprint": facts["fingerprint"], "file_name": facts["file_name"], "size_bytes": facts["file_size"]}


def speed_figure(test: SpeedTest, reps: int, rates: list[float]) -> SpeedFigure:
    median = statistics.median(rates)
    return SpeedFigure(test=test.test, tokens=test.tokens, depth=test.depth, reps=reps,
                       tokens_per_s={"median": median, "min": min(rates), "max": max(rates), "values": rates},
                       spread=(max(rates) - min(rates)) / median if median else None)


@dataclass
class _Plan:
    """A row's record as it will be: the figures reused, and what is left to measure."""

    row: DeployRow
    settings: EngineSettings
    base: DeploymentRecord  # the record with every figure that is reused
    contexts: list[int]  # memory to measure
    tests: list[SpeedTest]  # speed to measure
    reused: bool  # some figures come from a saved record
    note: str = ""  # why a saved record of this row was not reused


def _plan(row: DeployRow, spec: DeploySpec, machine: dict, runs_dir: Path, force: bool,
          facts: dict | None = None) -> _Plan:
    """What of the row is left to measure (facts: the model's, when known without its file)."""
    settings = deploy_settings(row.settings, spec)
    facts = facts or model_facts(row.model)
    check_spec(spec, facts, settings)
    rotation = numerics.rotation_rule(facts, settings.type_k, settings.type_v, settings.kv_rotation)
    base = DeploymentRecord(label=row.label, model=model_block(facts), kv=kv_block(settings, rotation), machine=machine,
                            settings=settings_block(settings, spec))
    saved = None if force else find_record(runs_dir, row.label, machine["id"])
    note = ""
    if saved is not None and saved.measured_as(base.model["fingerprint"], base.kv, machine["id"], base.settings):
        memory_kept = [m for m in saved.memory if m.error is None]
        speed_kept = [s for s in saved.speed if s.error is None]
        base = dataclasses.replace(saved, memory=tuple(memory_kept), speed=tuple(speed_kept))
    elif saved is not None:
        differs = [what for what, a, b in (("model", saved.model.get("fingerprint"), base.model["fingerprint"]),
                                           ("KV cache", saved.kv, base.kv), ("settings", saved.settings, base.settings))
                   if a != b]
        note = f"deploy {row.label}: its record on this machine holds another {' and '.join(differs)}: measured again"
    contexts = [n for n in spec.contexts if not _memory_done(base.memory_at(n), spec.rss)]
    tests = [t for t in spec.tests if base.speed_of(t.test, t.tokens, t.depth, spec.reps) is None]
    return _Plan(row=row, settings=settings, base=base, contexts=contexts, tests=tests,
                 reused=bool(base.memory or base.speed), note=note)


def answered(row: DeployRow, spec: DeploySpec, runs_dir: str | os.PathLike, facts: dict) -> bool:
    """Whether this machine's record of the row (its model known by `facts`, its file perhaps gone) holds every
    figure the spec asks for."""
    plan = _plan(row, spec, current_machine(), Path(runs_dir), False, facts)
    return not plan.contexts and not plan.tests


def saved_run(labels: list[str], runs_dir: str | os.PathLike) -> DeployRun:
    """This machine's records of these labels, as measure_rows reports them (a label without one is left out)."""
    machine = current_machine()
    records = [r for label in dict.fromkeys(labels) if (r := find_record(Path(runs_dir), label, machine["id"]))]
    errors = [f"deploy {r.label}: {f.error}" for r in records for f in (*r.memory, *r.speed) if f.error]
    load = next((r.load_average for r in records if r.load_average), None)
    return DeployRun(records=records, lines=[], errors=errors, machine=machine, load_average=load)


def _memory_done(figure: MemoryFigure | None, rss: bool) -> bool:
    return figure is not None and (not rss or figure.rss_growth_bytes is not None)


def plan_rows(rows: list[DeployRow], spec: DeploySpec) -> None:
    """Refuse, before any work, what a matrix or a command would only find wrong after hours: a spec beyond a model's
    trained context, settings llama.cpp cannot run, rss=1 where this platform cannot tell a resident set."""
    if spec.rss:
        resident_bytes()  # QevalError where neither /proc nor psutil tells
    for row in rows:
        check_spec(spec, model_facts(row.model), deploy_settings(row.settings, spec))


@dataclass(frozen=True)
class DeployRun:
    """What measure_rows did: every row's record (None where its model could not be loaded), the lines worth a
    mention, and every figure that could not be measured (one message each)."""

    records: list[DeploymentRecord | None]
    lines: list[str]
    errors: list[str]
    machine: dict
    load_average: list[float]

    def to_json(self) -> dict:
        return {"machine": self.machine, "load_average": self.load_average, "errors": self.errors,
                "records": [r.to_json() for r in self.records if r is not None]}

    def text(self) -> str:
        return deploy_text.deployment_text([r for r in self.records if r is not None], self.machine,
                                           self.load_average, self.lines, self.errors)


def measure_rows(rows: list[DeployRow], spec: DeploySpec, runs_dir: str | os.PathLike, force: bool = False,
                 say: Callable[[str], None] = lambda line: None) -> DeployRun:
    """Measure every row one after another (reusing this machine's records where they answer it), saving each
    row's record as soon as it is measured. A figure that cannot be measured (a context llama.cpp cannot allocate,
    a failed decode) is recorded with its error and the others are measured; a model that cannot be loaded leaves
    its row without a record. Nothing is raised for either: DeployRun.errors lists them."""
    runs_dir = Path(runs_dir)
    machine = current_machine()
    load = list(os.getloadavg())
    records, lines, errors = [], [], []
    for row in rows:
        try:
            plan = _plan(row, spec, machine, runs_dir, force)
        except QevalError as exc:
            errors.append(f"deploy {row.label}: {exc}")
            records.append(None)
            continue
        if plan.note:
            lines.append(plan.note)
        if not plan.contexts and not plan.tests:
            lines.append(f"deploy {row.label}: every figure measured earlier on this machine, reused")
            records.append(plan.base)
            continue
        if plan.reused:
            lines.append(f"deploy {row.label}: {len(plan.base.memory) + len(plan.base.speed)} figures reused, "
                         f"{len(plan.contexts) + len(plan.tests)} measured now")
        say(f"qeval: deploy {row.label}: memory at {', '.join(map(str, plan.contexts)) or 'no new context'}; "
            f"{', '.join(SpeedFigure(test=t.test, tokens=t.tokens, depth=t.depth, reps=spec.reps).name for t in plan.tests) or 'no new test'}"
            f" ({spec.reps} timed repetitions each)")
        try:
            record = _measure(plan, spec, load)
        except QevalError as exc:
            errors.append(f"deploy {row.label}: {exc}")
            records.append(None)
            continue
        save_record(runs_dir, record)
        errors += [f"deploy {row.label}: {f.error}" for f in (*record.memory, *record.speed) if f.error]
        records.append(record)
    return DeployRun(records=records, lines=lines, errors=errors, machine=machine, load_average=load)


def _measure(plan: _Plan, spec: DeploySpec, load: list[float]) -> DeploymentRecord:
    rss = {n: rss_growth(plan.row.model, plan.settings, spec.n_cpu_moe, n) for n in plan.contexts} if spec.rss else {}
    geometry = memory.memory_geometry(plan.row.model)
    measured_memory, measured_speed = [], []
    with DeployModel(plan.row.model, plan.settings, spec.n_cpu_moe) as model:
        rotation = None
        for n_ctx in plan.contexts:
            formula = memory.formula_bytes(geometry, n_ctx, plan.settings.type_k, plan.settings.type_v,
                                           model.n_ubatch)
            growth, rss_error = rss.get(n_ctx, (None, None))
            try:
                devices, layout = model.measure_memory(n_ctx)
                rotation = model.kv_rotation
            except ContextFailed as exc:
                measured_memory.append(MemoryFigure(n_ctx=n_ctx, formula=formula, error=_context_error(n_ctx, exc)))
                continue
            measured_memory.append(MemoryFigure(n_ctx=n_ctx, layout=layout, devices=devices,
                                                total_bytes=memory.total_bytes(devices), formula=formula,
                                                rss_growth_bytes=growth,
                                                error=rss_error and f"RSS not measured: {rss_error}"))
        for test in plan.tests:
            try:
                rates = model.measure_speed(test, spec.reps)
                rotation = model.kv_rotation
            except QevalError as exc:
                measured_speed.append(SpeedFigure(test=test.test, tokens=test.tokens, depth=test.depth, reps=spec.reps,
                                                  error=str(exc)))
                continue
            measured_speed.append(speed_figure(test, spec.reps, rates))
    base = plan.base
    kv = base.kv if rotation is None else {**base.kv, "rotation": dict(rotation)}  # what llama.cpp reported
    return dataclasses.replace(
        base, kv=kv, memory=_merged(base.memory, measured_memory, lambda m: m.n_ctx),
        speed=_merged(base.speed, measured_speed, lambda s: s.key),
        measured_at=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), load_average=load)


def _context_error(n_ctx: int, exc: ContextFailed) -> str:
    if exc.asked is None:
        return f"a context of {n_ctx} tokens cannot be made: {exc}"
    what = f" ({exc.what})" if exc.what else ""
    return (f"a context of {n_ctx} tokens cannot be allocated: llama.cpp asked for {exc.asked / 2**20:,.2f} MiB "
            f"({exc.asked:,} bytes) and could not allocate it{what}")


def _merged(kept: tuple, measured: list, key) -> tuple:
    """The figures kept and those measured now (which replace any of the same key), in key order."""
    by_key = {key(f): f for f in kept}
    by_key.update({key(f): f for f in measured})
    return tuple(by_key[k] for k in sorted(by_key))
