"""The app: OpenAI-compatible routes over the engine's replicas (`ReplicatedEngine`: an engine
process each, or an engine thread each), shared by every connection. The two generation routes
are plain ASGI (`rosejax.serve.asgi.ServingApp`), the rest FastAPI's.

A request's way in: its body is read on the event loop against a size and a time limit (413,
408); then one worker thread, never the engine's and never the event loop, decodes, validates,
renders and tokenizes it, so a hostile body costs the streams in flight no more than a share of
the CPU; only then do its token ids reach the engine. Every refusal is a 4xx in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from rosejax.engine.request import RequestOutput
from rosejax.engine.request_checks import prompt_too_long
from rosejax.sampling import SamplingParams
from rosejax.serve.asgi import (
    ClientGone,
    Receive,
    Send,
    ServingApp,
    openapi_paths,
    read_body,
    send_events,
    send_json,
    until_disconnect,
)
from rosejax.serve.engine_loop import EngineError, Overloaded, RequestStream
from rosejax.serve.metrics import CONTENT_TYPE, ServerMetrics
from rosejax.serve.protocol import (
    CHAT_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    TOKENIZE_UNSUPPORTED,
    UNTIL_CONTEXT,
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Limits,
    TokenizeRequest,
    parse,
    parse_json,
)
from rosejax.serve.replicas import ReplicatedEngine
from rosejax.serve.responses import Formatter, sse
from rosejax.tokenizer import chat_prompt_ids

log = logging.getLogger("rosejax.serve")


async def _collect(receive: Receive, stream: RequestStream) -> list[RequestOutput] | None:
    """Every prompt's final output in order, or None if the client left first (then aborted)."""
    finals: dict[str, RequestOutput] = {}

    async def consume() -> None:
        async for out in stream:
            if out.finished:
                finals[out.request_id] = out

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            return None
        work.result()  # raises EngineError
        return [finals[rid] for rid in stream.request_ids]
    finally:
        for task in (work, gone):
            task.cancel()
        stream.abort()


class _ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error shape, which every 4xx and 5xx of this server has."""

    error: _ErrorDetail


_ERRORS = {
    status: {"model": ErrorBody, "description": why}
    for status, why in {
        400: "invalid request",
        404: "unknown model",
        408: "the body did not arrive in time",
        413: "the body is too large",
        429: "overloaded (Retry-After says when to retry)",
        500: "generating this request failed",
        503: "the server is shutting down",
    }.items()
}
_GENERATION = {
    200: {
        "description": "a JSON body, or with stream=true a stream of server-sent events",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
    **_ERRORS,
}


def _body(name: str) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
        }
    }


def _request_schemas(
    engine: Any, served_model_name: str, limits: Limits, max_prompt_chars: int
) -> dict[str, Any]:
    """JSON schemas of the request bodies, with this server's own bounds (model name,
    vocabulary, context, stop limits) and the unsupported fields' accepted values."""
    schemas: dict[str, Any] = {}
    vocab, context = engine.config.vocab_size, engine.config.max_model_len
    ids = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    for model, unsupported in (
        (CompletionRequest, COMPLETION_UNSUPPORTED),
        (ChatRequest, CHAT_UNSUPPORTED),
    ):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        props = schema["properties"]
        props["model"] = {"anyOf": [{"enum": [served_model_name]}, {"type": "null"}]}
        stop = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}
        props["stop"] = {
            "anyOf": [
                stop,
                {"type": "array", "items": stop, "maxItems": limits.max_stop},
                {"type": "null"},
            ]
        }
        props["stop_token_ids"] = {
            "anyOf": [
                {"type": "array", "items": ids, "maxItems": limits.max_stop},
                {"type": "null"},
            ]
        }
        if "prompt" in props:
            text = {"type": "string", "minLength": 1, "maxLength": max_prompt_chars}
            seq = {"type": "array", "items": ids, "minItems": 1, "maxItems": context}
            props["prompt"]["anyOf"] = [
                text,
                seq,
                {"type": "array", "items": {"anyOf": [text, seq]}, "minItems": 1},
            ]
        _describe_unsupported(props, unsupported)
        schemas[model.__name__] = schema
    for model, unsupported in ((TokenizeRequest, TOKENIZE_UNSUPPORTED), (DetokenizeRequest, {})):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        if "tokens" in schema["properties"]:  # /detokenize's ids: the vocabulary's
            schema["properties"]["tokens"] = {"type": "array", "items": ids, "title": "Tokens"}
        _describe_unsupported(schema["properties"], unsupported)
        schemas[model.__name__] = schema
    return schemas


