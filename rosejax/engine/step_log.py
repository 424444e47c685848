"""`EngineConfig.step_log`: one JSON line per engine step, to follow a server's engine step by
step (`bench/step_timeline.py` prints them). Each line: `pid`, `replica`, `start` (the step's
`time.monotonic()`, one clock for every process of a host) and `ms`; `waiting` and `running`
requests before and after it; `prefill_tokens` it prefilled; `window` [steps, rows, width] of the
decode window it dispatched, or null; host ms `dispatch` (admission and both programs' calls),
`wait` (for the device) and `harvest` (reading results into requests); `outputs` and `tokens`
handed out."""

from __future__ import annotations

import json
import os
import time
from typing import Any


class StepLog:
    """Appends an engine's step lines to a file (line-buffered: several processes may share it)."""

    def __init__(self, path: str, replica: int):
        try:
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the engine's life
        except OSError as e:
            raise ValueError(f"--step-log {path}: cannot append to it ({e.strerror})") from e
        self.head = {"pid": os.getpid(), "replica": replica}

    @staticmethod
    def begin(engine: Any) -> tuple:
        """What a step's line compares with at its end."""
        sched = engine.scheduler
        return (
            time.monotonic(),
            len(sched.waiting),
            len(sched.running),
            dict(engine.host_seconds),
            engine.prefill_tokens_computed,
        )

    def end(
        self, engine: Any, begun: tuple, window: tuple[int, int, int] | None, outputs: list
    ) -> None:
        """Write the line of a step that began with `begun` and dispatched `window` (steps,
        rows, width; None: no window)."""
        start, waiting, running, seconds, prefilled = begun
        sched, host = engine.scheduler, engine.host_seconds
        line = self.head | {
            "start": start,
            "ms": round((time.monotonic() - start) * 1e3, 3),
            "waiting": [waiting, len(sched.waiting)],
            "running": [running, len(sched.running)],
            "prefill_tokens": engine.prefill_tokens_computed - prefilled,
            "window": None if window is None else list(window),
            **{f"{k}_ms": round((host[k] - seconds[k]) * 1e3, 3) for k in seconds},
            "outputs": len(outputs),
            "tokens": sum(len(o.new_token_ids) for o in outputs),
        }
        self.file.write(json.dumps(line) + "\n")
