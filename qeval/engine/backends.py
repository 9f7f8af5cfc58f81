"""Backends by name: what computes the logits a capture or a live candidate codes.

A model spec picks its backend with EngineSettings.backend; llama.cpp (qeval.engine.engine.Engine) is the
default. Another backend is one module implementing qeval.engine.engine.Backend and one register_backend
call; its name is recorded in the stores it writes (EngineSettings.as_json), so its logits are never taken
for another backend's.
"""

from __future__ import annotations

from typing import Callable

from qeval.engine.engine import LLAMA_CPP, Backend, Engine, EngineSettings
from qeval.errors import QevalError
from qeval.storage.scoring import HALF, Scoring

# (model, n_ctx, settings, scoring) -> a loaded Backend, which the caller closes
BackendFactory = Callable[[str, int, EngineSettings, Scoring], Backend]

_FACTORIES: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make `name` a backend a model spec can pick (EngineSettings.backend); a later registration replaces it."""
    _FACTORIES[name] = factory


def open_backend(model: str, n_ctx: int, settings: EngineSettings, scoring: Scoring = HALF) -> Backend:
    """`model` loaded by the backend `settings` names, for windows of n_ctx tokens scored as `scoring` says."""
    factory = _FACTORIES.get(settings.backend)
    if factory is None:
        raise QevalError(f"unknown backend {settings.backend!r}; registered backends: {', '.join(_FACTORIES)}")
    return factory(model, n_ctx, settings, scoring)


register_backend(LLAMA_CPP, Engine)
