"""The FastAPI app of the OpenAI surface: routes, API-key check, body-size limit.

``build_app`` takes any ``EngineClient``: the in-process engine for ``llmkube serve``, a
remote one behind Ray Serve. State lives on ``app.state.ctx``; there are no globals.
``/metrics`` is left to the metrics module (mount it on the returned app).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from importlib import metadata
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmkube.serving.engine.protocol import EngineClient
from llmkube.serving.openai import errors
from llmkube.serving.openai.context import ServingContext
from llmkube.serving.openai.observer import RequestObserver
from llmkube.serving.openai.pending_engine import PendingEngine
from llmkube.serving.openai.serving_chat import create_chat_completion
from llmkube.serving.openai.serving_completions import create_completion
from llmkube.serving.openai.serving_tokens import detokenize, tokenize

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


def _version() -> str:
    try:
        return metadata.version("llmkube")
    except metadata.PackageNotFoundError:
        return "unknown"


class BodySizeLimit:
    """Answer 413 for bodies over ``max_bytes``: by Content-Length up front, or while streaming."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._reject(send)
                    return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._error()
            return message

        await self.app(scope, limited_receive, send)

    def _error(self) -> errors.OpenAIError:
        return errors.OpenAIError(
            413, f"Request body too large: the limit is {self.max_bytes} bytes.", code="request_too_large"
        )

    async def _reject(self, send: Send) -> None:
        body = json.dumps(self._error().body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _api_key_checker(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise errors.OpenAIError(
                401,
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                code="missing_api_key",
            )
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise errors.OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key")

    return check


def _model_card(ctx: ServingContext, name: str) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": ctx.created, "owned_by": "llmkube"}
    if ctx.engine.is_ready:
        card["max_model_len"] = ctx.engine.model_info.max_model_len
    return card


def build_router(ctx: ServingContext, *, api_key: str | None) -> APIRouter:
    """The routes; ``ctx`` is bound here, so one process can host several apps."""
    protected = APIRouter(dependencies=[Depends(_api_key_checker(api_key))])
    open_routes = APIRouter()

    @protected.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(ctx, name) for name in ctx.model_names]}

    @protected.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        ctx.check_model(model_id)
        return _model_card(ctx, model_id)

    @protected.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(ctx, request)

    @protected.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(ctx, request)

    @protected.post("/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        return await tokenize(ctx, request)

    @protected.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        return await detokenize(ctx, request)

    @open_routes.get("/health")
    async def health() -> Response:
        ctx.check_ready()
        return Response(status_code=200)

    @open_routes.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    router = APIRouter()
    router.include_router(protected)
    router.include_router(open_routes)
    return router


def build_app(
    engine: EngineClient,
    served_model_name: str | Sequence[str],
    *,
    api_key: str | None = None,
    tool_call_parser: str | None = "hermes",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    chat_template: str | None = None,
    max_concurrent_requests: int | None = None,
    observer: RequestObserver | None = None,
    lifespan: Callable[[Any], AbstractAsyncContextManager[None]] | None = None,
) -> FastAPI:
    """The OpenAI app for one served model. ``lifespan`` (see ``lifespan.engine_lifespan``)
    starts an in-process engine with the server; a remote engine needs none."""
    ctx = ServingContext.create(
        engine,
        served_model_name,
        tool_call_parser=tool_call_parser,
        chat_template=chat_template,
        observer=observer,
        max_concurrent_requests=max_concurrent_requests,
    )
    app = FastAPI(title="llmkube OpenAI-compatible API", version=_version(), docs_url=None, redoc_url=None,
                  openapi_url=None, default_response_class=JSONResponse, lifespan=lifespan)
    if not isinstance(engine, PendingEngine):
        ctx.prepare()  # fail at startup on a broken chat template, not on the first request
    app.state.ctx = ctx
    errors.install_error_handlers(app)
    app.include_router(build_router(ctx, api_key=api_key))
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    return app
