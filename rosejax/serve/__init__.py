"""rosejax's OpenAI-compatible HTTP server (FastAPI + uvicorn): `python -m rosejax.serve`.

Needs the `serve` extra: `pip install -e ".[serve]"` (fastapi, uvicorn, prometheus-client).
The names below are imported on first use, not with the package: an engine process (which
imports `rosejax.serve.engine_process`) needs no HTTP stack, and `python -m rosejax.serve`
spawns its engine processes before it imports its own.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    "create_app": "rosejax.serve.app",
    "AsyncEngine": "rosejax.serve.engine_loop",
    "EngineError": "rosejax.serve.engine_loop",
    "Overloaded": "rosejax.serve.engine_loop",
    "RequestStream": "rosejax.serve.engine_loop",
    "ServerMetrics": "rosejax.serve.metrics",
}
__all__ = sorted(_MODULES)


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(_MODULES[name])
    except ModuleNotFoundError as e:  # say how to get them rather than only which one is missing
        raise ModuleNotFoundError(
            f"{e}: the server needs the serve extra, pip install -e '.[serve]'", name=e.name
        ) from e
    return getattr(module, name)
