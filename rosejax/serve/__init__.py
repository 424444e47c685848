"""rosejax's OpenAI-compatible HTTP server (FastAPI + uvicorn): `python -m rosejax.serve`.

Needs the `serve` extra: `pip install -e ".[serve]"` (fastapi, uvicorn, prometheus-client).
"""

try:
    from rosejax.serve.app import create_app
    from rosejax.serve.engine_loop import AsyncEngine, EngineError, Overloaded, RequestStream
    from rosejax.serve.metrics import ServerMetrics
except ModuleNotFoundError as e:  # say how to get them rather than only which one is missing
    raise ModuleNotFoundError(
        f"{e}: the server needs the serve extra, pip install -e '.[serve]'", name=e.name
    ) from e

__all__ = [
    "AsyncEngine",
    "EngineError",
    "Overloaded",
    "RequestStream",
    "ServerMetrics",
    "create_app",
]
