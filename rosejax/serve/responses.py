"""OpenAI response bodies and Server-Sent-Event streams for completions and chat completions.

Logprobs come from the engine as vLLM hands them out: per token a dict {token id: Logprob}
(`logprob`, 1-based `rank`, `decoded_token`) holding the token itself and the most likely
tokens; a prompt's first token has None (nothing before it predicts it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from json.encoder import encode_basestring
from typing import Any

from rosejax.engine.request import RequestOutput
from rosejax.serve.engine_loop import EngineError, RequestStream
from rosejax.serve.protocol import APIError

log = logging.getLogger("rosejax.serve")

Decode = Callable[[int], str]  # token id -> its text
Step = dict[int, Any]  # token id -> Logprob, at one position


def choices_of(out: RequestOutput) -> Sequence[Any]:
    """One prompt's choices (its `n` sequences), each with `text`, `token_ids`, `logprobs` (when
    asked for) and `finish_reason`."""
    return out.outputs


def _logprob(x: float) -> float:
    # JSON has no -inf: a token the filters ruled out gets -9999, as in OpenAI and vLLM.
    return max(x, -9999.0)


def _token_text(token_id: int, logprob: Any, decode: Decode) -> str:
    text = logprob.decoded_token
    return decode(token_id) if text is None else text


def _by_rank(step: Step, top: int, also: int | None = None) -> list[tuple[int, Any]]:
    """(id, Logprob) of the `top` most likely tokens of a step (and of `also`), by rank."""
    kept = [(i, lp) for i, lp in step.items() if lp.rank <= top or i == also]
    return sorted(kept, key=lambda item: item[1].rank)


def completion_logprobs(
    token_ids: Sequence[int],
    steps: Sequence[Step | None],
    top: int,
    decode: Decode,
    offset: int = 0,
) -> dict[str, list]:
    """OpenAI's completions `logprobs` of `token_ids`: each token's text and logprob, a dict
    {text: logprob} of the `top` most likely tokens and the token itself, and where each token
    starts in the choice's text (`offset`: where the first one does)."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, step in zip(token_ids, steps, strict=True):
        if step is None:
            token, logprob, best = decode(token_id), None, None
        else:
            chosen = step[token_id]
            token, logprob, best = _token_text(token_id, chosen, decode), chosen.logprob, {}
            logprob = _logprob(logprob)
            for i, lp in _by_rank(step, top, also=token_id):
                # Tokens that share a text (byte fragments) share an entry: the likelier wins.
                text = _token_text(i, lp, decode)
                best[text] = max(best.get(text, -9999.0), _logprob(lp.logprob))
        tokens.append(token)
        token_logprobs.append(logprob)
        top_logprobs.append(best)
        text_offset.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def _chat_entry(token_id: int, logprob: Any, decode: Decode) -> dict[str, Any]:
    token = _token_text(token_id, logprob, decode)
    return {"token": token, "logprob": _logprob(logprob.logprob), "bytes": list(token.encode())}


def chat_logprobs(
    token_ids: Sequence[int], steps: Sequence[Step], top: int, decode: Decode
) -> dict[str, list]:
    """OpenAI's chat `logprobs`: per token its text, logprob, UTF-8 bytes and the `top` most
    likely tokens (`top_logprobs`), most likely first."""
    content = []
    for token_id, step in zip(token_ids, steps, strict=True):
        entry = _chat_entry(token_id, step[token_id], decode)
        entry["top_logprobs"] = [_chat_entry(i, lp, decode) for i, lp in _by_rank(step, top)]
        content.append(entry)
    return {"content": content}


@dataclasses.dataclass
class _Sent:
    """How much of one choice a stream has sent."""

    chars: int = 0  # of the choice's generated text
    tokens: int = 0  # of its generated tokens
    offset: int = 0  # characters of the text the client has, echoed prompt included
    started: bool = False
    finished: bool = False


