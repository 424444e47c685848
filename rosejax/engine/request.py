"""A request's host state while it is served, and the output records the engine hands back."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from rosejax.engine.block_manager import BlockTable
from rosejax.sampling import SamplingParams
from rosejax.tokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestOutput:
    """What a client sees after a step: the whole output so far, and what this step added."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" or "length" once finished; "error" if serving it failed
    error: str | None = None  # what failed, when finish_reason is "error"


def max_output(prompt_len: int, max_tokens: int, max_context: int) -> int:
    """Tokens a request may generate in all: its max_tokens, or what is left of the model's
    context; a prompt that fills the context still gets the token its prefill samples."""
    return max(1, min(max_tokens, max_context - prompt_len))


class Request:
    __slots__ = (
        "request_id",
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
    ):
        self.request_id = request_id
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
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids.update([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        self._stop_ids = frozenset(stop_ids)
        self.device_stop_ids = sorted(stop_ids)  # the engine's device checks the first few
        self.slot = -1  # the row of the device's slot state this request owns while running
        self.epoch = 0  # bumped at each admission, so results of a pre-preemption run are void
        self.blocks_on_device = 0  # entries of its block table the device already has
        self.inflight = 0  # KV slots that dispatched, unread decode windows may write
        self.num_computed = 0  # prompt tokens prefilled so far, for a prompt prefilled in chunks
        self._new_from = 0  # first output token not yet reported

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
        if self.params.stop:
            self._apply_stop_strings(len(piece))
        return len(taken)

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

    def fail(self, error: str) -> RequestOutput:
        """End the request because serving it failed (its text so far is not handed out)."""
        self.finish_reason, self.error = "error", error
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.output_token_ids,
            text=self.text[: self.emitted],
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="error",
            error=error,
        )

    def take_output(self) -> RequestOutput:
        end = max(self.emitted, self._emittable())
        new_text, self.emitted = self.text[self.emitted : end], end
        new_ids = self.output_token_ids[self._new_from :]
        self._new_from = len(self.output_token_ids)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            # A finished request's list never changes again: handed out as it is, not copied
            # (the last window of a batch finishes every request at once).
            token_ids=self.output_token_ids if self.finished else list(self.output_token_ids),
            text=self.text[: self.emitted] if not self.finished else self.text,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=self.finished,
            finish_reason=self.finish_reason,
        )
