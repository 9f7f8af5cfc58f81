"""The recipes' ledger, RUNS_DIR/recipes/variants.json: which variants were built, so that none is built or measured
twice (qeval.orchestrate.recipes).

One JSON object: a variant's key (a digest of qeval.engine.recipe.variant_identity) -> {"recipe": the text of the
recipe that first built it, "label": the label its result is saved under, "facts": the facts of the GGUF it built
(qeval.engine.modelinfo.model_facts)}. Rewritten whole on each change (beside it, then moved over it).
"""

from __future__ import annotations

import json
from pathlib import Path

from qeval.errors import QevalError

LEDGER = "variants.json"


class Ledger:
    """Variant key -> the facts of the GGUF it built and the label its result is saved under, in RECIPES_DIR/LEDGER."""

    def __init__(self, directory: Path):
        self.path = directory / LEDGER
        try:
            self.entries = json.loads(self.path.read_text())
        except FileNotFoundError:
            self.entries = {}
        except (OSError, ValueError) as exc:
            raise QevalError(f"cannot read the recipes' ledger {self.path} ({exc}): remove it to measure every "
                             "recipe again") from None

    def get(self, key: str) -> dict | None:
        entry = self.entries.get(key)
        return entry["facts"] if entry else None

    def label(self, key: str) -> str | None:
        entry = self.entries.get(key)
        return entry.get("label") if entry else None

    def put(self, key: str, recipe: str, label: str, facts: dict) -> None:
        self.entries[key] = {"recipe": recipe, "label": label, "facts": facts}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.part")
        tmp.write_text(json.dumps(self.entries, indent=1))
        tmp.replace(self.path)
