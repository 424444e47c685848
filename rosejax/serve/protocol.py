"""OpenAI request bodies: pydantic models that forbid unknown fields, and explicit refusals.

A field rosejax cannot honour (best_of, suffix, tools, ...) is a 400 that names it: a client
that asked for it must not get an answer computed without it. Sending such a field with its
neutral value (best_of=1, tools=[]) is accepted, as the official clients may do so.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema

from rosejax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one HTTP request may send; each is a `python -m rosejax.serve` flag. A request past
    one is a 4xx before any of it reaches the engine."""

    max_body_bytes: int = 8 * 2**20  # 413 past it
    # Characters of one prompt (a chat's rendered messages), checked before tokenizing. None:
    # the context times the longest token, past which a prompt can never fit the context.
    max_prompt_chars: int | None = None
    max_stop: int = 64  # stop strings per request, and stop token ids per request
    max_stop_chars: int = 512  # characters of one stop string
    # Seconds a client has to send a request's head, and then its body (408); 0: no limit.
    read_timeout: float = 30.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and value < 0:
                raise ValueError(f"{f.name} must be >= 0, got {value}")


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = (
            message,
            status,
            param,
            type,
            code,
        )
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# field -> (neutral values that are accepted, why it is refused otherwise)
COMPLETION_UNSUPPORTED = {
    "best_of": ((1,), "best_of is not implemented"),
    "suffix": (("",), "suffix (insertion) is not implemented"),
}
UNTIL_CONTEXT = 2**31 - 1  # a chat's max_tokens when it gives none

CHAT_UNSUPPORTED = {
    "tools": (([],), "tool calling is not implemented"),
    "tool_choice": (("none",), "tool calling is not implemented"),
    "functions": (([],), "function calling is not implemented"),
    "function_call": (("none",), "function calling is not implemented"),
    "parallel_tool_calls": ((), "tool calling is not implemented"),
    "response_format": (({"type": "text"},), "structured output is not implemented"),
}
# /tokenize renders messages as a chat does: the same neutral tools
TOKENIZE_UNSUPPORTED = {"tools": CHAT_UNSUPPORTED["tools"]}


def _integral(value: Any) -> Any:
    """An integral float (2.0) as the int it is: JSON Schema's "integer" admits it, as vLLM's
    requests do. Anything else as given, for the strict int check."""
    return int(value) if type(value) is float and value.is_integer() else value


def _neutral(value: Any, neutral: tuple) -> bool:
    # Compare types too: True == 1 in Python, but best_of=true is not best_of=1 (1.0 is).
    value = _integral(value)
    return value is None or any(type(value) is type(v) and value == v for v in neutral)


# An int field of a request: no "5" or true, but 5.0 is 5.
Integer = Annotated[int, BeforeValidator(_integral)]


class _Body(BaseModel):
    # strict: no "5" -> 5 or true -> 1 coercion; a wrong type is a 400, not a guess.
    model_config = ConfigDict(extra="forbid", strict=True)

    def check(self) -> None:
        """What the types cannot say: ranges and combinations; APIError(400) naming the field."""


class StreamOptions(_Body):
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk carries the usage of its choice so far (guidellm).
    continuous_usage_stats: bool | None = False


def _bounds(**bounds: Any) -> Any:
    """A field's range, for /openapi.json only (check() or SamplingParams checks it, with its
    own messages); a JSON schema's bounds leave null alone."""
    return Field(None, json_schema_extra=bounds)


# OpenAI's bound on `logprobs` (completions) and `top_logprobs` (chat).
MAX_LOGPROBS = 20


def _require(ok: bool, name: str, what: str, value: Any) -> None:
    if not ok:
        raise APIError(f"{name} must be {what}, got {value!r}", param=name)