class Formatter:
    """Builds the bodies of one HTTP request: `chat` picks chat.completion over text_completion.

    `n` choices per prompt, prompt i's choice j at index i * n + j. `logprobs`: how many top
    tokens to list at each token (None: no logprobs). `echo`: each prompt's text, put before
    its choices' text (their logprobs before theirs); `echo_only`: the prompt alone.
    """

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        *,
        n: int = 1,
        logprobs: int | None = None,
        decode: Decode | None = None,
        echo: Sequence[str] | None = None,
        echo_only: bool = False,
    ):
        self.id, self.model, self.chat = request_id, model, chat
        self.n, self.logprobs, self.decode = n, logprobs, decode
        self.echo, self.echo_only = echo, echo_only
        self.created = int(time.time())
        # Every chunk's JSON up to its choice: the envelope's, whose last field is the choices.
        self._chunk_head = _json(self._envelope([], True)).removesuffix("]}")

    def _envelope(self, choices: list[dict], chunk: bool) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        if chunk and self.chat:
            obj += ".chunk"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _piece(self, i: int, out: RequestOutput, choice: Any, sent: _Sent) -> tuple[str, Any]:
        """The text and logprobs of prompt i's `choice` that `sent` says are not sent yet;
        advances `sent` past them."""
        if self.echo_only:
            text, ids, steps = "", [], []
        else:
            text, ids = choice.text[sent.chars :], choice.token_ids[sent.tokens :]
            steps = choice.logprobs[sent.tokens :] if self.logprobs is not None else None
            sent.chars, sent.tokens = len(choice.text), len(choice.token_ids)
        if self.echo is not None and not sent.started:
            text, ids = self.echo[i] + text, [*out.prompt_token_ids, *ids]
            if self.logprobs is not None:
                steps = [*out.prompt_logprobs, *steps]
        sent.started = True
        logprobs = None
        if self.logprobs is not None:
            if self.chat:
                logprobs = chat_logprobs(ids, steps, self.logprobs, self.decode)
            else:
                logprobs = completion_logprobs(ids, steps, self.logprobs, self.decode, sent.offset)
        sent.offset += len(text)
        return text, logprobs

    def _finish_reason(self, choice: Any) -> str | None:
        if self.echo_only and choice.finish_reason is not None:
            return "length"  # max_tokens 0, reached
        return choice.finish_reason

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """The non-streamed body: n choices per prompt, in prompt order."""
        choices = []
        for i, out in enumerate(finals):
            for j, c in enumerate(choices_of(out)):
                text, logprobs = self._piece(i, out, c, _Sent())
                body: dict[str, Any] = {"index": i * self.n + j}
                if self.chat:
                    body["message"] = {"role": "assistant", "content": text}
                else:
                    body["text"] = text
                body.update(logprobs=logprobs, finish_reason=self._finish_reason(c))
                choices.append(body)
        return {**self._envelope(choices, False), "usage": self.usage(finals)}

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        role: bool = False,
        logprobs: Any = None,
        usage: str = "",
    ) -> str:
        """One choice's chunk, as JSON (written here field by field as json.dumps writes it,
        which cost a chunk several times more); `usage`: its usage field (`, "usage": ...`),
        "" for none."""
        rest = f'"logprobs": {_json(logprobs)}, "finish_reason": {_json(finish_reason)}'
        if not self.chat:
            choice = f'{{"index": {index}, "text": {_json(text)}, {rest}}}'
        else:
            if role:
                delta = f'{{"role": "assistant", "content": {_json(text)}}}'
            else:
                delta = f'{{"content": {_json(text)}}}' if text else "{}"
            choice = f'{{"index": {index}, "delta": {delta}, {rest}}}'
        return f"{self._chunk_head}{choice}]{usage}}}"

    def chunks(
        self,
        i: int,
        out: RequestOutput,
        sent: dict[int, _Sent],
        usage: Callable[[int, int], str] | None = None,
    ) -> Iterable[str]:
        """The chunks (JSON) of what prompt i's output `out` adds to what `sent` (choice index
        -> _Sent) says was sent; `usage(choice index, its tokens so far)`: each one's usage
        field (`chunk`'s)."""
        for j, c in enumerate(choices_of(out)):
            index = i * self.n + j
            s = sent.setdefault(index, _Sent())
            finish = self._finish_reason(c)
            if s.finished:
                continue
            unsent_prompt = self.echo is not None and not s.started
            # New tokens make a chunk even without new text (a character's first bytes, a
            # token without text), as vLLM streams: the client sees every step's tokens.
            grew = len(c.token_ids) > s.tokens or len(c.text) > s.chars
            news = unsent_prompt or (not self.echo_only and grew)
            if not (news or finish):
                continue
            text, logprobs = self._piece(i, out, c, s)
            s.finished = finish is not None
            tokens = 0 if self.echo_only else len(c.token_ids)
            extra = "" if usage is None else usage(index, tokens)
            yield self.chunk(index, text, finish, logprobs=logprobs, usage=extra)

    def usage(self, finals: Iterable[RequestOutput]) -> dict[str, int]:
        finals = list(finals)
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        if self.echo_only:
            return _usage(prompt, 0)
        return _usage(prompt, sum(len(c.token_ids) for o in finals for c in choices_of(o)))

    def usage_chunk(self, finals: Iterable[RequestOutput]) -> dict[str, Any]:
        return {**self._envelope([], True), "usage": self.usage(finals)}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


