"""The `choose` rule once: the deployment page's rule (qeval.present.deployment_page.RULES), taken from a page the
package wrote, run under Node.js over shared cases, every decision held to Python's (qeval.compare.deployment_choice:
which rows pass and in which order, which are ruled out and why) and every reason to the words of
qeval.present.choose_text. CI installs node (.ci/run); there this test fails rather than skips without it.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess

import pytest
from test_deployment_board import CTX, DEPTH, board_of, here_machine, runs  # noqa: F401 (fixtures)

from qeval.compare import deployment_choice
from qeval.compare.deployment_choice import GIB, Candidate, Question
from qeval.present import leaderboard
from qeval.present.choose_text import reason_text
from qeval.present.deployment_board import CONTROL_WHY, FLOOR_WHY
from qeval.present.deployment_page import candidate_data, qualities_data

# runs the page's rule over the cases on stdin: [{data, q}] -> [{passing: [label], ruled: [[label, [[kind, text]]]]}]
HARNESS = """
const cases = JSON.parse(require("fs").readFileSync(0, "utf8"));
console.log(JSON.stringify(cases.map(function (c) {
  const d = qevalChoose.decide(c.data, c.q);
  return {passing: d.passing.map(function (r) { return r.label; }),
          ruled: d.ruled.map(function (rw) { return [rw[0].label, rw[1]]; })};
})));
"""


@pytest.fixture(scope="module")
def node() -> str:
    found = shutil.which("node") or shutil.which("nodejs")
    if found is None:
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail("no node on PATH: .ci/run installs it (apt-get install -y nodejs); the page's rule is checked "
                        "against Python's in CI")
        pytest.skip("no node on PATH: install it (apt-get install -y nodejs) to check the page's rule")
    return found


@pytest.fixture(scope="module")
def page(runs, tmp_path_factory) -> str:  # noqa: F811
    written = leaderboard.write(board_of(runs), tmp_path_factory.mktemp("page"))
    return written.paths["leaderboard.html"].read_text()


@pytest.fixture(scope="module")
def rule(page) -> str:
    """The rule's script as the written page holds it."""
    found = re.search(r'<script id="choose-rule">(.*?)</script>', page, re.S)
    assert found, "the page holds no choose-rule script"
    return found.group(1)


