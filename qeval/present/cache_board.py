"""One board for the cache decision (docs/cache-board.md): rows are model quant × K/V type, joined by label across
measurements that are separate runs with separate reference stores, each a column group of its own:

  a prose run (a matrix over text)       KLD ± SE in every depth band of its windows, and over the floor
  a conversation run (--score assistant)  KLD ± SE of the tool calls and answers at each history depth (tool_call@D)
  needle results (qeval needle --json)    agreement with the reference (k/n, Wilson interval) per depth per n_ctx
  deployment records (qeval deploy)       KV cache MiB at each measured context, generation tok/s at each depth

A source is one leaderboard (qeval.present.leaderboard: one reference store, one token set); every source and needle
file must be of the same reference model (label and fingerprint), else one QevalError names what differs. A row a
source does not hold has empty cells there. The reference (the f16 cache), the numerics floor and the control are rows
like the others, named in the role column.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qeval.errors import QevalError
from qeval.identity import changes
from qeval.present import board as boardrows
from qeval.present import deployment_board, leaderboard
from qeval.present.board import BoardRow
from qeval.present.deployment_board import FAILED, NOT_MEASURED, DeploymentBoard
from qeval.present.html_page import page_html
from qeval.present.markdown import markdown_table
from qeval.present.needles_text import share

MIB = 2**20
DEFAULT_OUT = "cache-board"
# the segments of a conversation run a cache decision reads (at every history depth: tool_call@4096)
SEGMENTS = ("tool_call", "answer")


@dataclass(frozen=True)
class Column:
    """One column: its heading, its written key, and a row's cell and written values by label."""

    heading: str
    key: str
    cell: Callable[[str], str]
    values: Callable[[str], dict]


@dataclass(frozen=True)
class Source:
    """One leaderboard of saved results (one reference store): a prose run or a conversation run."""

    board: leaderboard.Leaderboard

    @property
    def name(self) -> str:
        """What its columns are named by: its corpus and context, austen-northanger-abbey@8192."""
        s = self.board.settings
        return f"{s['corpus']['name'] or '?'}@{s['n_ctx']}"

    @property
    def conversation(self) -> bool:
        return bool(self.board.segments)

    def row(self, label: str) -> BoardRow | None:
        return next((r for r in self.board.rows if r.label == label), None)

    def _bands(self, label: str) -> list:
        """A row's depth bands (its saved result's by_depth)."""
        res = next((r for r in self.board.results if r.label == label), None)
        return [] if res is None else res.summary.by_depth or []

    def groups(self) -> tuple[str, ...]:
        """Its token groups, a KLD column each: every depth band (prose), the tool calls and answers at each depth
        (conversations)."""
        if self.conversation:
            return tuple(n for n in self.board.segments if n.partition("@")[0] in SEGMENTS)
        bands = {(g.lo, g.hi): g.name for r in self.board.rows for g in self._bands(r.label)}
        return tuple(bands[k] for k in sorted(bands))

    def group(self, label: str, name: str):
        """A row's figures of one group; None where it holds none (or is not on this source)."""
        row = self.row(label)
        if row is None:
            return None
        held = row.segments if self.conversation else {g.name: g for g in self._bands(label)}
        return held.get(name)

    def columns(self) -> list[Column]:
        out = [Column(f"{self.name} KLD {name} ± SE", f"{self.name}/kld_{name}",
                      lambda label, n=name: boardrows.kld_cell(self.group(label, n)),
                      lambda label, n=name: boardrows.kld_of(self.group(label, n), f"{self.name}/kld_{n}"))
               for name in self.groups()]
        if boardrows.has_floor(self.board.rows):
            key = f"{self.name}/kld_over_floor"
            out.append(Column(f"{self.name} KLD over floor ± SE", key, self._floor_cell,
                              lambda label: self._over_floor(label, key)))
        return out

    def _floor_cell(self, label: str) -> str:
        row = self.row(label)
        return "" if row is None else boardrows.floor_cell(row)

    def _over_floor(self, label: str, key: str) -> dict:
        row = self.row(label)
        held = row is not None
        return {key: row.kld_over_floor if held else None, f"{key}_se": row.kld_over_floor_se if held else None}

    def to_json(self) -> dict:
        return {"name": self.name, "kind": "conversation" if self.conversation else "prose",
                "settings": self.board.settings, "results": [str(r.path) for r in self.board.results]}


