"""Speed and memory beside quality on a board: the deployment records (one per board row and machine, read by
qeval.storage.deployment; format in docs/deployment-format.md) matched to a board's rows, the machine whose figures
the board shows, their columns and cells (markdown, CSV and JSON, card, HTML page), the front over quality × memory ×
speed, and the rows as candidates of the deployment question (qeval.compare.deployment_choice).

A record belongs to a row when its label, model fingerprint and KV cache types are the row's; a record under a
row's label with another model or KV type is stale: never shown, named in the notes. Speed and memory belong to the
machine they were measured on: a board shows one machine's figures (the current machine's unless another is asked
for), lists every other machine's in a table of its own, and says when its rows were measured on more than one. The
reference's record gives the board a row for the reference itself. Figures are only ever read as measured: a
context or a depth that was not measured has no cell value ("not measured"), never a zero or an interpolation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from qeval.compare import deployment_choice, metric_registry
from qeval.compare.deployment_choice import GIB, Candidate
from qeval.errors import QevalError
from qeval.present.markdown import markdown_table

NOT_MEASURED = "not measured"
FAILED = "failed"
MEMORY_PARTS = ("model", "kv", "recurrent", "compute", "output")  # llama.cpp's buffers, in the records' order
# the quality figures a deployment question may ask for (--by): the board metrics with a better direction
QUALITIES = tuple(m.key for m in metric_registry.board() if m.better)
CONTROL_WHY = "not a candidate: the control (the reference recomputed under another batch layout)"
FLOOR_WHY = "not a candidate: the numerics floor (the reference on another of llama.cpp's kernel paths)"


@dataclass(frozen=True)
class Records:
    """What a board is given to show speed and memory: every deployment record beside its results (any machine),
    the id of the machine the board is built on, and the machine to show (a key or its prefix; None: this one)."""

    records: tuple
    current: str
    machine: str | None = None


@dataclass(frozen=True)
class Machine:
    """A machine some record was measured on (its record's machine block)."""

    key: str  # the first 12 hex digits of its id, as in the records' file names
    facts: dict
    current: bool  # the machine this board is built on

    @property
    def short(self) -> str:
        """CPU / GPUs: how a rule-out names it."""
        gpus = [g.get("name") or "GPU" for g in self.facts.get("gpus") or ()]
        return " / ".join([self.facts.get("cpu") or "unknown CPU", *gpus])

    @property
    def text(self) -> str:
        """Everything that makes its speed its own: CPU and cores, GPUs and driver, backend, llama.cpp build."""
        f = self.facts
        if set(f) == {"id"}:  # this machine, which measured nothing on the board
            return f"[{self.key}, this machine]"
        parts = [(f.get("cpu") or "unknown CPU") + (f" ({f['cores']} cores)" if f.get("cores") else "")]
        parts += [(g.get("name") or "GPU") + (f" (driver {g['driver']})" if g.get("driver") else "")
                  for g in f.get("gpus") or ()]
        if f.get("backend"):
            parts.append(f"{f['backend']} backend")
        version = (f.get("llama_cpp") or {}).get("version")
        if version:
            parts.append(f"llama-cpp-python {version}")
        return ", ".join(parts) + f" [{self.key}" + (", this machine]" if self.current else "]")


SpeedKey = tuple  # (test, tokens, depth): ("tg", 128, 4096)


def speed_key(figure) -> SpeedKey:
    return figure.test, figure.tokens, figure.depth


def speed_column(key: SpeedKey) -> str:
    """The written column of a speed figure: tg128@d4096, as llama-bench names its tests."""
    test, n, depth = key
    return f"{test}{n}@d{depth}"


def memory_column(n_ctx: int, part: str | None = None) -> str:
    """The written column of total memory (or one of its parts) at a deployment context: memory_gib@32768."""
    return f"memory_{part}_gib@{n_ctx}" if part else f"memory_gib@{n_ctx}"


def settings_text(settings: dict) -> str:
    """The engine settings a record was measured with, as llama.cpp's options."""
    s = settings or {}
    parts = [f"threads {s.get('threads')}", f"-ngl {s.get('n_gpu_layers')}", f"-b {s.get('n_batch')}",
             f"-ub {s.get('n_ubatch')}", f"flash attention {s.get('flash_attn')}"]
    if s.get("offload"):
        parts.append(f"offload {s['offload']}")
    return ", ".join(parts)


@dataclass(frozen=True)
class Measured:
    """One row's record on one machine."""

    record: object  # qeval.storage.deployment.DeploymentRecord
    machine: Machine

    @property
    def memory(self) -> dict:
        """n_ctx -> its MemoryFigure."""
        return {m.n_ctx: m for m in self.record.memory}

    @property
    def speed(self) -> dict:
        """(test, tokens, depth) -> its SpeedFigure."""
        return {speed_key(s): s for s in self.record.speed}

    def memory_at(self, n_ctx: int) -> float | str | None:
        """Total bytes at n_ctx, why it could not be measured, or None: not measured there."""
        m = self.memory.get(n_ctx)
        if m is None:
            return None
        if m.error or m.total_bytes is None:
            return m.error or "no figure recorded"
        return m.total_bytes

    def tg_at(self, depth: int) -> float | str | None:
        """Generation tokens/s (median) at depth (the longest tg run measured there), why it could not be
        measured, or None: not measured there."""
        runs = sorted((s for s in self.record.speed if s.test == "tg" and s.depth == depth), key=lambda s: s.tokens)
        if not runs:
            return None
        s = runs[-1]
        if s.error or not s.tokens_per_s:
            return s.error or "no figure recorded"
        return s.tokens_per_s["median"]

    def parts_at(self, n_ctx: int) -> dict[str, float]:
        """Each buffer's bytes at n_ctx, summed over devices."""
        m = self.memory.get(n_ctx)
        out: dict[str, float] = {}
        for device in (m.devices or {}).values() if m is not None and m.error is None else ():
            for part, n in device.items():
                out[part] = out.get(part, 0) + (n or 0)
        return out

    def to_json(self) -> dict:
        r = self.record
        return {"machine": self.machine.key, "settings": r.settings, "kv": r.kv,
                "memory": [dataclasses.asdict(m) for m in r.memory], "speed": [dataclasses.asdict(s) for s in r.speed],
                "measured_at": getattr(r, "measured_at", None), "load_average": getattr(r, "load_average", None)}


def _memory_cell(figure: float | str | None) -> str:
    if figure is None:
        return NOT_MEASURED
    return FAILED if isinstance(figure, str) else f"{figure / GIB:.3f}"


def _speed_cell(figure) -> str:
    if figure is None:
        return NOT_MEASURED
    if figure.error or not figure.tokens_per_s:
        return FAILED
    spread = "" if figure.spread is None else f" ({100 * figure.spread:.1f} %)"
    return f"{figure.tokens_per_s['median']:,.1f}{spread}"


@dataclass
class DeploymentBoard:
    """The speed and memory of a board's rows: every matching record by row and machine, the machine the board
    shows, and the front over quality × memory × speed at one context and depth."""

    machine: Machine  # the machine whose figures the board shows
    machines: dict[str, Machine]  # every machine a matching record was measured on, by key
    measured: dict[str, dict[str, Measured]]  # row label -> machine key -> its record there
    stale: tuple[str, ...] = ()  # records under a row's label that are not that row's: one sentence each
    front_at: tuple[int | None, int | None] = (None, None)  # the (context, depth) of the front column
    front: frozenset = frozenset()  # labels on it (mean KLD × memory at the context × tg at the depth)
    fronts: dict = field(default_factory=dict)  # (quality key, context, depth) -> labels, for the HTML page

    def on(self, label: str, machine: str | None = None) -> Measured | None:
        """A row's record on `machine` (a key; default the board's)."""
        return self.measured.get(label, {}).get(machine or self.machine.key)

    def _all_on(self, machine: str | None) -> list[Measured]:
        return [m for by in self.measured.values() for k, m in by.items() if k == (machine or self.machine.key)]

    def contexts(self, machine: str | None = None) -> tuple[int, ...]:
        """The deployment contexts measured on `machine` (any row), ascending."""
        return tuple(sorted({n for m in self._all_on(machine) for n in m.memory}))

    def speeds(self, machine: str | None = None) -> tuple[SpeedKey, ...]:
        """The speed tests measured on `machine` (any row): pp before tg, by depth, then length."""
        keys = {k for m in self._all_on(machine) for k in m.speed}
        return tuple(sorted(keys, key=lambda k: (k[0] != "pp", k[2], k[1], k[0])))

    def depths(self, machine: str | None = None) -> tuple[int, ...]:
        """The depths a generation speed was measured at on `machine`."""
        return tuple(sorted({d for test, _, d in self.speeds(machine) if test == "tg"}))

    @property
    def others(self) -> list[Machine]:
        """Machines other than the board's that some row was measured on."""
        return [m for k, m in self.machines.items() if k != self.machine.key]

    # ---- text tables -------------------------------------------------------------------------------------------
    def columns(self, machine: str | None = None, front: bool = True) -> tuple[tuple[str, str], ...]:
        """(heading, written column) of the speed and memory columns of `machine`'s table: total memory per
        context, each speed test, and (the board's machine) the deployment front."""
        on_front = (("deployment front", "deployment_front"),) if front and self.front_column else ()
        return (*((f"memory GiB @ ctx {n}", memory_column(n)) for n in self.contexts(machine)),
                *((f"{test}{n} t/s @ d{depth}", speed_column((test, n, depth)))
                  for test, n, depth in self.speeds(machine)), *on_front)

    @property
    def front_column(self) -> bool:
        return self.front_at != (None, None)

    def cells(self, label: str, machine: str | None = None, front: bool = True) -> list[str]:
        """A row's cells under columns(machine, front)."""
        m = self.on(label, machine)
        cells = [NOT_MEASURED if m is None else _memory_cell(m.memory_at(n)) for n in self.contexts(machine)]
        cells += [NOT_MEASURED if m is None else _speed_cell(m.speed.get(k)) for k in self.speeds(machine)]
        if front and self.front_column:
            cells.append("✓" if label in self.front else "")
        return cells

    # ---- written columns (CSV, JSON) -----------------------------------------------------------------------
    def parts(self) -> tuple[str, ...]:
        """Every memory part any record on the board's machine names, llama.cpp's usual ones first."""
        named = {p for m in self._all_on(None) for n in m.memory for p in m.parts_at(n)}
        return (*(p for p in MEMORY_PARTS if p in named), *sorted(named - set(MEMORY_PARTS)))

    def keys(self) -> tuple[str, ...]:
        """The written columns: the machines a row was measured on, the machine its figures here belong to (the
        board's; none where it has no record there), then those figures: per context the total and each part in GiB
        and why it failed, per speed test the median, spread and why it failed."""
        out = ["measured_on", "figures_machine"]
        for n in self.contexts():
            out += [memory_column(n), *(memory_column(n, p) for p in self.parts()), f"memory_error@{n}"]
        for k in self.speeds():
            out += [speed_column(k), f"{speed_column(k)}_spread", f"{speed_column(k)}_error"]
        return (*out, "deployment_front")

    def values(self, label: str) -> dict:
        """A row's values of keys(): None where not measured."""
        out = dict.fromkeys(self.keys())
        keys = sorted(self.measured.get(label, {}), key=lambda k: (k != self.machine.key, k))
        out["measured_on"] = " ".join(keys) or None  # the board's machine first
        m = self.on(label)
        if m is not None:
            out["figures_machine"] = self.machine.key
            for n in self.contexts():
                figure, parts = m.memory_at(n), m.parts_at(n)
                out[memory_column(n)] = figure / GIB if isinstance(figure, (int, float)) else None
                out[f"memory_error@{n}"] = figure if isinstance(figure, str) else None
                out.update({memory_column(n, p): parts[p] / GIB for p in self.parts() if p in parts})
            for k, s in m.speed.items():
                column = speed_column(k)
                out[column] = s.tokens_per_s["median"] if s.tokens_per_s and not s.error else None
                out[f"{column}_spread"], out[f"{column}_error"] = s.spread, s.error
        out["deployment_front"] = (label in self.front) if self.front_column else None
        return out

    def to_json(self) -> dict:
        """What the board's JSON says of speed and memory beside its rows: the machines, the front and every
        record of every row, on every machine, with its per-device buffers."""
        context, depth = self.front_at
        return {"machine": self.machine.key,
                "machines": {k: {**m.facts, "text": m.text, "current": m.current} for k, m in self.machines.items()},
                "front": {"quality": "kld_mean", "n_ctx": context, "depth": depth, "labels": sorted(self.front)},
                "stale": list(self.stale), "notes": self.notes(),
                "records": {label: {k: m.to_json() for k, m in by.items()} for label, by in self.measured.items()}}

    # ---- text around the table ---------------------------------------------------------------------------
    def lines(self) -> list[tuple[str, str]]:
        """(name, text) above the table: the machine and settings of its speed and memory columns."""
        mine = self._all_on(None)
        settings = sorted({settings_text(m.record.settings) for m in mine})
        layouts = sorted({f.layout for m in mine for f in m.record.memory if getattr(f, "layout", None)})
        loads = [rec.load_average[0] for rec in (m.record for m in mine) if getattr(rec, "load_average", None)]
        out = [("Speed and memory measured on", self.machine.text)]
        if mine:
            out.append(("Engine settings", settings[0] if len(settings) == 1 else
                        "differ between rows (" + "; ".join(settings) + "): their speeds are not like for like"))
        if loads:
            out.append(("Load average when measured", f"{min(loads):.2f} to {max(loads):.2f} (1 minute; other work "
                                                      "on the machine slows its speed figures)"))
        if layouts:
            out.append(("KV cache layout", "; ".join(layouts)))
        return out

    def notes(self) -> list[str]:
        """What the speed and memory columns mean, which machines they come from, and which records were left
        out."""
        out = [DEPLOYMENT_NOTE]
        if self.front_column:
            context, depth = self.front_at
            axes = ["mean KLD", *([f"memory at ctx {context}"] if context is not None else []),
                    *([f"generation speed at depth {depth}"] if depth is not None else [])]
            out.append(f"Deployment front: no other row on {self.machine.key} is at least as good in "
                       f"{', '.join(axes)} and better in one (the reference beats every quant in quality).")
        if not self._all_on(None):
            out.append(f"Nothing on this board was measured on {self.machine.key}: its speed and memory columns are "
                       "empty.")
        where = "; ".join(f"{m.key}: {m.text} ({self._count(m.key)} rows)" for m in self.others)
        if self.others and self.machine.key in self.machines:
            out.append(f"Rows were measured on {len(self.machines)} machines; the columns show {self.machine.key}'s "
                       f"figures only, every other machine's are in a table of their own ({where}).")
        elif self.others:
            out.append(f"Rows were measured on other machines only ({where}): their figures are in tables of their "
                       "own; --machine with a machine's id shows its figures in the columns.")
        out += self.stale
        return out

    def _count(self, key: str) -> int:
        return sum(key in by for by in self.measured.values())

    # ---- the question --------------------------------------------------------------------------------------
    def candidates(self, rows, by: str = "kld_mean") -> list[Candidate]:
        """The rows (BoardRow, the reference's included) as the deployment question sees them on this board's
        machine."""
        out = []
        for row in rows:
            m = self.on(row.label)
            elsewhere = ", ".join(self.machines[k].short for k in self.measured.get(row.label, {}))
            excluded = CONTROL_WHY if row.control else FLOOR_WHY if row.floor else None
            memory = {} if m is None else {n: m.memory_at(n) for n in m.memory}
            tg = {} if m is None else {s.depth: m.tg_at(s.depth) for s in m.record.speed if s.test == "tg"}
            out.append(Candidate(label=row.label, quality=row.value(by), memory=memory, tg=tg, reference=row.reference,
                                 elsewhere=None if m is not None else elsewhere or None, excluded=excluded,
                                 recorded=m is not None))
        return out

    def check(self, question: deployment_choice.Question) -> None:
        """Refuse a question about a context or depth never measured on this board's machine."""
        where = f"on {self.machine.text}"
        elsewhere = "".join(f"; {m.key} ({m.short}) measured {self._count(m.key)} rows: --machine {m.key} asks it"
                            for m in self.others)
        if question.n_ctx is not None and question.n_ctx not in self.contexts():
            raise QevalError(f"--context {question.n_ctx} was not measured {where}: measured contexts are "
                             f"{_listed(self.contexts())} (figures are never interpolated){elsewhere}")
        if question.depth is not None and question.depth not in self.depths():
            raise QevalError(f"--depth {question.depth}: no generation speed was measured at that depth {where}: "
                             f"measured depths are {_listed(self.depths())} (figures are never "
                             f"interpolated){elsewhere}")


def _listed(values) -> str:
    return ", ".join(map(str, values)) or "none"


DEPLOYMENT_NOTE = ("Speed and memory: memory GiB @ ctx C is what llama.cpp allocates for the row at deployment "
                   "context C (model, KV cache, recurrent state, compute and output buffers, every device; the parts "
                   "in the CSV and JSON); pp<P> and tg<N> t/s @ d<D> are llama-bench's tests, prompt processing of P "
                   "tokens and generation of N tokens after a prefill to depth D, median tokens/s over the "
                   "repetitions, (n %) how far they moved: (max − min)/median. \"not measured\": no figure there; "
                   "\"failed\": measured and failed (why in the JSON). These figures belong to the machine named "
                   "above; mean KLD and the other quality figures do not depend on it.")


def _machine(facts: dict, current: str) -> Machine:
    return Machine(facts["id"][:12], facts, facts["id"] == current)


def match(rows: Sequence, records: Iterable, current: str, machine: str | None = None) -> DeploymentBoard | None:
    """The speed and memory of `rows` (BoardRow, the reference's first) from `records` (any machine), shown for
    `machine` (a machine key or its prefix; default `current`, this machine's id). None when no record is under a
    row's label: a board without speed and memory columns."""
    by_label = {r.label: r for r in rows}
    measured: dict[str, dict[str, Measured]] = {}
    machines: dict[str, Machine] = {}
    stale = []
    for rec in records:
        row = by_label.get(rec.label)
        if row is None:
            continue
        m = _machine(rec.machine, current)
        kv = (rec.kv.get("type_k"), rec.kv.get("type_v"))
        if rec.model.get("fingerprint") != row.fingerprint or kv != (row.type_k, row.type_v):
            stale.append(f"Left out: the record of {rec.label} on {m.key} was measured with another model file or KV "
                         f"cache ({rec.model.get('file_name')}, KV {kv[0]}/{kv[1]}); measure {rec.label} again.")
            continue
        if m.key in measured.get(rec.label, {}):
            raise QevalError(f"two speed and memory records of {rec.label} on machine {m.key}: keep one")
        machines[m.key] = m
        measured.setdefault(rec.label, {})[m.key] = Measured(rec, m)
    if not measured and not stale:
        return None
    shown = _shown_machine(machines, current, machine)
    return DeploymentBoard(machine=shown, machines=machines, measured=measured, stale=tuple(stale))


def _shown_machine(machines: dict[str, Machine], current: str, asked: str | None) -> Machine:
    if asked is None:
        return next((m for m in machines.values() if m.current), Machine(current[:12], {"id": current}, True))
    found = [m for k, m in machines.items() if k.startswith(asked.lower())]
    if len(found) != 1:
        known = "; ".join(f"{m.key}: {m.text}" for m in machines.values()) or "none"
        why = "matches several" if found else "is none"
        raise QevalError(f"--machine {asked!r} {why} of the machines these rows were measured on ({known})")
    return found[0]


def with_front(board: DeploymentBoard, rows, qualities: Sequence[str]) -> DeploymentBoard:
    """Fill the board's fronts: every (quality in `qualities`, measured context or none, measured depth or none) for
    the HTML page, and the front column's: mean KLD × memory at the largest measured context × generation speed at
    the deepest measured depth."""
    contexts, depths = (*board.contexts(), None), (*board.depths(), None)
    for by in qualities:
        candidates = board.candidates(rows, by)
        better = deployment_choice.better(by)
        for n_ctx in contexts:
            for depth in depths:
                if (n_ctx, depth) != (None, None):
                    board.fronts[by, n_ctx, depth] = deployment_choice.front(candidates, better, n_ctx, depth)
    board.front_at = (contexts[-2] if len(contexts) > 1 else None, depths[-2] if len(depths) > 1 else None)
    board.front = frozenset(board.fronts.get(("kld_mean", *board.front_at), ()))
    return board


def other_machines_markdown(board: DeploymentBoard, rows) -> list[str]:
    """A table per machine other than the board's: the speed and memory of the rows (BoardRow) measured there."""
    out = []
    for m in board.others:
        mine = [r for r in rows if board.on(r.label, m.key) is not None]
        settings = sorted({settings_text(board.on(r.label, m.key).record.settings) for r in mine})
        out += [f"**Measured on another machine, {m.key}:** {m.text}; engine settings {'; '.join(settings)}. Not "
                "comparable with the columns above.", "",
                markdown_table(["label", "KV", *(h for h, _ in board.columns(m.key, front=False))],
                               [[r.label, r.kv, *board.cells(r.label, m.key, front=False)] for r in mine]), ""]
    return out
