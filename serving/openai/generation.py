"""Driving engine requests for one HTTP request: start, merge, abort.

A request with several prompts becomes several engine requests. Each is *started*
(first output awaited) before any response byte is sent, so an engine rejection
(``InvalidRequestError``: bad schema, too-long prompt) still becomes a 400 status, even
for streams. Whatever happens afterwards (client gone, task cancelled, error), every
engine request that has not finished is aborted, so its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request

from llmkube.serving.engine.outputs import RequestOutput
from llmkube.serving.engine.protocol import EngineClient
from llmkube.serving.engine.sampling_params import SamplingParams
from llmkube.serving.openai import errors, sse
from llmkube.serving.openai.context import Admission
from llmkube.serving.openai.errors import ClientDisconnectedError

T = TypeVar("T")


class EngineRun:
    """One engine request and its output stream."""

    def __init__(self, engine: EngineClient, prompt_ids: list[int], params: SamplingParams, request_id: str):
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.params = params
        self.request_id = request_id
        self._iterator: AsyncIterator[RequestOutput] | None = None
        self._first: RequestOutput | None = None
        self.finished = False

    async def start(self) -> None:
        """Submit and wait for the first output (raises the engine's rejection, if any)."""
        self._iterator = aiter(self.engine.generate(self.prompt_ids, self.params, self.request_id))
        try:
            self._first = await anext(self._iterator)
        except StopAsyncIteration:
            self.finished = True
            return
        self.finished = self._first.finished

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        assert self._iterator is not None, "start() first"
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        if self.finished:
            return
        async for output in self._iterator:
            self.finished = output.finished
            yield output
            if output.finished:
                return
        self.finished = True

    async def close(self) -> None:
        """Abort if still running; always close the engine's iterator."""
        if not self.finished and self._iterator is not None:
            with contextlib.suppress(Exception):
                await self.engine.abort(self.request_id)
        self.finished = True
        closer = getattr(self._iterator, "aclose", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                await closer()


async def start_runs(runs: list[EngineRun]) -> None:
    """Start every run concurrently; if any is rejected, abort all and re-raise."""
    results = await asyncio.gather(*(run.start() for run in runs), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await close_runs(runs)
        raise errors[0]


async def close_runs(runs: list[EngineRun]) -> None:
    for run in runs:
        await run.close()


async def merge_runs(runs: list[EngineRun]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of all runs as they come, tagged with the run's position."""
    if len(runs) == 1:
        async for output in runs[0].outputs():
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int, run: EngineRun) -> None:
        try:
            async for output in run.outputs():
                await queue.put((i, output))
        except Exception as exc:  # delivered to the consumer, which re-raises
            await queue.put((i, exc))
            return
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, run)) for i, run in enumerate(runs)]
    remaining = len(runs)
    try:
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnectedError


async def framed_stream(
    events: AsyncIterator[str],
    usage_chunk: Callable[[], dict[str, Any] | None],
    runs: list[EngineRun],
    admission: Admission,
) -> AsyncIterator[str]:
    """The frame every OpenAI stream shares: its events, the usage-only chunk when asked
    for, then ``[DONE]``. An error after the first byte can only be told in-band, as an
    error event; however the stream ends, its engine requests and its admission slot go."""
    try:
        async for event in events:
            yield event
        final = usage_chunk()
        if final is not None:
            yield sse.event(final)
        yield sse.DONE
    except Exception as exc:
        yield sse.event(errors.from_exception(exc).body())
        yield sse.DONE
    finally:
        await close_runs(runs)
        admission.release()