@dataclass(frozen=True)
class Needles:
    """A `qeval needle --json` result, read from `path`."""

    path: str
    result: dict

    @property
    def reference(self) -> dict:
        ref = self.result["contexts"][0]["reference"] if self.result["contexts"] else {}
        return {"label": self.result["reference"], "fingerprint": ref.get("fingerprint")}

    def rows(self) -> dict:
        """(n_ctx, label) -> its candidate row."""
        return {(block["n_ctx"], cand["label"]): cand for block in self.result["contexts"]
                for cand in block["candidates"]}


def _needle_columns(files: list[Needles]) -> list[Column]:
    """A column per n_ctx and depth any file holds: each row's agreement there; a label at one n_ctx in two files is
    refused."""
    held: dict[tuple, tuple[str, dict]] = {}
    for f in files:
        for (n_ctx, label), cand in f.rows().items():
            if (n_ctx, label) in held:
                raise QevalError(f"two needle results for {label} at n_ctx {n_ctx}: {held[n_ctx, label][0]} and "
                                 f"{f.path}; pass only one of them")
            held[n_ctx, label] = (f.path, cand)
    at = {(n, d["depth"]) for (n, _), (_, cand) in held.items() for d in cand["depths"]}

    def agreement(label: str, n_ctx: int, depth: float) -> dict | None:
        cand = held.get((n_ctx, label), (None, {}))[1]
        return next((d["agreement"] for d in cand.get("depths", ()) if d["depth"] == depth), None)

    def values(label: str, key: str, n_ctx: int, depth: float) -> dict:
        a = agreement(label, n_ctx, depth) or {}
        return {f"{key}_{k}": a.get(k) for k in ("hits", "n", "p", "lo", "hi")}

    return [Column(f"needles c{n} agreement @ {d:g} %", f"needles@{n}/agreement@{d:g}",
                   lambda label, n=n, d=d: "" if agreement(label, n, d) is None else share(agreement(label, n, d)),
                   lambda label, n=n, d=d: values(label, f"needles@{n}/agreement@{d:g}", n, d))
            for n, d in sorted(at)]


def _deployment_columns(view: DeploymentBoard | None) -> list[Column]:
    """KV cache MiB at each context and generation tok/s at each depth measured on the board's machine."""
    if view is None:
        return []

    def kv_mib(label: str, n_ctx: int) -> float | str | None:
        m = view.on(label)
        figure = None if m is None else m.memory_at(n_ctx)
        if isinstance(figure, str):
            return figure
        kv = m.parts_at(n_ctx).get("kv") if figure is not None else None
        return None if kv is None else kv / MIB

    def cell(figure, fmt: str) -> str:
        return NOT_MEASURED if figure is None else FAILED if isinstance(figure, str) else f"{figure:{fmt}}"

    def tg(label: str, depth: int):
        m = view.on(label)
        return None if m is None else m.tg_at(depth)

    def number(figure):
        return figure if isinstance(figure, (int, float)) else None

    return [*(Column(f"KV MiB @ ctx {n}", f"kv_mib@{n}", lambda label, n=n: cell(kv_mib(label, n), ",.1f"),
                     lambda label, n=n: {f"kv_mib@{n}": number(kv_mib(label, n))}) for n in view.contexts()),
            *(Column(f"tg t/s @ d{d}", f"tg@d{d}", lambda label, d=d: cell(tg(label, d), ",.1f"),
                     lambda label, d=d: {f"tg@d{d}": number(tg(label, d))}) for d in view.depths())]


@dataclass
class CacheBoard:
    title: str
    reference: dict  # label, fingerprint, model_file
    labels: list[str]  # the rows, in order
    kv: dict[str, str]  # label -> its K/V types as allocated
    roles: dict[str, str]  # label -> "reference", "floor", "control" or ""
    quants: dict[str, str]
    sources: list[Source]
    needles: list[Needles]
    columns: list[Column]  # after label, role, quant and K/V: each source's, the needles', speed and memory
    deployment: DeploymentBoard | None = None
    paths: dict[str, Path] = field(default_factory=dict)

    def header(self) -> list[str]:
        return ["label", "role", "quant", "K/V", *(c.heading for c in self.columns)]

    def cells(self) -> list[list[str]]:
        return [[label, self.roles[label], self.quants[label], self.kv[label], *(c.cell(label) for c in self.columns)]
                for label in self.labels]

    def records(self) -> list[dict]:
        return [{"label": label, "role": self.roles[label] or None, "quant": self.quants[label], "kv": self.kv[label],
                 **{k: v for c in self.columns for k, v in c.values(label).items()}} for label in self.labels]

    def lines(self) -> list[tuple[str, str]]:
        """(name, text) above the table: the reference, each source, each needle file, the deployment machine."""
        ref = self.reference
        out = [("Reference", ref["label"] + (f" ({ref['model_file']})" if ref.get("model_file") else "")
                + (f", fingerprint {ref['fingerprint'][:16]}…" if ref.get("fingerprint") else ""))]
        for s in self.sources:
            st = s.board.settings
            held = f"n_ctx {st['n_ctx']}, {st['chunks']} chunks, {st['scored_tokens']:,} scored tokens"
            out.append((f"{'Conversations' if s.conversation else 'Prose'} {s.name}",
                        f"{held}, {len(s.board.rows)} results"))
        for f in self.needles:
            r = f.result
            asked = f"{r['needles']['source']} ({r['needles']['count']}), corpus {r['corpus']}"
            out.append((f"Needles {f.path}", f"{asked}, {r['trials']} trials, seed {r['seed']}"))
        if self.deployment is not None:
            out += self.deployment.lines()
        return out

    def notes(self) -> list[str]:
        out = [NOTE]
        if any(boardrows.has_floor(s.board.rows) for s in self.sources):
            out.append(boardrows.FLOOR_NOTE)
        if self.deployment is not None:
            out += [DEPLOYMENT_NOTE, *self.deployment.stale]
        return out


