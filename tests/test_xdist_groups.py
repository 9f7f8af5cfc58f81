"""The README's test command (pytest -n auto --dist loadgroup) keeps each group of tests/conftest.py XDIST_GROUPS in
one process. pytest-xdist marks a grouped test by its node id (`...@group`); under pytest 9.2 that mark is lost
(pytest-xdist issue 1386) and the groups are spread silently, so this test checks the node ids the run holds."""

import pytest
from conftest import XDIST_GROUPS


def test_every_grouped_test_reaches_pytest_xdist_with_its_group(request):
    if not request.config.getvalue("loadgroup"):
        pytest.skip("runs under pytest -n --dist loadgroup (the README's test command)")
    grouped = [i for i in request.session.items if i.module.__name__ in XDIST_GROUPS]
    if not grouped:
        pytest.skip("no module of XDIST_GROUPS is collected")
    lost = [i.nodeid for i in grouped if not i.nodeid.endswith("@" + XDIST_GROUPS[i.module.__name__])]
    assert not lost, (f"pytest-xdist did not group {len(lost)} tests (e.g. {lost[0]}) under pytest "
                      f"{pytest.__version__}: install the test extra's pytest (pyproject.toml)")
