"""Tie an in-process engine's background loop to the ASGI app's lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

from llmkube.serving.openai.pending_engine import PendingEngine

logger = logging.getLogger(__name__)

Lifespan = Callable[[Any], AbstractAsyncContextManager[None]]


class StartableEngine(Protocol):
    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...


def engine_lifespan(engine: StartableEngine, on_ready: Callable[[], None] | None = None) -> Lifespan:
    """Start an already loaded engine with the server, stop it on shutdown."""

    @asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        await engine.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await engine.shutdown()

    return lifespan


def loading_lifespan(
    pending: PendingEngine,
    load: Callable[[], Any],
    on_ready: Callable[[Any], None] | None = None,
) -> Lifespan:
    """Serve at once; load (``load()``, in a thread) and start the engine in the background.

    Until it is ready, requests get 503 ``not_ready``; if loading fails, 503 ``engine_dead``.
    """

    @asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        async def bring_up() -> None:
            try:
                engine = await asyncio.to_thread(load)
                await engine.start()
            except Exception as exc:
                logger.exception("loading the model failed")
                pending.fail(exc)
                return
            pending.set(engine)
            if on_ready is not None:
                try:
                    on_ready(engine)
                except Exception as exc:  # e.g. a chat template that does not compile
                    logger.exception("the engine loaded but cannot be served")
                    pending.fail(exc)

        task = asyncio.create_task(bring_up())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await pending.shutdown()

    return lifespan
