"""Print the kit's wheels whose requirement this Python does not meet (run.sh installs only those).

    python tools/gpu/missing_wheels.py .gpukit/kit/wheels

Standard library and pip's own packaging only: it runs before anything is installed, on a machine with no network.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

from pip._vendor.packaging.requirements import Requirement


def is_met(requirement: str) -> bool:
    req = Requirement(requirement)
    try:
        return req.specifier.contains(metadata.version(req.name), prereleases=True)
    except metadata.PackageNotFoundError:
        return False


def missing(folder: Path) -> list[Path]:
    wanted = json.loads((folder / "requirements.json").read_text())
    return [folder / wheel for wheel, requirement in wanted.items() if not is_met(requirement)]


if __name__ == "__main__":
    print("\n".join(str(p) for p in missing(Path(sys.argv[1]))))
