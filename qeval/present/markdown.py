"""The one markdown table writer: every table qeval prints or writes into a card goes through it."""

from __future__ import annotations

from collections.abc import Collection, Iterable


def markdown_table(header: Iterable[object], rows: Iterable[Iterable[object]], right: Collection[int] = ()) -> str:
    """A markdown table: the heading line, its rule (`---:` for the columns numbered in `right`, right-aligned), a line
    per row. A `|` in a heading or cell is escaped and a line break becomes `<br>`, so no cell can break the table."""
    header = list(header)
    rule = "|" + "".join("---:|" if i in right else "---|" for i in range(len(header)))
    return "\n".join([_line(header), rule, *map(_line, rows)])


def _line(cells: Iterable[object]) -> str:
    return "| " + " | ".join(map(_cell, cells)) + " |"


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\r\n", "<br>").replace("\n", "<br>").replace("\r", "<br>")