class _Sampling(_Body):
    model: str | None = None
    max_tokens: Integer | None = _bounds(minimum=1)
    temperature: float | None = _bounds(minimum=0)
    top_p: float | None = _bounds(exclusiveMinimum=0, maximum=1)
    top_k: Integer | None = _bounds(minimum=-1)  # extra, as in vLLM (0 or -1: off)
    min_p: float | None = _bounds(minimum=0, maximum=1)  # extra, as in vLLM
    seed: Integer | None = _bounds(minimum=-(2**63), maximum=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[Integer] | None = None  # extra, as in vLLM
    ignore_eos: bool | None = None  # extra, as in vLLM
    min_tokens: Integer | None = _bounds(minimum=0)  # extra, as in vLLM
    n: Integer | None = _bounds(minimum=1)
    presence_penalty: float | None = _bounds(minimum=-2, maximum=2)
    frequency_penalty: float | None = _bounds(minimum=-2, maximum=2)
    repetition_penalty: float | None = _bounds(exclusiveMinimum=0)  # extra, as in vLLM
    # token id, as a decimal string (JSON keys are strings) -> bias added to its logit
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an opaque end-user id; nothing depends on it

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def logprob_kwargs(self) -> dict[str, int]:
        """SamplingParams' logprobs and prompt_logprobs, as this kind of request asks them."""
        return {}

    def _check_max_tokens(self) -> None:
        for name in ("max_tokens", "max_completion_tokens"):
            # (getattr with a default: pydantic raises, and catching that cost a request ~4 µs)
            value = getattr(self, name) if name in type(self).model_fields else None
            if value is not None and value <= 0:
                raise APIError(f"{name} must be > 0, got {value}", param=name)

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "stream_options is only allowed with stream=true", param="stream_options"
            )
        self._check_max_tokens()
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(value is None or -2 <= value <= 2, name, "in [-2, 2]", value)
        r = self.repetition_penalty
        _require(r is None or 0 < r < float("inf"), "repetition_penalty", "> 0 (1 = off)", r)
        _require(self.min_p is None or 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _require(self.n is None or self.n >= 1, "n", ">= 1", self.n)
        min_tokens, max_tokens = self.min_tokens, self._max_tokens()
        _require(min_tokens is None or min_tokens >= 0, "min_tokens", ">= 0", min_tokens)
        if min_tokens and max_tokens is not None and min_tokens > max_tokens:
            raise APIError(
                f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})",
                param="min_tokens",
            )
        self.logit_bias_ids()

    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias with int keys; each key a token id >= 0, each bias in [-100, 100]."""
        if self.logit_bias is None:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            # A token id has a few digits (and int() refuses a string past 4,300 of them).
            is_id = key.isascii() and key.isdecimal() and len(key) <= 18
            _require(is_id, "logit_bias", "keyed by token ids", key[:40])
            _require(-100 <= bias <= 100, "logit_bias", "biases in [-100, 100]", bias)
            out[int(key)] = bias
        return out

    def sampling_kwargs(self, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """SamplingParams' keyword arguments for this request. A sampling field the request
        left out takes the model's default (`defaults`: its generation config), else is left
        out, so SamplingParams' own default holds."""
        max_tokens = self._max_tokens()
        given = dict(
            temperature=self.temperature,
            # Any top_k >= vocab keeps every token; clamp so it fits the engine's int32.
            top_k=None if self.top_k is None else min(self.top_k, 2**31 - 1),
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
        )
        sampling = (defaults or {}) | {k: v for k, v in given.items() if v is not None}
        kwargs = dict(
            max_tokens=16 if max_tokens is None else max_tokens,
            **sampling,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=bool(self.ignore_eos),
        )
        optional = dict(
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias_ids() or None,
            min_tokens=self.min_tokens,
            **self.logprob_kwargs(),
        )
        return kwargs | {k: v for k, v in optional.items() if v is not None}

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        try:
            return _shared_params(self.sampling_kwargs(defaults))
        except ValueError as e:
            first = str(e).split(" ", 1)[0]
            raise APIError(str(e), param=first if first in type(self).model_fields else None) from e

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def check_limits(self, limits: Limits) -> None:
        """Stop strings and stop token ids within the server's bounds."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        for name, values in (("stop", stops), ("stop_token_ids", self.stop_token_ids or [])):
            if len(values) > limits.max_stop:
                raise APIError(
                    f"{name} has {len(values)} entries, more than this server's limit "
                    f"({limits.max_stop}, --max-stop-sequences)",
                    param=name,
                )
        longest = max(map(len, stops), default=0)
        if longest > limits.max_stop_chars:
            raise APIError(
                f"a stop string has {longest} characters, more than this server's limit "
                f"({limits.max_stop_chars}, --max-stop-chars)",
                param="stop",
            )


# kwargs (`_exact`) -> their SamplingParams, frozen and only read: requests that ask for the same
# share one, validated once (a few µs a request) and pickled once per message to the engine.
_PARAMS: dict[tuple, SamplingParams] = {}
_MAX_PARAMS = 1024  # distinct ones kept; then the cache starts over


def _exact(value: Any) -> Any:
    """A hashable form of a decoded JSON value that equal values of the same types share, and
    nothing else (1, 1.0 and True are equal in Python)."""
    if isinstance(value, list):
        return (list, *map(_exact, value))
    if isinstance(value, dict):
        return (dict, *((k, _exact(v)) for k, v in value.items()))
    return (type(value), value)


def _shared_params(kwargs: dict[str, Any]) -> SamplingParams:
    """`SamplingParams(**kwargs)`, the same object for the same kwargs (ValueError: invalid)."""
    key = tuple((name, _exact(value)) for name, value in kwargs.items())
    params = _PARAMS.get(key)
    if params is None:
        params = SamplingParams(**kwargs)
        if len(_PARAMS) >= _MAX_PARAMS:
            _PARAMS.clear()
        _PARAMS[key] = params
    return params


def _ids(x: Any) -> list[int] | None:
    """x as token ids (`_integral`'s floats as ints), or None if it is no non-empty list of them."""
    if not (isinstance(x, list) and x):
        return None
    if all(type(t) is int for t in x):  # the common case, without a copy
        return x
    ids = [_integral(t) for t in x]
    return ids if all(type(t) is int for t in ids) else None


_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_SCHEMA = {
    "description": "a string, a list of token ids, or a list of either (one choice each)",
    "anyOf": [
        {"type": "string", "minLength": 1},
        _IDS_SCHEMA,
        {
            "type": "array",
            "items": {"anyOf": [{"type": "string", "minLength": 1}, _IDS_SCHEMA]},
            "minItems": 1,
        },
    ],
}


class CompletionRequest(_Sampling):
    # Checked by prompts(): a pydantic union would answer with one error per union member.
    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)]
    max_tokens: Integer | None = _bounds(minimum=0)  # 0 only with echo: the prompt alone
    # The top `logprobs` tokens' logprobs at each token, and the token's own.
    logprobs: Integer | None = _bounds(minimum=0, maximum=MAX_LOGPROBS)
    echo: bool | None = False  # the prompt before the completion (with logprobs: theirs too)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt alone."""
        return bool(self.echo) and self.max_tokens == 0

    def _max_tokens(self) -> int | None:
        # echo with max_tokens 0 still runs the prompt (its logprobs come from the prefill),
        # and the one token generated is dropped, as in vLLM.
        return 1 if self.echo_only else self.max_tokens

    def logprob_kwargs(self) -> dict[str, int]:
        if self.logprobs is None:
            return {}
        if self.echo:
            return {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs}
        return {"logprobs": self.logprobs}

    def _check_max_tokens(self) -> None:
        if not self.echo_only:
            super()._check_max_tokens()

    def check(self) -> None:
        super().check()
        n = self.logprobs
        _require(n is None or 0 <= n <= MAX_LOGPROBS, "logprobs", f"in [0, {MAX_LOGPROBS}]", n)

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: a string or a token id list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        ids = _ids(p)
        if ids is not None:
            return [ids]
        if isinstance(p, list) and p:
            each = [x if isinstance(x, str) else _ids(x) for x in p]
            if all(x is not None for x in each):
                return each
        if p == [] or (isinstance(p, list) and [] in p):
            raise APIError("prompt is empty", param="prompt")
        raise APIError(
            "prompt must be a string, a list of token ids (ints), or a list of "
            "strings or token id lists (one choice each)",
            param="prompt",
        )


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        c = self.content
        text = "".join(p.text for p in c) if isinstance(c, list) else (c or "")
        # OpenAI's newer name for system; templates (Qwen3's) render system and drop the rest.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": text}


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Integer | None = _bounds(minimum=1)
    chat_template_kwargs: dict[str, Any] | None = None  # to the template: Qwen3's enable_thinking
    logprobs: bool | None = False  # each token's logprob
    # with logprobs: the `top_logprobs` most likely tokens at each token, and their logprobs
    top_logprobs: Integer | None = _bounds(minimum=0, maximum=MAX_LOGPROBS)

    def logprob_kwargs(self) -> dict[str, int]:
        return {"logprobs": self.top_logprobs or 0} if self.logprobs else {}

    def check(self) -> None:
        super().check()
        n = self.top_logprobs
        _require(n is None or 0 <= n <= MAX_LOGPROBS, "top_logprobs", f"in [0, {MAX_LOGPROBS}]", n)
        if n and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")

    def _max_tokens(self) -> int:
        # max_completion_tokens is the newer name; it wins when both are given, as in OpenAI.
        limit = (
            self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
        )
        # Neither: the rest of the context, as in OpenAI and vLLM (the engine caps it there).
        return UNTIL_CONTEXT if limit is None else limit


