"""How many steps the next decode window runs (`EngineConfig.decode_steps`, "auto")."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

AUTO_FULL_STEPS = 32  # "auto" decode window while the batch is full: throughput


class DecodeWindows:
    """The steps of each decode window. Fixed when the user chose them; under "auto", the full
    `AUTO_FULL_STEPS` while the batch is full and nobody waits (throughput), until the first
    running request may finish while requests wait for a slot (its slot is refilled then), and
    `open_decode_steps` while slots are free (a request arriving now starts within about that
    many). No window is shorter than that by these rules: under steady arrivals the first finish
    was often a step or two away, and windows that short cost every row the window's fixed
    overhead, for one slot idle a few steps.

    Under "auto" with `max_decode_window_ms`, a window is also cut to the steps that fit that
    time at the last window's time a step (from its dispatch, or the previous read-back if later,
    to its own read-back: the gap a stream sees between its chunks), at least one: a window's
    steps reach the host together, so at long contexts or on slow hardware 32 steps leave a
    stream silent for 100 ms or more."""

    def __init__(self, config: Any):
        self.auto = config.decode_steps == "auto"
        self.full = AUTO_FULL_STEPS if self.auto else config.decode_steps
        self.open = config.open_decode_steps
        self.max_seconds = config.max_decode_window_ms / 1e3  # 0: no bound
        self.step_seconds = 0.0  # the last window's time a step (0: none read back yet)

    def steps(self, rows: int, remaining: Iterable[int], waiting: bool, max_batch_size: int) -> int:
        """Steps for the next window of `rows` rows with `remaining` tokens each left to
        dispatch (budget less what is in flight: read only while the batch is full and
        requests wait for a slot)."""
        if not self.auto:
            return self.full
        if waiting and rows >= max_batch_size:
            k = int(min(self.full, max(min(remaining), self.open)))
        elif rows < max_batch_size:
            k = min(self.full, self.open)
        else:
            k = self.full
        if self.max_seconds and self.step_seconds:
            k = max(1, min(k, math.floor(self.max_seconds / self.step_seconds)))
        return k

    def read_back(self, seconds: float, steps: int) -> None:
        """A window of `steps` steps was read back `seconds` after it could start."""
        self.step_seconds = seconds / steps