def run_rule(node: str, rule: str, cases: list[dict], tmp_path) -> list[dict]:
    script = tmp_path / "rule.js"
    script.write_text(rule + HARNESS)
    done = subprocess.run([node, str(script)], input=json.dumps(cases, allow_nan=False), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def as_page(q: Question) -> dict:
    return {"by": q.by, "mem": q.memory_gib, "ctx": q.n_ctx, "tg": q.min_tg, "depth": q.depth}


def python_decision(candidates: list[Candidate], q: Question) -> dict:
    choice = deployment_choice.choose(candidates, q)
    return {"passing": [c.label for c in choice.passing],
            "ruled": [[c.label, [[r.kind, reason_text(r, q)] for r in why]] for c, why in choice.ruled_out]}


def case(candidates: list[Candidate], q: Question) -> dict:
    rows = [candidate_data(c, {q.by: c.quality}) for c in candidates]
    return {"data": {"qualities": qualities_data(), "rows": rows}, "q": as_page(q)}


# every reason, near misses, ties and figures that round at a tie (9.25 -> 9.2 as Python rounds, not 9.3)
PLAIN = [Candidate("control", 0.0, excluded=CONTROL_WHY), Candidate("floor", 0.0, excluded=FLOOR_WHY),
         Candidate("gone", 0.1), Candidate("there", 0.1, elsewhere="GPU box"),
         Candidate("noq", None, {100: GIB}, {0: 11.0}), Candidate("nan", math.nan, {100: GIB}, {0: 11.0}),
         Candidate("big", 0.1, {100: GIB + 1}, {0: 11.0}), Candidate("slow", 0.1, {100: GIB}, {0: 9.99}),
         Candidate("both", 0.1, {100: 2 * GIB}, {0: 1.0}), Candidate("oom", 0.1, {100: "no room"}, {0: 11.0}),
         Candidate("ctx", 0.1, {200: GIB, 50: GIB}, {4096: 11.0, 0: "crashed"}),
         Candidate("pp-only", 0.1, recorded=True), Candidate("near", 0.1, {100: 1.004 * GIB}, {0: 9.96}),
         Candidate("tie", 0.2, {100: 1.125 * GIB}, {0: 9.25}), Candidate("REF", None, {100: 3 * GIB}, {0: 5.0},
                                                                         reference=True),
         Candidate("ok", 0.1, {100: GIB}, {0: 10.0}), Candidate("b", 0.2, {100: 0.5 * GIB}, {0: 12.0}),
         Candidate("a", 0.2, {100: 0.5 * GIB}, {0: 12.0}), Candidate("fast", 0.2, {100: 0.5 * GIB}, {0: 13.0}),
         Candidate("small", 0.2, {100: 0.25 * GIB}, {0: 10.5})]
PLAIN_QUESTIONS = [Question(memory_gib=1.0, n_ctx=100, min_tg=10.0, depth=0),
                   Question(memory_gib=1.0, n_ctx=100), Question(min_tg=10.0, depth=0),
                   Question(memory_gib=4.0, n_ctx=100, min_tg=0.0, depth=0, by="same_top1_pct"),
                   Question(memory_gib=0.1, n_ctx=200, min_tg=11.0, depth=4096)]


def random_case(rng: random.Random) -> tuple[list[Candidate], Question]:
    contexts, depths = [512, 4096, 32768], [0, 4096]
    q = Question(**({"memory_gib": rng.choice([0.5, 1.0, 1.5, 2.5, 7.5]), "n_ctx": rng.choice(contexts)}
                    if rng.random() < 0.8 else {}),
                 **({"min_tg": rng.choice([0.0, 10.0, 12.5, 20.0, 25.0]), "depth": rng.choice(depths)}
                    if rng.random() < 0.8 else {"min_tg": 5.0, "depth": 0}),
                 by=rng.choice(["kld_mean", "same_top1_pct", "ppl"]))

    def figures(at, value):
        out = {}
        for k in at:
            x = rng.random()
            if x < 0.7:
                out[k] = value()
            elif x < 0.8:
                out[k] = "failed: out of memory"
        return out

    candidates = []
    for i in range(rng.randint(1, 12)):
        kind = rng.random()
        quality = rng.choice([None, math.nan, *[round(rng.uniform(0, 0.5), 3) for _ in range(6)], 0.25, 0.25])
        c = Candidate(f"row{i:02d}", quality,
                      figures(contexts, lambda: rng.choice([0.25, 0.5, 1.0, 1.0 + 1e-9, 1.25, 2.0]) * GIB
                              + rng.randint(0, 3) * 2**20),
                      figures(depths, lambda: rng.choice([9.25, 10.0, 12.5, 19.96, 20.0, 24.25, rng.uniform(0, 40)])),
                      reference=i == 0 and kind < 0.5, recorded=kind < 0.1)
        if 0.9 < kind < 0.95:
            c = Candidate(c.label, c.quality, elsewhere="Intel Xeon 8480+ / NVIDIA H100 80GB HBM3")
        elif kind >= 0.95:
            c = Candidate(c.label, c.quality, c.memory, c.tg, excluded=CONTROL_WHY)
        candidates.append(c)
    return candidates, q


def test_the_pages_rule_decides_every_shared_case_as_python_does(node, rule, tmp_path):
    shared = [(PLAIN, q) for q in PLAIN_QUESTIONS]
    rng = random.Random(41)
    shared += [random_case(rng) for _ in range(300)]
    got = run_rule(node, rule, [case(cs, q) for cs, q in shared], tmp_path)
    for (cs, q), page in zip(shared, got):
        assert page == python_decision(cs, q), (q, [c.label for c in cs])
    kinds = {kind for page in got for _, why in page["ruled"] for kind, _ in why}
    assert kinds == set(deployment_choice.RULE_OUTS)  # every reason was compared
    assert sum(len(page["passing"]) > 1 for page in got) > 50  # and many orders of several passing rows
    plain = dict(got[0]["ruled"])
    assert plain["tie"] == [["does not fit", "does not fit: 1.12 GiB > 1 GiB at context 100"],
                            ["too slow", "too slow: 9.2 tokens/s < 10 tokens/s at depth 0"]]
    assert plain["big"] == [["does not fit", "does not fit: 1.000000 GiB > 1 GiB at context 100"]]
    assert got[0]["passing"] == ["ok", "small", "fast", "a", "b"]  # quality, then memory, speed, label
    assert got[3]["passing"][0] == "REF"  # the best quality by definition, in either direction


def test_the_pages_rule_answers_its_own_board_as_python_does(node, rule, page, runs, tmp_path):  # noqa: F811
    """The board's data as the page holds it, and Python's candidates of the same board."""
    data = json.loads(re.search(r'<script type="application/json" id="board-data">(.*?)</script>', page,
                                re.S).group(1))
    board = board_of(runs)
    view, rows = board.deployment, board.table_rows
    questions = [Question(memory_gib=2.5, n_ctx=CTX, min_tg=20.0, depth=DEPTH), Question(memory_gib=3.0, n_ctx=CTX),
                 Question(min_tg=25.0, depth=0), Question(min_tg=20.0, depth=DEPTH, by="same_top1_pct"),
                 Question(memory_gib=8.0, n_ctx=4096, min_tg=0.0, depth=0, by="ppl")]
    got = run_rule(node, rule, [{"data": data, "q": as_page(q)} for q in questions], tmp_path)
    for q, answer in zip(questions, got):
        assert answer == python_decision(view.candidates(rows, q.by), q), q
    assert got[0]["passing"] == ["Q4_0", "Q4_0+kv-q8_0"]
