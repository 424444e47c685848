"""OpenAI response bodies and Server-Sent-Event streams for completions and chat completions."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from rosejax.engine.request import RequestOutput
from rosejax.serve.engine_loop import EngineError, RequestStream
from rosejax.serve.protocol import APIError


def usage(finals: Iterable[RequestOutput]) -> dict[str, int]:
    finals = list(finals)
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    return _usage(prompt, sum(len(o.token_ids) for o in finals))


class Formatter:
    """Builds the bodies of one HTTP request: `chat` picks chat.completion over text_completion."""

    def __init__(self, request_id: str, model: str, chat: bool):
        self.id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())

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

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """The non-streamed body: one choice per prompt, in prompt order."""
        choices = []
        for i, out in enumerate(finals):
            choice: dict[str, Any] = {"index": i}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": out.text}
            else:
                choice["text"] = out.text
            choice.update(logprobs=None, finish_reason=out.finish_reason)
            choices.append(choice)
        return {**self._envelope(choices, False), "usage": usage(finals)}

    def chunk(
        self, index: int, text: str, finish_reason: str | None, role: bool = False
    ) -> dict[str, Any]:
        if self.chat:
            delta = (
                {"role": "assistant", "content": text}
                if role
                else ({"content": text} if text else {})
            )
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text}
        choice.update(logprobs=None, finish_reason=finish_reason)
        return self._envelope([choice], True)

    def usage_chunk(self, finals: Iterable[RequestOutput]) -> dict[str, Any]:
        return {**self._envelope([], True), "usage": usage(finals)}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


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
    chunks carry usage null and a last chunk the totals. An engine error ends the stream with
    an error event and `[DONE]`.

    Ending early for any reason (the client left and Starlette cancelled us, or an error) aborts
    what is still running, so its KV blocks are freed at once.
    """
    index = {rid: i for i, rid in enumerate(stream.request_ids)}
    finals: dict[str, RequestOutput] = {}
    prompt_tokens = prompt_tokens or [0] * len(index)

    def extra(i: int, completion: int) -> dict[str, Any]:
        if continuous_usage:
            return {"usage": _usage(prompt_tokens[i], completion)}
        return {"usage": None} if include_usage else {}

    try:
        if fmt.chat:  # OpenAI opens each chat choice with the assistant role
            for i in range(len(index)):
                yield _event({**fmt.chunk(i, "", None, role=True), **extra(i, 0)})
        async for out in stream:
            if out.finished:
                finals[out.request_id] = out
            if out.new_text or out.finished:
                i = index[out.request_id]
                chunk = fmt.chunk(i, out.new_text, out.finish_reason)
                yield _event({**chunk, **extra(i, len(out.token_ids))})
        if include_usage:
            yield _event(fmt.usage_chunk(finals.values()))
    except EngineError as e:
        yield _event(APIError(str(e), e.status, type="server_error", code=e.code).body())
    finally:
        stream.abort()
    yield "data: [DONE]\n\n"
