"""A request's host state while it is served, and the output records the engine hands back."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

from rosejax.engine.block_manager import BlockTable
from rosejax.sampling import NO_BIAS_UNTIL, SamplingParams
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


# Per generated token: {token id: Logprob} with the sampled token and the top-N alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: the same given the tokens before it; None for the first.
PromptLogprobs = list[dict[int, Logprob] | None]


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

    @classmethod
    def from_outputs(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        outputs: list[CompletionOutput],
        prompt_logprobs: PromptLogprobs | None,
    ) -> RequestOutput:
        """A request's output from its sequences' (the flat fields are outputs[0]'s)."""
        first = outputs[0]
        finished = all(c.finished() for c in outputs)
        return cls(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            token_ids=first.token_ids,
            text=first.text,
            new_token_ids=first.new_token_ids,
            new_text=first.new_text,
            finished=finished,
            finish_reason=first.finish_reason if finished else None,
            outputs=outputs,
            prompt_logprobs=prompt_logprobs,
        )


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
    ):
        self.request_id = request_id
        self.index = index
        self.group: SequenceGroup | None = None  # set by the group it joins
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
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
        self.max_output = max_output(len(prompt_token_ids), params.max_tokens, max_context)
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
            until += [self.params.min_tokens] * len(self.device_stop_ids)
        return ids, values, until

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def remaining(self) -> int:
        """Tokens it may still generate (what is in flight on the device included)."""
        return self.max_output - len(self.output_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

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

    def add_logprobs(self, entries: SampleLogprobs, logprobs: list[float]) -> None:
        """Record the logprob dicts of the tokens `add_tokens` just took, and their own
        logprobs (for the cumulative one)."""
        self.logprobs.extend(entries)
        self.cumulative_logprob += sum(logprobs)

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
            logprobs=logprobs if finished or logprobs is None else list(logprobs),
            finish_reason=self.finish_reason,
            new_token_ids=new_ids,
            new_text=new_text,
        )


class SequenceGroup:
    """What one `add_request` asked for: a prompt, its n sequences (`Request`s, which the
    scheduler runs one by one) and the prompt's logprobs; a step hands out one RequestOutput
    for all of them."""

    __slots__ = ("request_id", "prompt_token_ids", "sequences", "prompt_logprobs", "error")

    def __init__(self, request_id: str, sequences: list[Request], prompt_logprobs: bool):
        self.request_id = request_id
        self.prompt_token_ids = sequences[0].prompt_token_ids
        self.sequences = sequences
        for sequence in sequences:
            sequence.group = self
        # Filled position by position as prefills are read back; the first token has none.
        self.prompt_logprobs: PromptLogprobs | None = [None] if prompt_logprobs else None
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def add_prompt_logprobs(self, start: int, entries: PromptLogprobs) -> None:
        """The logprob dicts of prompt positions start, start + 1, ...; positions already
        recorded are skipped (so a prefill read back twice adds nothing twice)."""
        have = len(self.prompt_logprobs)
        self.prompt_logprobs.extend(entries[max(0, have - start) :])

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
            )
        outputs = [s.take_completion() for s in self.sequences]
        return RequestOutput.from_outputs(
            self.request_id, self.prompt_token_ids, outputs, self.prompt_logprobs
        )
