"""A request's host state while it is served, and the output records the engine hands back."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import overload

import numpy as np

from rosejax.engine.block_manager import BlockTable
from rosejax.sampling import NO_BIAS_UNTIL, SamplingParams, TokenLogprobs
from rosejax.tokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(slots=True)  # slots: a window at logprobs=5 makes 6 per token
class Logprob:
    """vLLM's: a token's log-probability under the model's raw distribution, its rank (1 = the
    most likely: the generated token's counts the tokens at least as likely, as vLLM's does,
    unless it is among the top alternatives, whose ranks are their places) and its text
    (`tokenizer.decode` of the token alone)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class FlatLogprobs(Sequence):
    """Logprobs of a run of tokens, read as vLLM's `list[dict[int, Logprob]]` (index, slice,
    iterate, len, ==): per token {its id: Logprob, then each of the `top` most likely: Logprob}.
    Kept as arrays, each position's dict made when it is read: a dict and 1 + top Logprob
    objects for every token of every request are millions of objects at a full batch, which
    the garbage collector walks again and again (vLLM's FlatLogprobs, for the same reason).
    `leading_none`: position 0 is None (a prompt's first token, which nothing predicts).
    `texts`: id -> decoded_token (None: decoded_token None). `capacity`: tokens the arrays
    hold before they first grow. Positions are only appended, so `snapshot` shares the arrays."""

    __slots__ = ("top", "texts", "_first", "_len", "_arrays")

    def __init__(
        self,
        top: int,
        texts: Mapping[int, str] | None,
        leading_none: bool = False,
        capacity: int = 0,
    ):
        self.top, self.texts = top, texts
        self._first = int(leading_none)  # positions before the arrays' first (None)
        self._len = 0  # tokens held; the arrays have room for more
        # tokens [n], their logprobs [n] and ranks [n], the top ids [n, top] and logprobs.
        self._arrays = (
            np.empty(capacity, np.int32),
            np.empty(capacity, np.float32),
            np.empty(capacity, np.int32),
            np.empty((capacity, top), np.int32),
            np.empty((capacity, top), np.float32),
        )

    def extend(self, tokens: np.ndarray, logprobs: TokenLogprobs) -> None:
        """Append tokens [t] with their logprobs (numpy `TokenLogprobs` of [t], at least `top`
        alternatives each)."""
        n, t = self._len, len(tokens)
        if n + t > len(self._arrays[0]):  # doubling: a window at a time costs O(1) a token
            cap = max(n + t, 2 * n)
            self._arrays = tuple(_resized(a, cap, n) for a in self._arrays)
        new = (tokens, logprobs.logprob, logprobs.rank, *(a[:, : self.top] for a in logprobs[2:]))
        for array, values in zip(self._arrays, new, strict=True):
            array[n : n + t] = values
        self._len = n + t

    def arrays_from(self, position: int) -> tuple[np.ndarray, ...]:
        """Copies of the arrays' rows of positions [position, len) (leading Nones have none):
        what `extend_arrays` appends elsewhere, a few small arrays to pickle."""
        lo = max(position - self._first, 0)
        return tuple(a[lo : self._len].copy() for a in self._arrays)

    def extend_arrays(self, arrays: tuple[np.ndarray, ...]) -> None:
        """Append another FlatLogprobs' `arrays_from`."""
        tokens, *logprobs = arrays
        self.extend(tokens, TokenLogprobs(*logprobs))

    def snapshot(self) -> FlatLogprobs:
        """The positions held now, unchanged by later `extend`s (no copy)."""
        view = FlatLogprobs.__new__(FlatLogprobs)
        view.top, view.texts, view._first = self.top, self.texts, self._first
        view._len, view._arrays = self._len, self._arrays
        return view

    def __len__(self) -> int:
        return self._first + self._len

    @overload
    def __getitem__(self, index: int) -> dict[int, Logprob] | None: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[int, Logprob] | None]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return self._dicts(start, stop)
        n = len(self)
        if not -n <= index < n:
            raise IndexError("logprobs index out of range")
        return self._dicts(index % n, index % n + 1)[0]

    def __iter__(self):
        return iter(self._dicts(0, len(self)))

    def _dicts(self, start: int, stop: int) -> list[dict[int, Logprob] | None]:
        """Positions [start, stop)'s dicts: the token (its rank as the device counted it), then
        the top ones (ranks 1..top: a token among them has its place, as in vLLM)."""
        out: list[dict[int, Logprob] | None] = [None] * max(0, min(stop, self._first) - start)
        lo, hi = max(start - self._first, 0), max(stop - self._first, 0)
        if hi <= lo:
            return out
        # One conversion to Python values per array, not a numpy scalar per entry.
        tokens, logprob, rank, top_ids, top_logprobs = (a[lo:hi].tolist() for a in self._arrays)
        text = _no_text if self.texts is None else self.texts.__getitem__
        places = range(1, self.top + 1)
        for token, value, r, ids, values in zip(
            tokens, logprob, rank, top_ids, top_logprobs, strict=True
        ):
            entry = {token: Logprob(value, r, text(token))}
            for place, alt, alt_value in zip(places, ids, values, strict=True):
                entry[alt] = Logprob(alt_value, place, text(alt))
            out.append(entry)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # a list's equality, so unhashable like a list

    def __repr__(self) -> str:
        return repr(list(self))