def _describe_unsupported(props: dict[str, Any], unsupported: dict) -> None:
    """A schema's properties gain the unsupported fields, with the values that are accepted."""
    for name, (neutral, why) in unsupported.items():
        props[name] = {
            "description": f"not supported ({why}); accepted as null or {list(neutral)}",
            "enum": [None, *neutral],
        }


# Bodies up to this size are decoded, validated and tokenized on the event loop.
INLINE_BODY_BYTES = 4096


def create_app(
    engine: Any,
    served_model_name: str = "rosejax",
    max_waiting: int | None = 512,
    metrics: ServerMetrics | None = None,
    limits: Limits | None = None,
    warm_in_background: bool = False,
    sampling_defaults: dict[str, Any] | None = None,
) -> ServingApp:
    """The app for a built `LLMEngine` or `DataParallelEngine` (an engine thread per replica,
    which compiles the programs warm-up has not while idle if `warm_in_background`), or for
    `EngineProcesses` (a process per replica); its lifespan starts and stops them.
    `sampling_defaults`: what a request's sampling fields left out take (the model's generation
    config, `rosejax.models.loader.sampling_defaults`)."""
    async_engine = ReplicatedEngine(
        engine, max_waiting=max_waiting, metrics=metrics, warm_in_background=warm_in_background
    )
    metrics = async_engine.metrics
    limits = limits or Limits()
    context = engine.config.max_model_len
    max_prompt_chars = limits.max_prompt_chars
    if max_prompt_chars is None:  # tokens of at least one character each: past this, never fits
        longest = max(map(len, engine.tokenizer.get_vocab()), default=1)
        max_prompt_chars = context * longest
    # Decoding, validating, rendering and tokenizing bodies past INLINE_BODY_BYTES: one at a
    # time, on a thread of its own (the tokenizer gives up the GIL while it works), so the memory
    # and time a large body costs is bounded and the streams in flight go on meanwhile.
    prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="rosejax-prepare")

    @contextlib.asynccontextmanager
    async def lifespan(app: ServingApp):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()
            prepare_pool.shutdown(wait=False, cancel_futures=True)

    app = ServingApp(title="rosejax", summary="OpenAI-compatible GPT-2 server", lifespan=lifespan)
    app.state.engine = async_engine
    app.state.limits = limits
    created = int(time.time())

    def rejected(e: APIError) -> APIError:
        """`e`, counted in the metrics' rejections."""
        if 400 <= e.status < 500 and e.status != 429:
            metrics.rejected.labels("invalid").inc()
        elif e.status == 429:
            metrics.rejected.labels("overloaded").inc()
        return e

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        rejected(e)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            APIError(str(e.detail), e.status_code, type=kind).body(),
            status_code=e.status_code,
            headers=e.headers,  # 405's Allow
        )

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # gone while sending its body; nothing was queued

    @app.exception_handler(Exception)
    async def server_error(_: Request, e: Exception) -> JSONResponse:
        return JSONResponse(
            APIError(f"internal error: {e}", 500, type="server_error").body(), status_code=500
        )

    def check_chars(chars: int, what: str, param: str) -> None:
        if chars > max_prompt_chars:
            raise APIError(
                f"{what} {chars} characters, more than this server's limit "
                f"({max_prompt_chars}, --max-prompt-chars; the context is {context} tokens)",
                param=param,
            )

    def check_context(ids: list[int], max_tokens: int, param: str) -> None:
        """vLLM's and OpenAI's 400s: the prompt leaves room for a token, and the prompt and
        `max_tokens` fit the context (a chat that names no limit runs to the context's end)."""
        if len(ids) >= context:
            raise APIError(prompt_too_long(len(ids), context), param=param)
        if max_tokens != UNTIL_CONTEXT and len(ids) + max_tokens > context:
            raise APIError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {context} tokens and your request has "
                f"{len(ids)} input tokens ({max_tokens} > {context} - {len(ids)}).",
                param="max_tokens",
            )

    def tokenize(
        prompts: list, params: SamplingParams, n: int = 1, param: str = "prompt"
    ) -> list[list[int]]:
        """Each prompt's token ids (a text's length checked before it is tokenized, the ids
        against the context and `params.max_tokens`), for a list of prompts, of `n` choices
        each, the server can hold at once. `param`: the field an error names."""
        limit = async_engine.max_in_flight
        if limit is not None and len(prompts) * n > limit:
            raise APIError(
                f"this request asks for {len(prompts) * n} choices ({len(prompts)} prompts, n="
                f"{n}); the server holds at most {limit} sequences at once (--max-batch-size + "
                "--max-waiting), so it can never be served: send fewer per request",
                param="prompt",
                code="too_many_prompts",
            )
        ids = []
        for p in prompts:
            if isinstance(p, str):
                check_chars(len(p), "prompt has", "prompt")
            try:
                ids.append(engine.prompt_ids(p))
            except ValueError as e:
                raise APIError(str(e), param=param) from e
            check_context(ids[-1], params.max_tokens, param)
        return ids

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(
                f"the model '{name}' does not exist; this server serves '{served_model_name}'",
                404,
                "model",
                "invalid_request_error",
                "model_not_found",
            )

    def check_request(req: CompletionRequest | ChatRequest) -> None:
        check_model(req.model)
        req.check_limits(limits)
        bias = req.logit_bias_ids()
        if bias and max(bias) >= engine.config.vocab_size:
            raise APIError(
                f"logit_bias token ids must be in [0, {engine.config.vocab_size})",
                param="logit_bias",
            )

    def decode_token(token_id: int) -> str:
        return engine.tokenizer.decode([token_id])

    def formatter(req: CompletionRequest | ChatRequest, chat: bool, **echo: Any) -> Formatter:
        return Formatter(
            f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            served_model_name,
            chat=chat,
            n=req.choices_per_prompt,
            logprobs=req.logprob_kwargs().get("logprobs"),
            decode=decode_token,
            **echo,
        )

    def prepare_completion(raw: bytes):
        req = parse(parse_json(raw), CompletionRequest, COMPLETION_UNSUPPORTED)
        check_request(req)
        params = req.sampling_params(sampling_defaults)
        prompts = req.prompts()
        ids = tokenize(prompts, params, req.choices_per_prompt)
        echo = None
        if req.echo:  # a text prompt as sent; token ids as they decode
            echo = [
                p if isinstance(p, str) else engine.tokenizer.decode(i)
                for p, i in zip(prompts, ids, strict=True)
            ]
        return req, params, ids, formatter(req, False, echo=echo, echo_only=req.echo_only)

    def chat_ids(messages: list, **kwargs: Any) -> list[int]:
        """A conversation's prompt ids through the chat template; 400 if there is none."""
        tokenizer = engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(
                f"the model '{served_model_name}' has no chat template (GPT-2 has "
                "none), so /v1/chat/completions is unavailable: use /v1/completions, "
                "or start the server with --chat-template FILE",
                param="messages",
                code="no_chat_template",
            )
        messages = [m.as_dict() for m in messages]
        check_chars(sum(len(m["content"]) for m in messages), "the messages have", "messages")
        try:
            # Token ids, not text: the template writes BOS itself, which encoding its text
            # again would double (Llama 3).
            return chat_prompt_ids(tokenizer, messages, **kwargs)
        except ValueError as e:  # the template failed, e.g. it refuses a role order
            raise APIError(str(e), param="messages") from e

    def prepare_chat(raw: bytes):
        req = parse(parse_json(raw), ChatRequest, CHAT_UNSUPPORTED)
        check_request(req)
        params = req.sampling_params(sampling_defaults)
        ids = chat_ids(req.messages, chat_template_kwargs=req.chat_template_kwargs)
        ids = tokenize([ids], params, req.choices_per_prompt, "messages")
        return req, params, ids, formatter(req, True)

    async def prepared(scope: dict[str, Any], receive: Receive, prepare) -> Any:
        """`prepare` of the request's body: on the event loop for a small body (tens of µs),
        else on the prepare thread. Two thread hops per request, each waiting for the GIL,
        were most of what 256 requests arriving at once took to reach the engine."""
        raw = await read_body(scope, receive, limits)
        if len(raw) <= INLINE_BODY_BYTES:
            return prepare(raw)
        return await asyncio.get_running_loop().run_in_executor(prepare_pool, prepare, raw)

    async def submit(req: Any, params: Any, prompts: list[list[int]], fmt: Formatter) -> Any:
        try:
            return await async_engine.submit(prompts, params, fmt.id)
        except Overloaded as e:
            raise APIError(
                str(e),
                429,
                type="rate_limit_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            ) from e
        except EngineError as e:
            raise APIError(str(e), e.status, type="server_error", code=e.code) from e
        except ValueError as e:  # the engine's own checks: stop ids, over the KV cache, ...
            first = str(e).split(" ", 1)[0]  # "stop_token_ids must be ...": name the field
            raise APIError(str(e), param=first if first in type(req).model_fields else None) from e

    async def generate(scope: dict[str, Any], receive: Receive, send: Send, prepare) -> None:
        """A completion or chat completion, as plain ASGI (`rosejax.serve.asgi`)."""
        try:
            req, params, prompts, fmt = await prepared(scope, receive, prepare)
            stream = await submit(req, params, prompts, fmt)
            if req.stream:
                usage = (req.include_usage, req.continuous_usage, [len(p) for p in prompts])
                return await send_events(send, receive, sse(stream, fmt, *usage), stream.close)
            try:
                finals = await _collect(receive, stream)
            except EngineError as e:
                raise APIError(str(e), e.status, type="server_error", code=e.code) from e
        except APIError as e:
            return await send_json(send, e.status, rejected(e).body(), e.headers)
        except ClientGone:  # gone while sending its body; nothing was queued
            return
        except Exception as e:
            log.exception("serving %s failed", scope["path"])
            error = APIError(f"internal error: {e}", 500, type="server_error")
            return await send_json(send, 500, error.body())
        if finals is not None:  # else nobody is listening
            await send_json(send, 200, fmt.response(finals))

    async def completions(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await generate(scope, receive, send, prepare_completion)

    async def chat_completions(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await generate(scope, receive, send, prepare_chat)

    app.fast_routes.update(
        {"/v1/completions": completions, "/v1/chat/completions": chat_completions}
    )
    fast_operations = {
        "/v1/completions": {
            "summary": "Completions",
            "operationId": "completions",
            **_body("CompletionRequest"),
            "responses": _GENERATION,
        },
        "/v1/chat/completions": {
            "summary": "Chat Completions",
            "operationId": "chat_completions",
            **_body("ChatRequest"),
            "responses": _GENERATION,
        },
    }

    def tokenize_body(raw: bytes) -> dict[str, Any]:
        req = parse(parse_json(raw), TokenizeRequest, TOKENIZE_UNSUPPORTED)
        check_model(req.model)
        if req.messages is not None:
            ids = chat_ids(
                req.messages,
                add_generation_prompt=req.add_generation_prompt is not False,
                add_special_tokens=bool(req.add_special_tokens),
                chat_template_kwargs=req.chat_template_kwargs,
            )
        else:
            check_chars(len(req.prompt), "prompt has", "prompt")
            add_special = req.add_special_tokens is not False
            ids = engine.tokenizer.encode(req.prompt, add_special_tokens=add_special)
        strs = engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": strs}

    def detokenize_body(raw: bytes) -> dict[str, Any]:
        req = parse(parse_json(raw), DetokenizeRequest)
        check_model(req.model)
        vocab = engine.config.vocab_size
        if req.tokens and not (min(req.tokens) >= 0 and max(req.tokens) < vocab):
            raise APIError(f"tokens must be token ids in [0, {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.post("/tokenize", openapi_extra=_body("TokenizeRequest"), responses=_ERRORS)
    async def tokenize_route(request: Request) -> JSONResponse:
        """vLLM's: a prompt's (or a chat's) token ids, their count and the context length."""
        return JSONResponse(await prepared(request.scope, request.receive, tokenize_body))

    @app.post("/detokenize", openapi_extra=_body("DetokenizeRequest"), responses=_ERRORS)
    async def detokenize_route(request: Request) -> JSONResponse:
        """vLLM's: the text of token ids."""
        return JSONResponse(await prepared(request.scope, request.receive, detokenize_body))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """vLLM's: the tokenizer's class, special tokens and chat template (lm-evaluation-
        harness finds /tokenize through it)."""
        tokenizer = engine.tokenizer
        info: dict[str, Any] = {
            "tokenizer_class": type(tokenizer).__name__,
            **tokenizer.special_tokens_map,
            "model_max_length": context,
        }
        if getattr(tokenizer, "chat_template", None):
            info["chat_template"] = tokenizer.chat_template
        return info

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "rosejax",
            "max_model_len": context,
        }
        return {"object": "list", "data": [card]}

    @app.get(
        "/health", responses={503: {"description": "an engine replica is stopped or stopping"}}
    )
    async def health() -> Response:
        if async_engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine stopped"}, status_code=503)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text format 0.0.4"}},
    )
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            schema["paths"] = {**openapi_paths(fast_operations), **schema["paths"]}
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            schemas = _request_schemas(engine, served_model_name, limits, max_prompt_chars)
            components.update(schemas)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app
