"""The deployment question on the board's HTML page, in a real browser (headless Chromium over the DevTools pipe,
tests/browser.py; CI installs chromium): a question read from the page's URL, inputs changed as a reader changes
them, and every answer the page shows held to the one `qeval choose` gives for the same question on the same board.
"""

from __future__ import annotations

import re

import pytest
from browser import Chromium, chromium_binary
from test_deployment_board import CTX, DEPTH, board_of, here_machine, runs  # noqa: F401 (fixtures)

from qeval import api
from qeval.present import leaderboard

BINARY = chromium_binary()
pytestmark = pytest.mark.skipif(BINARY is None, reason="no chromium binary on PATH; install it with "
                                                       "`apt-get install -y chromium` to run the page's script")


@pytest.fixture(scope="module")
def page_file(runs, tmp_path_factory):  # noqa: F811
    return leaderboard.write(board_of(runs), tmp_path_factory.mktemp("page"))


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with Chromium(BINARY, tmp_path_factory.mktemp("chromium")) as b:
        yield b


def python_answer(runs_dir, **asked) -> dict:  # noqa: F811
    """The sections of `qeval choose`'s text for the same question."""
    _, text = api.choose_report([runs_dir], **asked)
    lines = text.splitlines()
    ruled = lines.index(next(line for line in lines if line.startswith("Ruled out")))
    front = next(i for i, line in enumerate(lines) if line.startswith("Front ("))
    return {"asked": lines[0], "answer": lines[1], "passing": lines[2:ruled], "ruled_heading": lines[ruled],
            "ruled": [line.strip() for line in lines[ruled + 1:front]], "front": lines[front]}


def page_answer(page) -> dict:
    return {"asked": page.text("asked"), "answer": page.text("answer"), "passing": page.items("passing"),
            "ruled_heading": page.text("ruled-heading"), "ruled": page.items("ruled-out"), "front": page.text("front")}


def row_states(page) -> dict[str, tuple[str, str]]:
    """label -> (the row's verdict class, its answer cell)."""
    rows = page.eval("""Array.from(document.querySelectorAll('#leaderboard tbody tr')).map(tr => [
        tr.getAttribute('data-label'),
        [['best', 'passes', 'ruled'].filter(c => tr.classList.contains(c)).join(' '),
         tr.querySelector('td[data-col="answer"]').textContent]])""")
    return {label: tuple(state) for label, state in rows}


def test_the_page_answers_the_question_in_its_url_as_qeval_choose_does(runs, page_file, browser):  # noqa: F811
    url = page_file.paths["leaderboard.html"].resolve().as_uri()
    page = browser.open(f"{url}?mem=2.5&ctx={CTX}&tg=20&depth={DEPTH}")
    expected = python_answer(runs, memory=2.5, context=CTX, min_tg=20, depth=DEPTH)
    assert page_answer(page) == expected
    assert expected["answer"].startswith("Answer: Q4_0: ") and len(expected["ruled"]) == 7
    assert [page.eval(f"document.getElementById('{i}').value") for i in ("mem", "ctx", "tg", "depth", "by")] == \
        ["2.5", str(CTX), "20", str(DEPTH), "kld_mean"]
    states = row_states(page)
    assert states["Q4_0"] == ("best", "best") and states["Q4_0+kv-q8_0"] == ("passes", "passes")
    assert states["Q8_0"] == ("ruled", "too slow: 15.0 tokens/s < 20 tokens/s at depth 4,096")
    assert states["Q2_K"][0] == "ruled" and states["Q2_K"][1].startswith("measured on another machine")
    # the asked context's memory column and the asked depth's generation column are marked, every row
    n = len(states)
    assert page.eval(f"document.querySelectorAll('td.asked[data-col=\"memory_gib@{CTX}\"]').length") == n
    assert page.eval(f"document.querySelectorAll('td.asked[data-col=\"tg128@d{DEPTH}\"]').length") == n
    assert page.eval("document.querySelectorAll('td.asked').length") == 2 * n
    # the front column follows the front at the asked context and depth
    front = page.eval("""Array.from(document.querySelectorAll('td[data-col="deployment_front"]'))
                         .filter(td => td.textContent === '\\u2713')
                         .map(td => td.parentNode.getAttribute('data-label'))""")
    assert front == ["REF", "Q8_0", "Q4_0"]


