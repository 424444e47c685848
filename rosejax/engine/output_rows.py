"""What an engine process sends the process driving it (a server's API process, an offline
engine) for each `RequestOutput` of a step (a row), and the `RequestOutput` the driver rebuilds
from it, equal to the one the engine made.

A row carries only what the driver has not seen, in plain lists and arrays (cheap to pickle):
(request id, sequences, prompt logprobs, error, times), `sequences` holding one entry per
sequence that changed this step: (index, new token ids, new text, finish reason, new logprobs,
cumulative logprob); `times` the request's `RequestMetrics` as a tuple in its first row, else
None. Logprobs travel as the engine keeps them, `FlatLogprobs`' arrays (`arrays_from`), and
are kept so on the driver's side, whose `FlatLogprobs` read each token's text
(`Logprob.decoded_token`) from a `TokenTexts` of the same tokenizer, as the engine's do.
"""

from __future__ import annotations

from typing import Any

from rosejax.engine.request import (
    CompletionOutput,
    FlatLogprobs,
    LatestOutputs,
    RequestMetrics,
    RequestOutput,
)
from rosejax.sampling import SamplingParams


class _Seen:
    """What the driver has of one request: prompt logprobs, and the sequences whose
    finish reason it has."""

    __slots__ = ("prompt_logprobs", "ended")

    def __init__(self) -> None:
        self.prompt_logprobs = 0
        self.ended: set[int] = set()


class RowWriter:
    """The engine process's side: the row of each `RequestOutput` (see the module)."""

    def __init__(self) -> None:
        self._seen: dict[str, _Seen] = {}  # requests with a row sent and not finished

    def row(self, out: RequestOutput) -> tuple:
        rid = out.request_id
        seen = self._seen.get(rid)
        times, m = None, out.metrics
        if seen is None and m is not None:  # its first row carries its times (not astuple's
            # deep copy: several times the cost)
            times = (m.arrival_time, m.first_scheduled_time, m.first_token_time)
        if out.finish_reason == "error":
            return self.error_row(rid, out.error, times)
        if seen is None:
            seen = self._seen[rid] = _Seen()
        prompt = None
        have = out.prompt_logprobs
        if have is not None and len(have) > seen.prompt_logprobs:
            prompt = have.arrays_from(seen.prompt_logprobs)
            seen.prompt_logprobs = len(have)
        sequences = []
        for c in out.outputs:
            ended = c.finish_reason is not None
            if not (c.new_token_ids or c.new_text or (ended and c.index not in seen.ended)):
                continue
            logprobs = None
            if c.logprobs is not None:  # the new tokens' are the last ones
                logprobs = c.logprobs.arrays_from(len(c.logprobs) - len(c.new_token_ids))
            sequences.append(
                (
                    c.index,
                    c.new_token_ids,
                    c.new_text,
                    c.finish_reason,
                    logprobs,
                    c.cumulative_logprob,
                )
            )
            if ended:
                seen.ended.add(c.index)
        if out.finished:
            del self._seen[rid]
        return (rid, sequences, prompt, None, times)

    def error_row(
        self, rid: str, error: str | None, times: tuple[float, ...] | None = None
    ) -> tuple:
        """The row of a request that failed: it ends with `error` (`times`: as in a first row)."""
        self._seen.pop(rid, None)
        return (rid, [], None, error, times)

    def forget(self, rid: str) -> None:
        """A request aborted: no row of it follows."""
        self._seen.pop(rid, None)


class _Sequence:
    """One sequence's output so far."""

    __slots__ = ("tokens", "text", "logprobs", "cumulative_logprob", "finish_reason")

    def __init__(self, logprobs: FlatLogprobs | None):
        self.tokens: list[int] = []
        self.text = ""
        self.logprobs = logprobs
        self.cumulative_logprob: float | None = None if logprobs is None else 0.0
        self.finish_reason: str | None = None

    def output(self, index: int, new_ids: list[int], new_text: str) -> CompletionOutput:
        """Its output so far (it is sequence `index`), and what the latest row added."""
        # A finished sequence's lists never change again; a running one's are copied (its
        # logprobs snapshot: no copy).
        ended = self.finish_reason is not None
        return CompletionOutput(
            index,
            self.text,
            self.tokens if ended else list(self.tokens),
            self.cumulative_logprob,
            self.logprobs if ended or self.logprobs is None else self.logprobs.snapshot(),
            self.finish_reason,
            new_ids,
            new_text,
        )


class _Request:
    __slots__ = (
        "prompt",
        "sequences",
        "prompt_logprobs",
        "metrics",
        "latest",
    )

    def __init__(self, prompt: list[int], params: SamplingParams, texts: Any):
        def flat(top: int | None, **kw: Any) -> FlatLogprobs | None:
            return None if top is None else FlatLogprobs(top, texts, **kw)

        self.prompt = prompt
        self.sequences = [_Sequence(flat(params.logprobs)) for _ in range(params.n)]
        self.prompt_logprobs = flat(params.prompt_logprobs, leading_none=True)
        self.metrics: RequestMetrics | None = None
        self.latest = LatestOutputs([s.output(i, [], "") for i, s in enumerate(self.sequences)])


class RowReader:
    """The driver's side: whole `RequestOutput`s from rows (see the module). `texts`:
    token id -> its text, a `TokenTexts` of the engine's tokenizer."""

    def __init__(self, texts: Any):
        self.texts = texts
        self._requests: dict[str, _Request] = {}

    def expect(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        """A request sent to the engine: its rows will follow."""
        self._requests[rid] = _Request(prompt, params, self.texts)

    def forget(self, rid: str) -> None:
        """A request ended or aborted: its rows, if any still come, are dropped."""
        self._requests.pop(rid, None)

    def output(self, row: tuple) -> RequestOutput | None:
        """The row's `RequestOutput` as the engine made it; None for a request forgotten."""
        rid, changed, prompt, error, times = row
        if error is not None:
            return self.error_output(rid, error, times)
        req = self._requests.get(rid)
        if req is None:
            return None
        if times is not None:
            req.metrics = RequestMetrics(*times)
        if prompt is not None:
            req.prompt_logprobs.extend_arrays(prompt)
        new: dict[int, tuple[list[int], str]] = {}
        for index, ids, text, reason, logprobs, cumulative in changed:
            s = req.sequences[index]
            s.tokens.extend(ids)
            s.text += text
            if logprobs is not None:
                s.logprobs.extend_arrays(logprobs)
            s.cumulative_logprob, s.finish_reason = cumulative, reason
            new[index] = (ids, text)
        outputs = req.latest.update(
            new, lambda i: req.sequences[i].output(i, *new.get(i, ([], "")))
        )
        return RequestOutput.from_outputs(
            rid, req.prompt, outputs, req.prompt_logprobs, req.latest.unfinished == 0, req.metrics
        )

    def error_output(
        self, rid: str, error: str, times: tuple[float, ...] | None = None
    ) -> RequestOutput | None:
        """The last output of a request that failed with `error` (the engine failed, or its
        process died; `times` as its row has them); None for a request forgotten. It is
        forgotten then."""
        req = self._requests.pop(rid, None)
        if req is None:
            return None
        if times is not None:
            req.metrics = RequestMetrics(*times)
        first = req.sequences[0]
        return RequestOutput(
            rid,
            req.prompt,
            first.tokens,
            first.text,
            [],
            "",
            True,
            "error",
            error,
            metrics=req.metrics,
        )