def _no_text(token_id: int) -> None:
    return None


def _resized(array: np.ndarray, rows: int, keep: int) -> np.ndarray:
    """`array` with `rows` rows, the first `keep` copied."""
    out = np.empty((rows, *array.shape[1:]), array.dtype)
    out[:keep] = array[:keep]
    return out


# Per generated token: {token id: Logprob} with the sampled token and the top-N alternatives
# (the engine's are FlatLogprobs).
SampleLogprobs = Sequence[dict[int, Logprob]]
# Per prompt token: the same given the tokens before it; None for the first.
PromptLogprobs = Sequence[dict[int, Logprob] | None]


@dataclasses.dataclass
class RequestMetrics:
    """When the engine took a request, first scheduled it into a prefill and read its first
    token back (as vLLM's RequestMetrics), in seconds of `time.monotonic()` (not the wall clock
    vLLM's arrival_time is on): one clock for every process of a host, so an API server can set
    them beside its own times."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        """From arrival to the first prefill that took it."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence (vLLM's CompletionOutput), and what this step added to it."""

    index: int  # which of the request's n sequences
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the tokens' logprobs; None unless logprobs asked
    logprobs: SampleLogprobs | None  # one dict per token of token_ids; None unless asked
    finish_reason: str | None = None  # "stop" or "length" once finished, "error" if it failed
    new_token_ids: list[int] = dataclasses.field(default_factory=list)
    new_text: str = ""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """What a client sees after a step: the whole output so far, and what this step added.

    `outputs` holds the request's n sequences (vLLM's RequestOutput.outputs). The flat fields
    (token_ids, text, new_token_ids, new_text) are outputs[0]'s, so n = 1 reads as before;
    `finished` is the whole request's (every sequence finished) and `finish_reason` is
    outputs[0]'s once it is, else None."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" or "length" once finished; "error" if serving it failed
    error: str | None = None  # what failed, when finish_reason is "error"
    outputs: list[CompletionOutput] = dataclasses.field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs is set
    metrics: RequestMetrics | None = None  # the engine's times of the request

    @classmethod
    def from_outputs(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        outputs: list[CompletionOutput],
        prompt_logprobs: PromptLogprobs | None,
        finished: bool,  # every sequence is: counted by the caller, not found by a look at all n
        metrics: RequestMetrics | None = None,
    ) -> RequestOutput:
        """A request's output from its sequences' (the flat fields are outputs[0]'s)."""
        first = outputs[0]
        # Positional: made for every request at every step (and again in a server's API
        # process), where keywords cost it more.
        return cls(
            request_id,
            prompt_token_ids,
            first.token_ids,
            first.text,
            first.new_token_ids,
            first.new_text,
            finished,
            first.finish_reason if finished else None,
            None,  # error
            outputs,
            prompt_logprobs,
            metrics,
        )


class LatestOutputs:
    """The latest CompletionOutput of each of a request's n sequences, remade only where it
    changed: the sequences given something since (`update`'s `due`), and once more those whose
    latest output carried new tokens or text, to hand them out without it. Remaking all n at
    every step cost n^2 over a request."""

    __slots__ = ("outputs", "unfinished", "_news")

    def __init__(self, outputs: list[CompletionOutput]):
        self.outputs = outputs
        self.unfinished = len(outputs)  # sequences whose latest output is not finished
        self._news: set[int] = set()

    def update(
        self, due: Iterable[int], make: Callable[[int], CompletionOutput]
    ) -> list[CompletionOutput]:
        """Remake sequence i's output as `make(i)` where due or news; every output, in a new
        list (the RequestOutputs handed out before keep the outputs they were made with)."""
        remake, self._news = self._news.union(due), set()
        for index in remake:
            was_running = self.outputs[index].finish_reason is None
            output = self.outputs[index] = make(index)
            if output.new_token_ids or output.new_text:
                self._news.add(index)
            if was_running and output.finish_reason is not None:
                self.unfinished -= 1
        return list(self.outputs)


# Tokens a request's logprobs have room for before their arrays first grow (by doubling): all
# of a short request's; 43 KB at 20 alternatives, held even if it stops early.
LOGPROBS_CAPACITY = 256


def max_output(prompt_len: int, max_tokens: int, max_context: int) -> int:
    """Tokens a request may generate in all: its max_tokens, or what is left of the model's
    context; a prompt that fills the context still gets the token its prefill samples."""
    return max(1, min(max_tokens, max_context - prompt_len))


def request_stop_ids(params: SamplingParams, eos_token_id: int | Sequence[int]) -> set[int]:
    """The ids that end a request's output: its stop_token_ids, and EOS unless ignore_eos."""
    stop_ids = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        stop_ids.update([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
    return stop_ids


class Request:
    """One sequence the scheduler runs: a prompt and the tokens generated after it. A request
    with n > 1 runs as n of them, `index` 0 to n-1, in one `SequenceGroup`."""

    __slots__ = (
        "request_id",
        "index",
        "group",
        "logprobs",
        "cumulative_logprob",
        "prompt_logprobs_needed",
        "extras",
        "prompt_token_ids",
        "output_token_ids",
        "params",
        "seed",
        "status",
        "table",
        "detokenizer",
        "text",
        "emitted",
        "finish_reason",
        "error",
        "max_output",
        "_stop_ids",
        "_new_from",
        "device_stop_ids",
        "slot",
        "epoch",
        "blocks_on_device",
        "inflight",
        "num_computed",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        detokenizer: IncrementalDetokenizer,
        eos_token_id: int | Sequence[int],  # one id, or every id that ends a generation
        max_context: int,
        index: int = 0,
        token_texts: Mapping[int, str] | None = None,  # id -> the decoded_token of logprobs
    ):
        self.request_id = request_id
        self.index = index
        self.group: SequenceGroup | None = None  # set by the group it joins
        self.max_output = max_output(len(prompt_token_ids), params.max_tokens, max_context)
        self.logprobs: FlatLogprobs | None = None
        if params.logprobs is not None:
            room = min(self.max_output, LOGPROBS_CAPACITY)
            self.logprobs = FlatLogprobs(params.logprobs, token_texts, capacity=room)
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        # Whether its prefill must still compute the prompt's logprobs (one sequence of a group
        # does; cleared once the prefill that ends the prompt is dispatched).
        self.prompt_logprobs_needed = index == 0 and params.prompt_logprobs is not None
        # Whether it needs the device programs with logits processors, min_p and logprobs.
        self.extras = params.has_processors or params.min_p > 0 or params.logprobs is not None
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed
        self.status = RequestStatus.WAITING
        self.table: BlockTable | None = None
        self.detokenizer = detokenizer
        self.text = ""  # generated text, stop string excluded
        self.emitted = 0  # characters of `text` already handed out
        self.finish_reason: str | None = None
        self.error: str | None = None
        stop_ids = request_stop_ids(params, eos_token_id)
        self._stop_ids = frozenset(stop_ids)
        self.device_stop_ids = sorted(stop_ids)  # the engine's device checks the first few
        self.slot = -1  # the row of the device's slot state this request owns while running
        self.epoch = 0  # bumped at each admission, so results of a pre-preemption run are void
        self.blocks_on_device = 0  # entries of its block table the device already has
        self.inflight = 0  # KV slots that dispatched, unread decode windows may write
        self.num_computed = 0  # prompt tokens prefilled so far, for a prompt prefilled in chunks
        self._new_from = 0  # first output token not yet reported

    def bias_entries(self) -> tuple[list[int], list[float], list[int]]:
        """Its sparse logit biases as (token ids, values, steps until which each holds): the
        logit_bias, then -inf on every stop id (EOS included) until min_tokens."""
        bias = self.params.logit_bias or {}
        ids, values, until = list(bias), list(bias.values()), [NO_BIAS_UNTIL] * len(bias)
        if self.params.min_tokens:
            ids += self.device_stop_ids
            values += [-math.inf] * len(self.device_stop_ids)
            # Past max_output it holds to the end alike, and fits the device's int32.
            until += [min(self.params.min_tokens, self.max_output)] * len(self.device_stop_ids)
        return ids, values, until

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def remaining(self) -> int:
        """Tokens it may still generate (what is in flight on the device included)."""
        return self.max_output - len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def add_tokens(self, tokens: list[int]) -> int:
        """Record sampled tokens in order until one finishes the request (a stop token id, its
        max tokens, a stop string); returns how many were taken."""
        if self.params.stop and len(tokens) > 1:
            # A stop string may end it after any token: one token at a time, as it was streamed.
            for i, token in enumerate(tokens):
                self.add_tokens([token])
                if self.finished:
                    return i + 1
            return len(tokens)
        remaining = self.remaining
        taken = tokens[:remaining]
        if not taken:
            return 0
        if not self._stop_ids.isdisjoint(taken):
            taken = taken[: next(i for i, t in enumerate(taken) if t in self._stop_ids) + 1]
            self.finish_reason = "stop"
        elif len(taken) == remaining:
            self.finish_reason = "length"
        self.output_token_ids.extend(taken)
        piece = self.detokenizer.add_many(taken)
        if self.finish_reason:
            piece += self.detokenizer.flush()
        self.text += piece
        # min_tokens holds stop strings off too (vLLM: matched once past that many tokens).
        if self.params.stop and len(self.output_token_ids) > self.params.min_tokens:
            self._apply_stop_strings(len(piece))
        return len(taken)

    def add_logprobs(self, logprobs: TokenLogprobs) -> None:
        """Record the logprobs (numpy, [t]) of the t tokens `add_tokens` just took."""
        taken = self.output_token_ids[len(self.output_token_ids) - len(logprobs.logprob) :]
        self.logprobs.extend(np.asarray(taken, np.int32), logprobs)
        self.cumulative_logprob += sum(logprobs.logprob.tolist())

    def _apply_stop_strings(self, piece_len: int) -> None:
        # Only the new piece (and the longest stop string before it) can hold a new match.
        start = max(0, len(self.text) - piece_len - max(len(s) for s in self.params.stop) + 1)
        hits = [i for s in self.params.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish_reason = "stop"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _emittable(self) -> int:
        """Characters of `text` safe to show: while running, hold back a tail that could still
        grow into a stop string, so no text past a stop string is ever returned."""
        if self.finished or not self.params.stop:
            return len(self.text)
        text, hold = self.text, 0
        for s in self.params.stop:
            # The longest tail of the text that begins s: only tails starting with s[0] can, so
            # look at those (longest first) rather than at every length.
            tail = text[len(text) - min(len(s) - 1, len(text)) :]
            i = tail.find(s[0])
            while 0 <= i < len(tail) - hold:
                if s.startswith(tail[i:]):
                    hold = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return len(text) - hold

    def take_completion(self) -> CompletionOutput:
        """Its output so far, and what it gained since the last call."""
        end = max(self.emitted, self._emittable())
        new_text, self.emitted = self.text[self.emitted : end], end
        new_ids = self.output_token_ids[self._new_from :]
        self._new_from = len(self.output_token_ids)
        finished = self.finished
        logprobs = self.logprobs
        return CompletionOutput(
            index=self.index,
            # A finished request's lists never change again: handed out as they are, not copied
            # (the last window of a batch finishes every request at once).
            text=self.text if finished else self.text[: self.emitted],
            token_ids=self.output_token_ids if finished else list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs if finished or logprobs is None else logprobs.snapshot(),
            finish_reason=self.finish_reason,
            new_token_ids=new_ids,
            new_text=new_text,
        )


class SequenceGroup:
    """What one `add_request` asked for: a prompt, its n sequences (`Request`s, which the
    scheduler runs one by one) and the prompt's logprobs; a step hands out one RequestOutput
    for all of them."""

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sequences",
        "prompt_logprobs",
        "error",
        "metrics",
        "_latest",
        "_fed",
    )

    def __init__(
        self,
        request_id: str,
        sequences: list[Request],
        metrics: RequestMetrics,
        token_texts: Mapping[int, str] | None = None,  # id -> the decoded_token of logprobs
    ):
        self.request_id = request_id
        self.metrics = metrics
        self.prompt_token_ids = sequences[0].prompt_token_ids
        self.sequences = sequences
        for sequence in sequences:
            sequence.group = self
        # Filled position by position as prefills are read back; the first token has none.
        top = sequences[0].params.prompt_logprobs
        self.prompt_logprobs: FlatLogprobs | None = None
        if top is not None:
            room = len(self.prompt_token_ids) - 1
            self.prompt_logprobs = FlatLogprobs(top, token_texts, leading_none=True, capacity=room)
        self.error: str | None = None
        self._latest = LatestOutputs([s.take_completion() for s in sequences])
        self._fed: set[int] = set()  # sequences given tokens since the last output

    def fed(self, sequence: Request) -> None:
        """`sequence` was given tokens: the next output remakes its CompletionOutput."""
        self._fed.add(sequence.index)

    def add_prompt_logprobs(self, start: int, logprobs: TokenLogprobs) -> None:
        """The logprobs (numpy, [t]) of prompt positions start, start + 1, ...; positions
        already recorded are skipped (so a prefill read back twice adds nothing twice)."""
        skip = max(0, len(self.prompt_logprobs) - start)
        tokens = np.asarray(self.prompt_token_ids[start + skip : start + len(logprobs.rank)])
        self.prompt_logprobs.extend(tokens, TokenLogprobs(*(a[skip:] for a in logprobs)))

    def fail(self, error: str) -> None:
        """End every sequence because serving one failed (their text so far is not handed out)."""
        self.error = error
        for s in self.sequences:
            s.finish_reason = "error"

    def take_output(self) -> RequestOutput:
        if self.error is not None:
            first = self.sequences[0]
            return RequestOutput(
                request_id=self.request_id,
                prompt_token_ids=self.prompt_token_ids,
                token_ids=first.output_token_ids,
                text=first.text[: first.emitted],
                new_token_ids=[],
                new_text="",
                finished=True,
                finish_reason="error",
                error=self.error,
                metrics=self.metrics,
            )
        fed, self._fed = self._fed, set()
        outputs = self._latest.update(fed, lambda i: self.sequences[i].take_completion())
        return RequestOutput.from_outputs(
            self.request_id,
            self.prompt_token_ids,
            outputs,
            self.prompt_logprobs,
            self._latest.unfinished == 0,
            self.metrics,
        )
