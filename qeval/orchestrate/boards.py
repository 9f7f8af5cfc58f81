"""Boards with speed and memory: the deployment records beside a board's results and the id of this machine
(qeval.present.deployment_board.Records), the boards of `qeval leaderboard` and `qeval card` built with them, and
`qeval choose`, the deployment question asked of them (qeval.compare.deployment_choice), read here from what a user
typed (read_question).

Records are read from the runs directory of every result on the board (RUNS_DIR/deployment/), any machine's; which
machine a board shows is the present stage's business.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from qeval.compare import deployment_choice
from qeval.compare.deployment_choice import GIB, Question
from qeval.errors import QevalError
from qeval.present import choose_text
from qeval.present.deployment_board import Records
from qeval.storage.deployment import DEPLOYMENT_SUBDIR, load_records
from qeval.storage.results import find_results, runs_dir_of


SIZE_UNITS = {"": GIB, "g": GIB, "gib": GIB, "gb": 10**9, "m": 2**20, "mib": 2**20, "mb": 10**6,
              "t": 2**40, "tib": 2**40, "tb": 10**12}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)
_COUNT = re.compile(r"\s*([0-9]+)\s*(k?)\s*", re.IGNORECASE)
DEFAULT_DEPTH = 0  # a speed asked without a depth is read at llama-bench's own default depth (-d 0)


def parse_size(text: str, what: str = "--memory") -> float:
    """A memory limit in GiB: a number of GiB (8, 7.5) or a number with a unit (8GiB, 8G, 8000MiB, 8GB: 10^9
    bytes)."""
    m = _SIZE.fullmatch(str(text))
    unit = m.group(2).lower() if m else None
    if unit not in SIZE_UNITS:
        raise QevalError(f"{what} {text!r} is not a size: give GiB as a number (8, 7.5) or a number with a unit "
                         "(8GiB, 8000MiB, 8GB)")
    gib = float(m.group(1)) * SIZE_UNITS[unit] / GIB
    if not gib > 0 or not math.isfinite(gib):
        raise QevalError(f"{what} {text!r} must be a positive size")
    return gib


def parse_count(text: str | int, what: str) -> int:
    """A token count: digits, or digits and k (32k = 32,768 tokens, as llama.cpp's contexts are counted)."""
    m = _COUNT.fullmatch(str(text))
    if not m:
        raise QevalError(f"{what} {text!r} is not a token count: give tokens (32768) or thousands of 1,024 (32k)")
    return int(m.group(1)) * (1024 if m.group(2) else 1)


def read_question(memory: str | float | None = None, context: str | int | None = None,
                  min_tg: str | float | None = None, depth: str | int | None = None, by: str = "kld_mean") -> Question:
    """The question from text as typed (--memory 8GiB --context 32k --min-tg 20 --depth 4096); a speed asked
    without a depth is read at depth 0 (DEFAULT_DEPTH)."""
    if min_tg is not None:
        try:
            min_tg = float(min_tg)
        except ValueError:
            raise QevalError(f"--min-tg {min_tg!r} is not a speed in tokens/s") from None
        depth = DEFAULT_DEPTH if depth is None else depth
    return Question(memory_gib=None if memory is None else parse_size(memory),
                    n_ctx=None if context is None else parse_count(context, "--context"), min_tg=min_tg,
                    depth=None if depth is None else parse_count(depth, "--depth"), by=by)


def records_in(runs_dir: Path) -> list:
    """Every deployment record of a runs directory, any machine's."""
    return load_records(runs_dir)


def this_machine() -> str:
    """The id of the machine this runs on, as its records name it."""
    from qeval.engine.machine import current_machine  # noqa: PLC0415 - llama.cpp's system info, nvidia-smi, on demand

    return current_machine()["id"]


def records_for(runs: list[str | os.PathLike], machine: str | None = None) -> Records | None:
    """The records beside the results `runs` names (their runs directories' deployment/), this machine's id and
    the machine asked for; None when there are none (a machine asked for is then refused)."""
    dirs = dict.fromkeys(runs_dir_of(p).resolve() for p in find_results(list(runs)))
    records = [rec for d in dirs if (d / DEPLOYMENT_SUBDIR).is_dir() for rec in records_in(d)]
    if not records:
        if machine is not None:
            raise QevalError(f"--machine {machine}: no speed or memory record beside these results "
                             f"(looked in {', '.join(str(d / DEPLOYMENT_SUBDIR) for d in dirs)})")
        return None
    return Records(tuple(records), this_machine(), machine)


def leaderboard(runs: list[str | os.PathLike], out, title: str | None = None, machine: str | None = None):
    """`qeval leaderboard`: the board of saved results with the speed and memory beside them, written under
    `out`."""
    from qeval.present import leaderboard as boards  # noqa: PLC0415 - matplotlib loads only for boards

    return boards.write(boards.build(runs, title=title, deployment=records_for(runs, machine)), out)


def card(runs: list[str | os.PathLike], out, merge=None, title: str | None = None,
         machine: str | None = None) -> tuple[dict, str]:
    """`qeval card`: the model-card block with the speed and memory beside the results."""
    from qeval.present import card as cards  # noqa: PLC0415 - matplotlib loads only for cards and boards

    return cards.report(runs, out=out, merge=merge, title=title, deployment=records_for(runs, machine))


def choose(runs: list[str | os.PathLike], question: Question, machine: str | None = None) -> tuple[dict, str]:
    """`qeval choose`: the deployment question over the board of saved results, (JSON, text)."""
    from qeval.present import leaderboard as boards  # noqa: PLC0415

    records = records_for(runs, machine)
    board = boards.build(runs, deployment=records) if records is not None else None
    if board is None or board.deployment is None:
        raise QevalError("no speed or memory record of any row beside these results: measure them first "
                         "(qeval deploy), then ask")
    view = board.deployment
    view.check(question)
    choice = deployment_choice.choose(view.candidates(board.table_rows, question.by), question)
    return ({**choose_text.choice_json(choice), "machine": view.machine.key, "board": board.title},
            choose_text.choice_text(view, choice, board.table_rows))


def read_needles(path: str | os.PathLike):
    """A `qeval needle --json` result from its file (qeval.present.cache_board.Needles)."""
    from qeval.present.cache_board import Needles  # noqa: PLC0415

    try:
        result = json.loads(Path(path).read_text())
    except OSError as exc:
        raise QevalError(f"cannot read needle results {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise QevalError(f"{path} is not JSON ({exc}): give the file `qeval needle ... --json` wrote") from None
    if not isinstance(result, dict) or not isinstance(result.get("contexts"), list) or "reference" not in result:
        raise QevalError(f"{path} is not a needle result (no reference and contexts): give the file `qeval needle "
                         "... --json` wrote")
    return Needles(str(path), result)


def cache_board(runs: list[str | os.PathLike], needles=(), out=None, title: str | None = None,
                machine: str | None = None):
    """`qeval cache-board`: the results of `runs` as one source per reference store (a prose run, a conversation
    run), the needle files `needles` and the speed and memory records beside the results, joined by label; written
    under `out` when given."""
    from qeval.present import cache_board as cache  # noqa: PLC0415
    from qeval.present import leaderboard as boards  # noqa: PLC0415 - matplotlib loads only for boards

    if not runs:
        raise QevalError("name at least one result file or directory of results")
    groups = cache.split_by_reference_store(boards.load_results(runs))
    board = cache.build([cache.Source(boards.build(loaded=g)) for g in groups], [read_needles(p) for p in needles],
                        title=title, deployment=records_for(runs, machine))
    return cache.write(board, out) if out is not None else board
