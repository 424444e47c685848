"""One request as the client saw it (`Record`), and a run's figures from its records."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from bench import metrics as m


def even_counts(tokens: int, events: int) -> list[int]:
    """Tokens per event when only the total is known: the first event brings 1 (the prefill's),
    the rest share tokens - 1 as evenly as integers allow (in order). Sums to `tokens`."""
    if events == 0:
        return []
    if events == 1 or tokens <= 1:
        return [tokens] + [0] * (events - 1)
    rest, k = tokens - 1, events - 1
    return [1] + [(j + 1) * rest // k - j * rest // k for j in range(k)]


def token_itls(times: Sequence[float], counts: Sequence[int]) -> list[float]:
    """Inter-token latencies from event times and the tokens each event brought: the gap before
    an event is spread evenly over its tokens; tokens of the first event after the first one
    have gap 0; an event that brought no token hands its gap on to the next one. One value per
    token after the first (when the last event brought a token)."""
    if not times:
        return []
    out = [0.0] * max(0, counts[0] - 1)
    gap = 0.0
    for prev, t, k in zip(times, times[1:], counts[1:], strict=False):
        gap += t - prev
        if k > 0:
            out += [gap / k] * k
            gap = 0.0
    return out


@dataclasses.dataclass
class Record:
    """One request as its client saw it; times in seconds from the run's start."""

    index: int
    expected_output_len: int
    scheduled_s: float  # when it was due
    prompt_len: int | None = None  # from the final usage (or the token-id prompt)
    sent_s: float | None = None  # when it was sent (after waiting for a concurrency slot)
    event_s: list[float] = dataclasses.field(default_factory=list)  # each event bringing tokens
    event_tokens: list[int] | None = None  # tokens each event brought, where known exactly
    output_tokens: int = 0  # from the final usage
    end_s: float | None = None  # the stream's end ([DONE] read)
    error: str | None = None
    disconnect_after: int | None = None  # events read before the client leaves on purpose

    @property
    def disconnected(self) -> bool:
        return self.disconnect_after is not None and len(self.event_s) >= self.disconnect_after

    @property
    def ok(self) -> bool:
        # A client meant to leave whose stream ended first read the whole answer: completed.
        done = self.error is None and self.end_s is not None and bool(self.event_s)
        return done and not self.disconnected

    @property
    def counts(self) -> list[int]:
        """Tokens per event: exact where known, else even_counts."""
        if self.event_tokens is not None:
            return self.event_tokens
        return even_counts(self.output_tokens, len(self.event_s))

    def ttft(self) -> float | None:
        return self.event_s[0] - self.sent_s if self.ok else None

    def e2el(self) -> float | None:
        return self.end_s - self.sent_s if self.ok else None

    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2el() - self.ttft()) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return token_itls(self.event_s, self.counts) if self.ok else []

    def event_gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.event_s)] if self.ok else []

    def as_json(self) -> dict[str, Any]:
        def ms(v):
            return None if v is None else v * 1e3

        return dataclasses.asdict(self) | {
            "ttft_ms": ms(self.ttft()),
            "tpot_ms": ms(self.tpot()),
            "e2el_ms": ms(self.e2el()),
        }


def meets_slos(r: Record, slos: dict[str, float]) -> bool:
    """Whether a completed request met every SLO (ms); a one-token request's TPOT counts as 0."""
    value = {"ttft": r.ttft(), "tpot": r.tpot() or 0.0, "e2el": r.e2el()}
    return all(value[k] * 1e3 <= ms for k, ms in slos.items())


def summarize(
    records: Sequence[Record],
    duration: float,
    percentiles: Sequence[float],
    slos: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The run's figures, as `vllm bench serve` reports them; latencies in ms."""
    ok = [r for r in records if r.ok]

    def stats(values) -> dict:
        return m.scaled(m.percentiles(values, percentiles), 1e3)

    total_in = sum(r.prompt_len or 0 for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    events = sum(len(r.event_s) for r in ok)
    out: dict[str, Any] = {
        "completed": len(ok),
        "disconnected": sum(r.disconnected for r in records),
        "failed": sum(not r.ok and not r.disconnected for r in records),
        "output_len_mismatches": sum(r.output_tokens != r.expected_output_len for r in ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": stats(r.ttft() for r in ok),
        "tpot_ms": stats(r.tpot() for r in ok),
        "itl_ms": stats(x for r in ok for x in r.itls()),
        "e2el_ms": stats(r.e2el() for r in ok),
        "event_gap_ms": stats(g for r in ok for g in r.event_gaps()),
        "event_gap_max_ms": max((g * 1e3 for r in ok for g in r.event_gaps()), default=None),
        "tokens_per_event": total_out / events if events else None,
        "itl_token_counts": (
            "exact" if ok and all(r.event_tokens is not None for r in ok) else "even_spread"
        ),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in ok)
        out["goodput"] = {"slo_ms": slos, "good_requests": good, "request_goodput": good / duration}
    return out
