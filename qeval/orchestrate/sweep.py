"""A matrix end to end: plan it (qeval.orchestrate.matrix), run its captures and pairs here or as Ray tasks
(qeval.orchestrate.distributed), score its task sets, and build its result. `qeval matrix` and `qeval demo`
both run through here."""

from __future__ import annotations

from qeval.errors import QevalError
from qeval.orchestrate import matrix
from qeval.orchestrate.distributed import as_executor
from qeval.present.progress import progress_bar


def run_matrix(request: matrix.MatrixRequest, progress: bool = True, executor=None) -> tuple[dict, str]:
    """The matrix of a request (see qeval.api.matrix_report), here or on `executor`."""
    plan = matrix.plan_matrix(request)
    directory = request.directory
    directory.mkdir(parents=True, exist_ok=True)
    if executor not in (None, "local"):
        if plan.early is not None:
            raise QevalError("--early runs here (--executor local): its pairs advance in rounds, each deciding on "
                             "the whole board")
        run = as_executor(executor).run(plan, progress)
    else:
        with progress_bar(f"matrix: reference + {len(plan.pairs)} pairs", plan.total_chunks, progress) as advance:
            run = matrix.run_local(plan, advance, announce=progress)
    with progress_bar(f"matrix: {len(plan.tasks)} task sets x {1 + len(plan.pairs)} models", None,
                      progress and bool(plan.tasks)) as advance:
        task_lines = matrix.run_tasks(plan, on_tasks=advance)
    return matrix.matrix_result(plan, run, task_lines)
