"""A model card block inside a markdown file (`qeval card --merge README.md`), between two marker lines:

    <!-- qeval-card:begin -->
    ...the block...
    <!-- qeval-card:end -->

A file that has the markers gets what lies between them replaced; a file without them gets the block appended at its
end after a blank line (so after the YAML front matter of a file that holds only front matter). Every byte outside
the markers stays as it was, front matter and line endings included; the block takes the file's line endings
(CRLF when the file has any), so merging twice gives the same bytes. A marker counts only as a line of its own: a
README may quote one in running text. The file is replaced by rename, never written in place.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from qeval.errors import QevalError

BEGIN, END = "<!-- qeval-card:begin -->", "<!-- qeval-card:end -->"
APPENDED, REPLACED, UNCHANGED = "appended", "replaced", "unchanged"


def _marker_lines(text: str, marker: str) -> list[re.Match]:
    return list(re.finditer(rf"^{re.escape(marker)}(?=\r?$)", text, flags=re.MULTILINE))


def merged(text: str, body: str, where: str) -> tuple[str, str]:
    """(the text with `body` between the markers, APPENDED or REPLACED). body: markdown lines, each ending in
    "\\n"; a file with a begin marker and no end marker, or more than one of either, is refused."""
    newline = "\r\n" if "\r\n" in text else "\n"
    body = body.replace("\n", newline)
    begins, ends = _marker_lines(text, BEGIN), _marker_lines(text, END)
    if not begins and not ends:
        return _appended(text, f"{BEGIN}{newline}{body}{END}{newline}", newline), APPENDED
    if len(begins) != 1 or len(ends) != 1 or ends[0].start() < begins[0].end():
        raise QevalError(f"{where} has {len(begins)} line(s) {BEGIN} and {len(ends)} line(s) {END}: a card block "
                         "is one begin line, then one end line; fix or remove them by hand, then merge again")
    return text[:begins[0].end()] + newline + body + text[ends[0].start():], REPLACED


def _appended(text: str, block: str, newline: str) -> str:
    if not text:
        return block
    if not text.endswith(newline):
        text += newline
    return text + ("" if text.endswith(newline * 2) else newline) + block


@dataclass
class PendingMerge:
    """A merge checked and computed, not yet written: refused markers stop a command before it writes anything."""

    path: Path
    original: bytes
    new: bytes
    action: str  # APPENDED or REPLACED

    def apply(self) -> str:
        """Write the file (unless it already holds this block); returns APPENDED, REPLACED or UNCHANGED."""
        if self.new == self.original:
            return UNCHANGED
        _replace(self.path, self.new)
        return self.action


def prepare(path: str | os.PathLike, body: str) -> PendingMerge:
    """The merge of `body` into the markdown file at `path` (merged()), read and checked."""
    path = Path(path)
    original = _read(path)
    try:
        text = original.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise QevalError(f"--merge {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    new_text, action = merged(text, body, str(path))
    return PendingMerge(path, original, new_text.encode("utf-8"), action)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise QevalError(f"--merge {path}: no such file (create it, or take the block from card.md)") from None
    except OSError as exc:
        raise QevalError(f"cannot read --merge file {path}: {exc.strerror or exc}") from None


def _replace(path: Path, data: bytes) -> None:
    """Write beside the file, then rename over it: an interrupted write leaves the old file whole. A symlink's
    target is replaced, not the link; the file keeps its permissions."""
    target = path.resolve()
    tmp = target.with_name(f".{target.name}.qeval-card.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, target.stat().st_mode & 0o7777)
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise QevalError(f"cannot write --merge file {path}: {exc.strerror or exc}") from None
