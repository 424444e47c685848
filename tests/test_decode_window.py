"""`DecodeWindows`: the steps of each decode window, by the rules of "auto" and the time bound,
against the rules written out here, over random states."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from rosejax.engine.decode_window import AUTO_FULL_STEPS, DecodeWindows
from rosejax.settings import EngineConfig


def config(**kw) -> SimpleNamespace:
    fields = {"decode_steps": "auto", "open_decode_steps": 8, "max_decode_window_ms": 40.0}
    return SimpleNamespace(**(fields | kw))


def expected(cfg, remaining, waiting, max_batch, step_seconds) -> int:
    """The rules, one by one: the admission rule first, then the time bound."""
    if cfg.decode_steps != "auto":
        return cfg.decode_steps
    full, open_ = AUTO_FULL_STEPS, cfg.open_decode_steps
    if len(remaining) < max_batch:
        k = min(full, open_)  # slots free: a new request starts within about `open` steps
    elif waiting:
        k = min(full, max(min(remaining), open_))  # the first finish refills a slot
    else:
        k = full
    if cfg.max_decode_window_ms and step_seconds:
        k = max(1, min(k, math.floor(cfg.max_decode_window_ms / 1e3 / step_seconds)))
    return k


@pytest.mark.parametrize("decode_steps", ["auto", 5])
def test_window_steps_follow_the_rules(decode_steps):
    rng = random.Random()
    for _ in range(500):
        cfg = config(
            decode_steps=decode_steps,
            open_decode_steps=rng.randint(1, 40),
            max_decode_window_ms=rng.choice([0.0, rng.uniform(0.01, 200)]),
        )
        windows = DecodeWindows(cfg)
        max_batch = rng.randint(1, 16)
        remaining = [rng.randint(1, 100) for _ in range(rng.randint(1, max_batch))]
        waiting = rng.random() < 0.5
        step_seconds = 0.0
        if rng.random() < 0.8:  # a window read back before: its time a step
            steps = rng.randint(1, 32)
            seconds = rng.uniform(1e-5, 0.2) * steps
            windows.read_back(seconds, steps)
            step_seconds = seconds / steps
        got = windows.steps(len(remaining), remaining, waiting, max_batch)
        assert got == expected(cfg, remaining, waiting, max_batch, step_seconds), (cfg, got)
        assert 1 <= got <= windows.full


def test_bound_cuts_long_windows_only():
    """At 40 ms: 1 ms a step leaves the full window, 2.5 ms cuts it to 16, 100 ms to one."""
    windows = DecodeWindows(config())
    for seconds_a_step, steps in ((0.001, 32), (0.0025, 16), (0.1, 1)):
        windows.read_back(seconds_a_step * 8, 8)
        assert windows.steps(4, [50] * 4, False, 4) == steps


@pytest.mark.parametrize("value", [-1.0, 60001.0])
def test_bad_bound_is_refused(value):
    with pytest.raises(ValueError, match="max_decode_window_ms"):
        EngineConfig(model="random:tiny", max_decode_window_ms=value)
