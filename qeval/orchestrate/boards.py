"""Boards with speed and memory: the deployment records beside a board's results and the id of this machine
(qeval.present.deployment_board.Records), the boards of `qeval leaderboard` and `qeval card` built with them, and
`qeval choose`, the deployment question asked of them (qeval.compare.deployment_choice).

Records are read from the runs directory of every result on the board (RUNS_DIR/deployment/), any machine's; which
machine a board shows is the present stage's business.
"""

from __future__ import annotations

import os
from pathlib import Path

from qeval.compare import deployment_choice
from qeval.errors import QevalError
from qeval.present import deployment_board
from qeval.present.deployment_board import Records
from qeval.storage.deployment import DEPLOYMENT_SUBDIR, load_records
from qeval.storage.results import find_results, runs_dir_of


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


def choose(runs: list[str | os.PathLike], question: deployment_choice.Question,
           machine: str | None = None) -> tuple[dict, str]:
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
    return ({**choice.to_json(), "machine": view.machine.key, "board": board.title},
            deployment_board.choice_text(view, choice, board.table_rows))