NOTE = ("Rows are joined by label across the sources; an empty cell: that source does not hold the row. K/V: the "
        "cache types as llama.cpp allocated them. <source> KLD <band> ± SE: mean KLD against the reference over the "
        "scored tokens at logit positions [lo, hi) of a prose run, SE cluster-robust; <source> KLD tool_call@D / "
        "answer@D: over the assistant's tool calls / answers after a history of D tokens (--score "
        "assistant@D1,D2). needles cN agreement @ d %: the share of needle answers (argmax, teacher-forced) "
        "that agree with the reference's at that depth of an n_ctx N window, [95 % Wilson interval] (agreeing/asked). "
        "± is one standard error.")
DEPLOYMENT_NOTE = ("KV MiB @ ctx C: the KV cache llama.cpp allocates for the row at deployment context C (every "
                   "device); tg t/s @ dD: llama-bench's generation test after a prefill to depth D, median tokens/s. "
                   "\"not measured\": no figure there; \"failed\": measured and failed (why in the JSON). Both belong "
                   "to the machine named above.")


# --------------------------------------------------------------------------------------------------
# joining
# --------------------------------------------------------------------------------------------------
def split_by_reference_store(loaded: list) -> list[list]:
    """Results (qeval.present.results.Result) in groups of one board identity each (one reference store, one token
    set: leaderboard.board_identity), in the order first seen."""
    groups: list[tuple[dict, list]] = []
    for res in loaded:
        identity = leaderboard.board_identity(res)
        group = next((g for key, g in groups if not changes(key, identity)), None)
        if group is None:
            groups.append((identity, [res]))
        else:
            group.append(res)
    return [g for _, g in groups]


def _reference_of(source: Source) -> tuple[str, dict]:
    ref = source.board.settings["reference"]
    where = ", ".join(sorted({str(Path(r.path).parent) for r in source.board.results}))
    return where, {"label": ref["label"], "fingerprint": ref["fingerprint"]}


def check_one_reference(sources: list[Source], needles: list[Needles]) -> None:
    """Refuse sources and needle files of different reference models (label, and fingerprint where both know it)."""
    named = [_reference_of(s) for s in sources] + [(f.path, f.reference) for f in needles]
    first_where, first = named[0]
    for where, ref in named[1:]:
        known = {k: v for k, v in ref.items() if v is not None and first.get(k) is not None}
        diffs = changes({k: first[k] for k in known}, known)
        if diffs:
            raise QevalError(f"{first_where} (reference {first['label']}) and {where} (reference {ref['label']}) were "
                             f"measured against different reference models ({'; '.join(diffs)}); a cache board joins "
                             "measurements of one reference model")
    names = [s.name for s in sources]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        paths = [_reference_of(s)[0] for s in sources if s.name == twice]
        raise QevalError(f"two runs of {twice} (corpus@n_ctx) over other token sets: {' and '.join(paths)}; "
                         "pass only one of them")


def _needle_kv(cand: dict) -> str:
    kv = cand.get("kv_allocated") or cand.get("kv") or {}
    return f"{kv.get('type_k', '?')}/{kv.get('type_v', '?')}"


