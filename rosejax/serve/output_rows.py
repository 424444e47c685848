"""What an engine process sends the API process for each `RequestOutput` of a step (a row), and
the `RequestOutput` the API process rebuilds from it, equal to the one the engine made.

A row carries only what the API process has not seen, in plain lists (cheap to pickle):
(request id, sequences, prompt logprobs, error), `sequences` holding one entry per sequence
that changed this step: (index, new token ids, new text, finish reason, new logprobs,
cumulative logprob). Logprob dicts travel packed (`pack_logprobs`): their token ids, logprobs
and ranks as flat lists; each token's text (`Logprob.decoded_token`) is looked up again on
the API process's side, in a `TokenTexts` of the same tokenizer, as the engine did.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import Any

from rosejax.engine.request import CompletionOutput, Logprob, RequestOutput
from rosejax.sampling import SamplingParams

# Logprob dicts, one per token (None: a prompt's first token), as
# (entries per token, 0 for None; their token ids; logprobs; ranks).
PackedLogprobs = tuple[list[int], list[int], list[float], list[int]]


def pack_logprobs(steps: Sequence[dict[int, Logprob] | None]) -> PackedLogprobs:
    """Flat lists of the dicts' entries, in their order (see `PackedLogprobs`)."""
    given = [step for step in steps if step is not None]
    return (
        [0 if step is None else len(step) for step in steps],
        [i for step in given for i in step],
        [lp.logprob for step in given for lp in step.values()],
        [lp.rank for step in given for lp in step.values()],
    )


def unpack_logprobs(packed: PackedLogprobs, texts: Any) -> list[dict[int, Logprob] | None]:
    """The dicts `pack_logprobs` packed; `texts`: token id -> its text (a `TokenTexts`)."""
    widths, ids, values, ranks = packed
    entries = zip(ids, values, ranks, strict=True)
    steps: list[dict[int, Logprob] | None] = []
    for width in widths:
        step = {i: Logprob(v, r, texts[i]) for i, v, r in islice(entries, width)}
        steps.append(step if width else None)
    return steps


class _Seen:
    """What the API process has of one request: prompt logprobs, and the sequences whose
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
        if out.finish_reason == "error":
            return self.error_row(rid, out.error)
        seen = self._seen.get(rid)
        if seen is None:
            seen = self._seen[rid] = _Seen()
        prompt = None
        have = out.prompt_logprobs
        if have is not None and len(have) > seen.prompt_logprobs:
            prompt = pack_logprobs(have[seen.prompt_logprobs :])
            seen.prompt_logprobs = len(have)
        sequences = []
        for c in out.outputs:
            ended = c.finish_reason is not None
            if not (c.new_token_ids or c.new_text or (ended and c.index not in seen.ended)):
                continue
            logprobs = None
            if c.logprobs is not None:  # the new tokens' are the last ones
                logprobs = pack_logprobs(c.logprobs[len(c.logprobs) - len(c.new_token_ids) :])
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
        return (rid, sequences, prompt, None)

    def error_row(self, rid: str, error: str | None) -> tuple:
        """The row of a request that failed: it ends with `error`."""
        self._seen.pop(rid, None)
        return (rid, [], None, error)

    def forget(self, rid: str) -> None:
        """A request aborted: no row of it follows."""
        self._seen.pop(rid, None)


class _Sequence:
    """One sequence's output so far."""

    __slots__ = ("tokens", "text", "logprobs", "cumulative_logprob", "finish_reason")

    def __init__(self, logprobs: bool):
        self.tokens: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if logprobs else None
        self.cumulative_logprob: float | None = 0.0 if logprobs else None
        self.finish_reason: str | None = None


class _Request:
    __slots__ = ("prompt", "sequences", "prompt_logprobs")

    def __init__(self, prompt: list[int], params: SamplingParams):
        self.prompt = prompt
        self.sequences = [_Sequence(params.logprobs is not None) for _ in range(params.n)]
        self.prompt_logprobs: list | None = [] if params.prompt_logprobs is not None else None


class RowReader:
    """The API process's side: whole `RequestOutput`s from rows (see the module). `texts`:
    token id -> its text, a `TokenTexts` of the engine's tokenizer."""

    def __init__(self, texts: Any):
        self.texts = texts
        self._requests: dict[str, _Request] = {}

    def expect(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        """A request sent to the engine: its rows will follow."""
        self._requests[rid] = _Request(prompt, params)

    def forget(self, rid: str) -> None:
        """A request ended or aborted: its rows, if any still come, are dropped."""
        self._requests.pop(rid, None)

    def output(self, row: tuple) -> RequestOutput | None:
        """The row's `RequestOutput` as the engine made it; None for a request forgotten."""
        rid, changed, prompt, error = row
        req = self._requests.get(rid)
        if req is None:
            return None
        first = req.sequences[0]
        if error is not None:
            return RequestOutput(
                rid, req.prompt, first.tokens, first.text, [], "", True, "error", error
            )
        if prompt is not None:
            req.prompt_logprobs.extend(unpack_logprobs(prompt, self.texts))
        new = {}
        for index, ids, text, reason, logprobs, cumulative in changed:
            s = req.sequences[index]
            s.tokens.extend(ids)
            s.text += text
            if logprobs is not None:
                s.logprobs.extend(unpack_logprobs(logprobs, self.texts))
            s.cumulative_logprob, s.finish_reason = cumulative, reason
            new[index] = (ids, text)
        outputs = []
        for index, s in enumerate(req.sequences):
            ids, text = new.get(index, ([], ""))
            # A finished sequence's lists never change again; a running one's are copied.
            ended = s.finish_reason is not None
            outputs.append(
                CompletionOutput(
                    index,
                    s.text,
                    s.tokens if ended else list(s.tokens),
                    s.cumulative_logprob,
                    s.logprobs if ended or s.logprobs is None else list(s.logprobs),
                    s.finish_reason,
                    ids,
                    text,
                )
            )
        return RequestOutput.from_outputs(rid, req.prompt, outputs, req.prompt_logprobs)
