"""Deployment records as people read them: a speed table as llama-bench prints its tests (tokens per second, the
median of the repetitions, and how far they spread), a memory table by component at each deployment context with
the cross-checks beside it, and the machine they belong to."""

from __future__ import annotations

from qeval.present.markdown import markdown_table
from qeval.storage.deployment import COMPONENTS, DeploymentRecord, MemoryFigure, SpeedFigure

MIB = 1 << 20
SPREAD_NOTE = ("t/s: tokens per second, the median of the timed repetitions after one untimed warm-up (llama-bench's "
               "method); ± the spread, (max - min) / median. pp: a prompt in batches; tg: one token per call; @ dN: "
               "after an untimed prefill to N tokens.")
MEMORY_NOTE = ("MiB as llama.cpp allocates them for a context created unfilled (its own log: model, KV cache, "
               "recurrent state, compute and output buffers, every device together; each buffer to ±0.005 MiB). "
               "formula: the KV + recurrent bytes of the model's hyperparameters and cache types; RSS: the growth of "
               "a child process that filled such a context.")


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / MIB:,.2f}"


def _kv(record: DeploymentRecord) -> str:
    return f"{record.kv['type_k']}/{record.kv['type_v']}"


def speed_cell(figure: SpeedFigure | None) -> str:
    if figure is None:
        return ""
    if figure.error:
        return "failed"
    return f"{figure.median:,.2f} ± {figure.spread:.0%}"


def speed_table(records: list[DeploymentRecord]) -> str:
    """One row per record, one column per test (llama-bench's names: pp512, tg128 @ d4096)."""
    named = {s.key: s.name for r in records for s in r.speed}  # one figure's name per test
    tests = sorted(named, key=lambda k: (k[2], k[0], k[1], k[3]))
    if not tests:
        return ""
    names = [named[key] + " t/s" for key in tests]
    return markdown_table(["label", "KV", *names],
                          [[r.label, _kv(r), *(speed_cell(r.speed_of(*k)) for k in tests)] for r in records],
                          right=range(2, 2 + len(names)))


def _formula_cell(m: MemoryFigure) -> str:
    if m.formula is None or m.formula.get("kv") is None:
        return "not modelled"
    measured = (m.component_bytes("kv") or 0) + (m.component_bytes("recurrent") or 0)
    expected = m.formula["kv"] + (m.formula.get("recurrent") or 0)
    return f"{_mib(expected)} ({(measured - expected) / MIB:+.2f})"


def memory_table(records: list[DeploymentRecord]) -> str:
    """One row per record and context: each component's MiB, the total, the formula (and the log's difference from
    it), the RSS growth of a filled context."""
    rows = [(r, m) for r in records for m in sorted(r.memory, key=lambda m: m.n_ctx)]
    if not rows:
        return ""
    header = ["label", "KV", "n_ctx", *COMPONENTS, "total MiB", "formula KV+RS (Δ)", "RSS MiB"]
    return markdown_table(header, [[r.label, _kv(r), m.n_ctx, *_memory_cells(m)] for r, m in rows],
                          right=range(2, len(header)))


def _memory_cells(m: MemoryFigure) -> list[str]:
    """A context's figures after its label, KV and n_ctx: its error in the first column where it failed."""
    if m.error:
        return [m.error] + [""] * (len(COMPONENTS) + 2)
    return [*(_mib(m.component_bytes(c)) for c in COMPONENTS), _mib(m.total_bytes), _formula_cell(m),
            _mib(m.rss_growth_bytes)]


def machine_line(machine: dict, load_average: list | None) -> str:
    gpus = ", ".join(f"{g['name']} (driver {g['driver']})" for g in machine.get("gpus") or ())
    load = f"; load average {load_average[0]:.2f} when measuring began" if load_average else ""
    return (f"Measured on {machine.get('cpu') or 'an unknown CPU'}, {machine.get('cores')} cores"
            f"{', ' + gpus if gpus else ''}; llama.cpp backend {machine.get('backend')}, llama-cpp-python "
            f"{machine.get('llama_cpp', {}).get('version')} (machine {machine['id'][:12]}){load}.")


def deployment_text(records: list[DeploymentRecord], machine: dict, load_average: list | None,
                    lines: list[str] = (), errors: list[str] = ()) -> str:
    """The speed and memory tables of these records, with the machine and what was reused or failed."""
    if not records:
        return "\n".join([*lines, *errors])
    settings = records[0].settings
    parts = [*lines, "", machine_line(machine, load_average),
             f"Settings: {settings['threads']} threads, -ngl {settings['n_gpu_layers']}, -b {settings['n_batch']}, "
             f"-ub {settings['n_ubatch']}" + (f", --n-cpu-moe {settings['offload']['n_cpu_moe']}"
                                              if settings.get("offload") else "")]
    speed, mem = speed_table(records), memory_table(records)
    if speed:
        parts += ["", "Speed (tokens per second)", speed, "", SPREAD_NOTE]
    if mem:
        parts += ["", "Memory at the deployment contexts (MiB)", mem, "", MEMORY_NOTE]
    return "\n".join([*parts, *(["", *errors] if errors else [])]).strip("\n")