def build(sources: list[Source], needles: list[Needles] = (), title: str | None = None,
          deployment: deployment_board.Records | None = None) -> CacheBoard:
    """The board of `sources` (one leaderboard each) and needle files, with `deployment`'s speed and memory."""
    needles = list(needles)
    check_one_reference(sources, needles)
    reference = boardrows.reference_row(sources[0].board.results[0].summary)
    rows: dict[str, BoardRow] = {reference.label: reference}
    for s in sources:
        for row in sorted(s.board.rows, key=boardrows.rank_key):
            rows.setdefault(row.label, row)
    kv = {label: f"{row.type_k}/{row.type_v}" for label, row in rows.items()}
    for f in needles:
        for block in f.result["contexts"]:
            for cand in [block["reference"], *block["candidates"]]:
                _join_kv(kv, cand["label"], _needle_kv(cand), f.path)
    for s in sources:
        for row in s.board.rows:
            _join_kv(kv, row.label, f"{row.type_k}/{row.type_v}", _reference_of(s)[0])
    labels = [*sorted(rows, key=lambda label: boardrows.rank_key(rows[label])), *sorted(set(kv) - set(rows))]
    roles = {label: _role(rows.get(label)) for label in labels}
    quants = {label: rows[label].quant if label in rows else "" for label in labels}
    view = None
    if deployment is not None:
        view = deployment_board.match(list(rows.values()), deployment.records, deployment.current, deployment.machine)
    ref = sources[0].board.settings["reference"]
    columns = [*(c for s in sources for c in s.columns()), *_needle_columns(needles), *_deployment_columns(view)]
    return CacheBoard(title=title or f"Cache decision: {ref['model_file'] or ref['label']}",
                      reference={k: ref[k] for k in ("label", "fingerprint", "model_file")}, labels=labels, kv=kv,
                      roles=roles, quants=quants, sources=sources, needles=needles, columns=columns, deployment=view)


def _join_kv(kv: dict[str, str], label: str, types: str, where: str) -> None:
    """A label's K/V types, the same in every source that holds it."""
    held = kv.setdefault(label, types)
    if held != types:
        raise QevalError(f"{label} has K/V {held} in one source and {types} in {where}: one label, one cache; "
                         "label the runs alike")


def _role(row: BoardRow | None) -> str:
    if row is None:
        return ""
    return "reference" if row.reference else "control" if row.control else "floor" if row.floor else ""


# --------------------------------------------------------------------------------------------------
# outputs
# --------------------------------------------------------------------------------------------------
def markdown_page(board: CacheBoard) -> str:
    return "\n".join([f"## {board.title}", "", *(f"- **{k}:** {v}" for k, v in board.lines()), "",
                      markdown_table(board.header(), board.cells()), "", "\n\n".join(board.notes()), ""])


def board_json(board: CacheBoard) -> dict:
    """Strict JSON (a NaN becomes null)."""
    records = board.records()
    return leaderboard.strict_json({
        "title": board.title, "reference": board.reference, "sources": [s.to_json() for s in board.sources],
        "needles": [{"file": f.path, **{k: v for k, v in f.result.items() if k != "contexts"}} for f in board.needles],
        "columns": list(records[0]) if records else [], "rows": records, "notes": board.notes(),
        **({"deployment": board.deployment.to_json()} if board.deployment is not None else {})})


def board_html(board: CacheBoard) -> str:
    settings = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in board.lines())
    head = "".join(f"<th>{html.escape(h)}</th>" for h in board.header())
    number = ' class="num"'  # every column after label, role, quant and K/V
    body = "".join("<tr>" + "".join(f"<td{'' if i < 4 else number}>{html.escape(c)}</td>"
                                    for i, c in enumerate(cells)) + "</tr>" for cells in board.cells())
    notes = "".join(f'<p class="notes">{html.escape(n)}</p>' for n in board.notes())
    return page_html(board.title, f'<dl class="settings">{settings}</dl>'
                                  f'<div class="table-wrap"><table id="cache-board"><thead><tr>{head}</tr></thead>'
                                  f"<tbody>{body}</tbody></table></div>{notes}")


TEXT_OUTPUTS = {"cache-board.md": markdown_page,
                "cache-board.json": lambda b: json.dumps(board_json(b), indent=2, allow_nan=False),
                "cache-board.html": board_html}


def write(board: CacheBoard, out: str | os.PathLike = DEFAULT_OUT) -> CacheBoard:
    """Write cache-board.{md,json,html} into `out`; fills board.paths."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, render in TEXT_OUTPUTS.items():
            board.paths[name] = out / name
            board.paths[name].write_text(render(board), newline="")
    except OSError as exc:
        raise QevalError(f"cannot write the cache board into {out}: {exc.strerror or exc}") from None
    return board

