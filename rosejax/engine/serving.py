"""What an engine loop does besides stepping, wherever it runs (a server's engine thread,
`rosejax.serve.engine_loop`; an engine process, `rosejax.engine.engine_process`): taking its
commands, the snapshot of gauges it publishes, and a server's warm-up: the first programs
before it serves, the rest compiled while idle. An offline engine warms up as
`EngineConfig.warmup` says instead (`LLMEngine`)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from rosejax.settings import EngineConfig, freeze_heap
from rosejax.tokenizer import warm_tokenizer

log = logging.getLogger("rosejax")


def gather_seconds(config: EngineConfig) -> tuple[float, float]:
    """An idle loop's `take_commands` gather, (gap, span) in seconds."""
    return config.idle_gather_ms / 1e3, config.idle_gather_max_ms / 1e3


def take_commands(
    inbox: queue.SimpleQueue,
    handle: Callable[[Any], None],
    wait: float,
    gather: tuple[float, float] | None = None,
) -> None:
    """`handle` every item in `inbox`, waiting up to `wait` seconds for the first. An idle loop
    (`gather` = (gap, span)) then goes on taking items while each comes within `gap` seconds of
    the last, for at most `span` seconds in all, before its step: the requests of a burst,
    which reach it one by one, go into one prefill, instead of the first few into a prefill of
    their own while the rest wait behind its dispatch."""
    gap, span = gather or (0.0, 0.0)
    try:
        item = inbox.get(timeout=wait) if wait else inbox.get_nowait()
        deadline = time.monotonic() + (span if gap else 0.0)
        while True:
            handle(item)
            try:
                item = inbox.get_nowait()
            except queue.Empty:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                item = inbox.get(timeout=min(gap, left))
    except queue.Empty:
        pass


def idle_wait(engine: Any, poll_s: float) -> float:
    """How long an idle engine loop waits for a command before it steps: `poll_s`, or none
    while programs compiled ahead wait for their first run (`run_ahead`, one a loop trip), so
    they run back to back."""
    return 0.0 if engine.programs_to_run else poll_s


_SNAPSHOT_KEYS = (
    "running",
    "waiting",
    "kv_blocks_used",
    "kv_blocks_total",
    "prefix_hits",
    "prefix_hit_tokens",
    "prefill_steps",
    "prefill_tokens",
    "preemptions",
    "programs_to_compile",
    "num_compiles",
    "compile_seconds",
    "host_seconds",
)


def engine_snapshot(engine: Any, programs_left: int) -> dict[str, Any]:
    """An `LLMEngine`'s scheduler and KV cache gauges (a server's /metrics), its compiles and
    where its host time went: a fresh dict each time, so a reader on another thread (a scrape)
    reads one consistent view. Programs to compile: the `programs_left` to compile and those
    compiled but not run once yet (a first run costs a request that meets it up to tenths of a
    second, which `run_ahead` pays while idle)."""
    alloc, sched = engine.allocator, engine.scheduler
    values = (
        len(sched.running),
        len(sched.waiting),
        alloc.num_used_blocks,
        engine.num_kv_blocks,
        alloc.prefix_hits,
        alloc.prefix_hit_tokens,
        engine.prefill_steps,
        engine.prefill_tokens_computed,
        sched.num_preemptions,
        programs_left + engine.programs_to_run,
        engine.num_compiles,
        engine.compile_seconds,
        dict(engine.host_seconds),
    )
    return dict(zip(_SNAPSHOT_KEYS, values, strict=True))


# `warmup_programs()`' first ones: the smallest prefill, the smallest decode greedy and sampled.
FIRST_PROGRAMS = 3


def warm_for_serving(engine: Any, warmup: bool | None) -> bool:
    """Compile what a server's engine needs before it serves, as `warmup` (the engine flags')
    says: None on a GPU, what a first request needs (the rest compile while idle,
    `compile_while_idle`: every program up front took minutes with an empty compilation
    cache); True, every program. Returns whether programs are left for `compile_while_idle`.
    Also the table every request's detokenizer reads (`warm_tokenizer`): an engine process has
    its own tokenizer, which the API servers' warming does not reach (a first request waited
    0.1 s for GPT-2's, half a second for Qwen3's). Not the chat template: the API servers
    render chats, and rendering one here would import transformers into the engine's start."""
    warm_tokenizer(engine.tokenizer, chat=False)
    background = warmup is None and not engine.on_cpu
    if background:
        engine.compile_ahead(*engine.warmup_programs()[:FIRST_PROGRAMS])
    elif warmup:
        engine.warmup()
    return background


def compile_while_idle(
    engine: Any, idle: threading.Event, stop: threading.Event, poll_s: float, compiled: Callable
) -> None:
    """Compile the programs warm-up has not, each one only once no request is in flight
    (`idle` set; compiling holds the GIL for much of its time, which a step would wait for);
    `compiled()` after each one. Then `freeze_heap` again: compiling leaves objects the garbage
    collector walked at every full collection (0.2 s of a 256-request burst's admission)."""
    for program in engine.cold_programs():
        while not idle.wait(poll_s):
            if stop.is_set():
                return
        if stop.is_set():
            return
        try:
            engine.compile_ahead(program)
        except Exception:  # serving goes on: the program compiles on first use instead
            log.exception("compiling %s ahead failed", program)
        compiled()
    freeze_heap()
