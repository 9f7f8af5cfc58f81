"""The wheel `pip install .` builds: built here offline (pip wheel --no-build-isolation, with the setuptools the
`test` extra installs), without a warning from the build backend, holding every module under qeval/ and every
shipped corpus, conversation, template and baseline file. Expected contents come from walking the source tree, not
from the packaging configuration under test."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from conftest import REPO

# source folder -> where its files land in the wheel
SHIPPED = {"qeval": "qeval", "corpora": "qeval/corpora", "baselines": "qeval/baselines"}
MIN_SETUPTOOLS = 77  # pyproject's [build-system] requires


def source_files(folder: Path, prefix: str) -> set[str]:
    """Every file under `folder` as the wheel names it: Python modules and data alike, caches left out."""
    found = set()
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if not name.endswith((".pyc", ".pyo")):
                found.add(f"{prefix}/{(Path(root) / name).relative_to(folder).as_posix()}")
    return found


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(wheel path, the build's output): the project copied to a fresh folder (no build/ or egg-info of earlier
    builds) and built with warnings always shown."""
    major = int(metadata.version("setuptools").split(".")[0])
    if major < MIN_SETUPTOOLS:
        pytest.fail(f"setuptools {metadata.version('setuptools')} here; building the wheel offline needs "
                    f"setuptools>={MIN_SETUPTOOLS} (pip install -e '.[test]')")
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in SHIPPED:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {**os.environ, "PYTHONWARNINGS": "always"}
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                          "--no-index", "-v", "-w", str(out)], capture_output=True, text=True, env=env, timeout=600)
    output = res.stdout + res.stderr
    assert res.returncode == 0, output[-4000:]
    wheel, = out.glob("qeval-*.whl")
    return wheel, output


def test_the_wheel_holds_every_module_and_shipped_file(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as zf:
        names = {n for n in zf.namelist() if ".dist-info/" not in n}
    expected = set().union(*(source_files(REPO / folder, prefix) for folder, prefix in SHIPPED.items()))
    assert names == expected, (f"missing from the wheel: {sorted(expected - names)}; "
                               f"not in the sources: {sorted(names - expected)}")
    for required in ("qeval/corpora/conversations/tool_calls.jsonl", "qeval/corpora/conversations/gemma3-chat-template.jinja",
                     "qeval/corpora/austen-northanger-abbey.txt", "qeval/baselines/SCHEMA.md", "qeval/cli.py"):
        assert required in names


def test_the_build_warns_about_nothing(built):
    """Python warnings from setuptools (a package absent from `packages`, a deprecated license table, ...) name
    their category (SetuptoolsDeprecationWarning, BuildBackendWarning); distutils' own notes about byte-compiling
    being off are not about the package."""
    _, output = built
    warnings = [line.strip() for line in output.splitlines() if re.search(r"\w+Warning\b", line)
                or ("warning" in line.lower() and "byte-compiling" not in line and "Location" not in line)]
    assert not warnings, "\n".join(warnings)