class TokenizeRequest(_Body):
    """vLLM's /tokenize body: a `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Default: true for a prompt (as /v1/completions encodes it), false for messages (the
    # template writes them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # messages only; default true
    chat_template_kwargs: dict[str, Any] | None = None  # messages only
    return_token_strs: bool | None = False  # also each token's string (the vocabulary's form)

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give either prompt or messages", param="prompt")
        for name in ("add_generation_prompt", "chat_template_kwargs"):
            if getattr(self, name) is not None and self.messages is None:
                raise APIError(f"{name} applies to messages only", param=name)


class DetokenizeRequest(_Body):
    """vLLM's /detokenize body: token ids -> {"prompt": their text}."""

    model: str | None = None
    tokens: list[Integer]


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


# What can decode to a lone surrogate: a \uD800-\uDFFF escape, or its UTF-8 form (json.loads
# decodes bytes with surrogatepass). Bodies without either skip the walk of check_text. Each
# pattern starts with a literal, which re looks for at memchr's speed (one pattern of the two
# alternatives tested every byte: 6x slower).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE_UTF8 = re.compile(rb"\xed[\xa0-\xbf]")


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from e
    except RecursionError:
        raise APIError("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw) or _SURROGATE_UTF8.search(raw):
        check_text(body)
    return body


def check_text(body: Any) -> None:
    """Every string in a decoded body (keys too) is valid Unicode: JSON's \\ud800 escapes decode
    to lone surrogates, which no tokenizer, template or UTF-8 encoder takes. Iterative: a body
    may nest as deep as the JSON decoder allows."""

    def check(text: str, path: tuple) -> None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            # The path's keys are valid (each was checked before its value), but may be long.
            param = ".".join(str(x)[:64] for x in path) or None
            raise APIError(
                f"{param or 'the body'}: a string holds a lone surrogate (an unpaired "
                "\\ud800-\\udfff escape), which is not valid Unicode text",
                param=param,
            ) from None

    todo: list[tuple[Any, tuple]] = [(body, ())]  # containers still to look into
    while todo:
        value, path = todo.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(k, str):
                check(k, path)
            if isinstance(v, str):
                check(v, (*path, k))
            elif isinstance(v, (dict, list)):
                todo.append((v, (*path, k)))


def parse(body: dict[str, Any], model: type[_Body], unsupported: dict | None = None) -> Any:
    """Validate a decoded body; every problem is an APIError(400) naming the field."""
    for name, (neutral, why) in (unsupported or {}).items():
        if name in body:
            value = body.pop(name)
            if not _neutral(value, neutral):
                raise APIError(
                    f"'{name}' is not supported by rosejax: {why}",
                    param=name,
                    code="unsupported_parameter",
                )
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # Drop union-member tags ("str", "list[str]", "TextPart") from the location.
        loc = [
            x
            for x in err["loc"]
            if isinstance(x, int) or (x.islower() and "[" not in x and x not in _TYPE_TAGS)
        ]
        param = ".".join(str(x) for x in loc) or None
        if err["type"] == "extra_forbidden":
            raise APIError(
                f"unknown field '{param}': rosejax does not support it",
                param=param,
                code="unsupported_parameter",
            ) from None
        raise APIError(f"{param}: {err['msg']}" if param else err["msg"], param=param) from None
    req.check()
    return req
