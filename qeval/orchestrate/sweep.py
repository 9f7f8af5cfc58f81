"""A matrix end to end: plan it (qeval.orchestrate.matrix), run its captures and pairs here or as Ray tasks
(qeval.orchestrate.distributed), score its task sets, and build its result. `qeval matrix` and `qeval demo`
both run through here."""

from __future__ import annotations

from qeval.errors import QevalError
from qeval.orchestrate import deploy, matrix
from qeval.orchestrate.distributed import as_executor
from qeval.present.progress import progress_bar, say


def run_matrix(request: matrix.MatrixRequest, progress: bool = True, executor=None) -> tuple[dict, str]:
    """The matrix of a request (see qeval.api.matrix_report), here or on `executor`; with request.deploy, then the
    speed and memory of the reference and every pair, here, one row at a time after every pair is done (under Ray
    too: the figures are this machine's, recorded as such)."""
    plan = matrix.plan_matrix(request)
    rows = matrix.deploy_rows(plan) if request.deploy is not None else []
    if rows:
        deploy.plan_rows(rows, request.deploy)  # a spec beyond a model's trained context: refused before any work
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
    result, text = matrix.matrix_result(plan, run, task_lines)
    if not rows:
        return result, text
    measured = deploy.measure_rows(rows, request.deploy, directory, say=lambda line: say(line, progress))
    return {**result, "deployment": measured.to_json()}, text + "\n\n" + measured.text()
