"""The FastAPI app: OpenAI-compatible routes over one AsyncEngine shared by every connection."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from rosejax.engine.request import RequestOutput
from rosejax.serve.engine_loop import AsyncEngine, EngineError, Overloaded, RequestStream
from rosejax.serve.metrics import CONTENT_TYPE, ServerMetrics
from rosejax.serve.protocol import (
    CHAT_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    APIError,
    ChatRequest,
    CompletionRequest,
    parse,
    parse_json,
)
from rosejax.serve.responses import Formatter, sse
from rosejax.tokenizer import chat_prompt_ids


async def _until_disconnect(request: Request) -> None:
    """Returns once the client has gone (the body is read already, so only that can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, stream: RequestStream) -> list[RequestOutput] | None:
    """Every prompt's final output in order, or None if the client left first (then aborted)."""
    finals: dict[str, RequestOutput] = {}

    async def consume() -> None:
        async for out in stream:
            if out.finished:
                finals[out.request_id] = out

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_until_disconnect(request))
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


def create_app(
    engine: Any,
    served_model_name: str = "rosejax",
    max_waiting: int | None = 512,
    metrics: ServerMetrics | None = None,
) -> FastAPI:
    """The app for a built `LLMEngine`; its lifespan starts and stops the engine thread."""
    async_engine = AsyncEngine(engine, max_waiting=max_waiting, metrics=metrics)
    metrics = async_engine.metrics

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()

    app = FastAPI(title="rosejax", summary="OpenAI-compatible GPT-2 server", lifespan=lifespan)
    app.state.engine = async_engine
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        if e.status in (400, 404):
            metrics.rejected.labels("invalid").inc()
        elif e.status == 429:
            metrics.rejected.labels("overloaded").inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            APIError(str(e.detail), e.status_code, type=kind).body(), status_code=e.status_code
        )

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: Request, e: ClientDisconnect) -> Response:
        return Response(status_code=499)  # gone while sending its body; nothing was queued

    @app.exception_handler(Exception)
    async def server_error(_: Request, e: Exception) -> JSONResponse:
        return JSONResponse(
            APIError(f"internal error: {e}", 500, type="server_error").body(), status_code=500
        )

    async def run(
        request: Request, req: CompletionRequest | ChatRequest, prompts: list, fmt: Formatter
    ) -> Response:
        if req.model is not None and req.model != served_model_name:
            raise APIError(
                f"the model '{req.model}' does not exist; this server serves '{served_model_name}'",
                404,
                "model",
                "invalid_request_error",
                "model_not_found",
            )
        params = req.sampling_params()
        try:
            stream = await async_engine.submit(prompts, params, fmt.id)
        except Overloaded as e:
            raise APIError(str(e), 429, type="rate_limit_error", code="overloaded") from e
        except EngineError as e:
            raise APIError(str(e), 503, type="server_error") from e
        except ValueError as e:  # the engine's own checks: empty prompt, over the context, ...
            raise APIError(str(e), param="prompt" if "prompt" in str(e) else None) from e
        if req.stream:
            return StreamingResponse(
                sse(stream, fmt, req.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(stream.abort),
            )
        try:
            finals = await _collect(request, stream)
        except EngineError as e:
            raise APIError(str(e), 500, type="server_error") from e
        if finals is None:  # nobody is listening; 499 as in nginx, for the access log
            return Response(status_code=499)
        return JSONResponse(fmt.response(finals))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_json(await request.body())
        req = parse(body, CompletionRequest, COMPLETION_UNSUPPORTED)
        fmt = Formatter(f"cmpl-{uuid.uuid4().hex}", served_model_name, chat=False)
        return await run(request, req, req.prompts(), fmt)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_json(await request.body())
        req = parse(body, ChatRequest, CHAT_UNSUPPORTED)
        tokenizer = engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(
                f"the model '{served_model_name}' has no chat template (GPT-2 has "
                "none), so /v1/chat/completions is unavailable: use /v1/completions, "
                "or start the server with --chat-template FILE",
                param="messages",
                code="no_chat_template",
            )
        try:
            # Token ids, not text: the template writes BOS itself, which encoding its text
            # again would double (Llama 3).
            prompt = chat_prompt_ids(tokenizer, [m.as_dict() for m in req.messages])
        except Exception as e:  # jinja errors, e.g. a template that refuses a role order
            raise APIError(
                f"the chat template failed on these messages: {e}", param="messages"
            ) from e
        fmt = Formatter(f"chatcmpl-{uuid.uuid4().hex}", served_model_name, chat=True)
        return await run(request, req, [prompt], fmt)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "rosejax",
            "max_model_len": engine.config.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if async_engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine stopped"}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