@pytest.mark.parametrize("steps, asked", [
    # a reader types and picks; the page must then answer what `qeval choose` answers
    ((("type", "mem", "3.1"), ("type", "tg", "5")), dict(memory=3.1, context=CTX, min_tg=5, depth=DEPTH)),
    ((("choose", "depth", "0"),), dict(memory=2.5, context=CTX, min_tg=20, depth=0)),
    ((("choose", "ctx", "4096"), ("type", "mem", "1.2")), dict(memory=1.2, context=4096, min_tg=20, depth=DEPTH)),
    ((("type", "mem", ""), ("choose", "ctx", "")), dict(min_tg=20, depth=DEPTH)),
    ((("type", "tg", ""), ("choose", "depth", "")), dict(memory=2.5, context=CTX)),
    ((("choose", "by", "same_top1_pct"),), dict(memory=2.5, context=CTX, min_tg=20, depth=DEPTH, by="same_top1_pct")),
    ((("type", "tg", "1000"),), dict(memory=2.5, context=CTX, min_tg=1000, depth=DEPTH)),
    # a near miss (1,700 MiB = 1.66016 GiB against 1.66 GiB) is written with the decimals that show it
    ((("type", "mem", "1.66"),), dict(memory=1.66, context=CTX, min_tg=20, depth=DEPTH)),
])
def test_changing_an_input_updates_the_answer(runs, page_file, browser, steps, asked):  # noqa: F811
    url = page_file.paths["leaderboard.html"].resolve().as_uri()
    page = browser.open(f"{url}?mem=2.5&ctx={CTX}&tg=20&depth={DEPTH}")
    before = page_answer(page)
    for action, element, value in steps:
        getattr(page, action)(element, value)
    after = page_answer(page)
    assert after == python_answer(runs, **asked)
    assert after != before
    link = page.eval("document.getElementById('link').getAttribute('href')")
    expected = {"mem": asked.get("memory"), "ctx": asked.get("context"), "tg": asked.get("min_tg"),
                "depth": asked.get("depth"), "by": asked.get("by")}
    assert dict(re.findall(r"([a-z]+)=([^&]+)", link)) == {k: str(v) for k, v in expected.items() if v is not None}


def test_bad_url_parameters_are_said(page_file, browser):
    url = page_file.paths["leaderboard.html"].resolve().as_uri()
    page = browser.open(f"{url}?mem=abc&ctx=16384&tg=-3&depth=7&by=vibes")
    problem = page.text("problem")
    for fragment in ("mem=abc is not a positive size in GiB", "tg=-3 is not a speed of 0 tokens/s or more",
                     "ctx=16384 was not measured", "measured contexts are 4096, 32768",
                     "depth=7 was not measured", "measured depths are 0, 4096", "by=vibes is not a quality"):
        assert fragment in problem, fragment
    assert page.text("answer") == ""


def test_without_a_question_the_page_says_what_to_set(page_file, browser):
    page = browser.open(page_file.paths["leaderboard.html"].resolve().as_uri())
    assert page.text("asked").startswith("Set a memory limit and a context")
    assert page.text("answer") == "" and page.text("problem") == ""
    assert set(s for s, _ in row_states(page).values()) == {""}


def test_the_page_with_its_script_is_self_contained(page_file):
    page = page_file.paths["leaderboard.html"].read_text()
    assert page.count("<script") == 3 and not re.search(r"<script[^>]*\bsrc\s*=", page)
    assert "<link" not in page.lower() and "@import" not in page and "fetch(" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "external resource"
    assert "XMLHttpRequest" not in page and "import(" not in page