_ENCODER = json.JSONEncoder(ensure_ascii=False)


def _json(value: Any) -> str:
    """`value` as json.dumps(value, ensure_ascii=False) writes it; None and strings without
    the encoder's setup."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return encode_basestring(value)
    return _ENCODER.encode(value)


def _event(data: str | dict[str, Any]) -> str:
    """A server-sent event of JSON (or of a dict, as JSON)."""
    return f"data: {data if isinstance(data, str) else _json(data)}\n\n"


async def sse(
    stream: RequestStream,
    fmt: Formatter,
    include_usage: bool,
    continuous_usage: bool = False,
    prompt_tokens: list[int] | None = None,
) -> AsyncIterator[str]:
    """The stream of one HTTP request as SSE: chunks, an optional usage chunk, `data: [DONE]`.
    With `continuous_usage` (vLLM's continuous_usage_stats) every chunk carries its choice's
    usage so far (`prompt_tokens`: each prompt's length); otherwise, with `include_usage`,
    chunks carry usage null and a last chunk the totals. An engine error, or any other failure
    once the stream has begun (its 200 is out), ends the stream with an error event and
    `[DONE]`. What is ready at once goes out as one piece: the events of one output, and the
    last output's with the usage chunk and `[DONE]` (each piece a write to the socket).

    Ending early for any reason (the client left and `send_events` closed the stream, or an
    error) aborts what is still running, so its KV blocks are freed at once.
    """
    prompt_of = {rid: i for i, rid in enumerate(stream.request_ids)}
    finals: dict[str, RequestOutput] = {}
    sent: dict[int, _Sent] = {}
    prompt_tokens = prompt_tokens or [0] * len(prompt_of)

    def usage_field(index: int, completion: int) -> str:  # a chunk's usage, as JSON
        if continuous_usage:
            return f', "usage": {_json(_usage(prompt_tokens[index // fmt.n], completion))}'
        return ', "usage": null' if include_usage else ""

    events = ""  # not sent yet
    try:
        if fmt.chat:  # OpenAI opens each chat choice with the assistant role
            indices = range(len(prompt_of) * fmt.n)
            roles = (fmt.chunk(i, "", None, role=True, usage=usage_field(i, 0)) for i in indices)
            yield "".join(map(_event, roles))
        async for out in stream:
            if out.finished:
                finals[out.request_id] = out
            chunks = fmt.chunks(prompt_of[out.request_id], out, sent, usage_field)
            events = "".join(map(_event, chunks))
            if events and not stream.ended:  # the last output's go with what ends the stream
                yield events
                events = ""
        if include_usage:
            events += _event(fmt.usage_chunk(finals.values()))
    except EngineError as e:
        events += _event(APIError(str(e), e.status, type="server_error", code=e.code).body())
    except Exception as e:  # not the client's doing: it still gets a whole stream, with why
        log.exception("streaming a response failed")
        events += _event(APIError(f"internal error: {e}", 500, type="server_error").body())
    finally:
        stream.abort()
    yield events + "data: [DONE]\n\n"
