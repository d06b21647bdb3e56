"""The engine behind an asyncio API: one background thread steps the model.

Requests and aborts are handed to the thread through a queue and applied between
steps, so the engine's state is only ever touched by that thread. Each step's outputs
go back to the waiting coroutines in one ``call_soon_threadsafe`` hop. Torch releases
the GIL inside its kernels, so the event loop stays responsive while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from llmkube.serving.engine.config import EngineConfig
from llmkube.serving.engine.errors import EngineDeadError, InvalidRequestError, RequestAbortedError
from llmkube.serving.engine.llm_engine import LLMEngine
from llmkube.serving.engine.outputs import RequestOutput
from llmkube.serving.engine.protocol import EngineStats
from llmkube.serving.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Implements ``EngineClient`` for an engine in this process."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.model_info = self.engine.model_info
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None

    @property
    def is_ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def is_dead(self) -> bool:
        return self._error is not None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="llmkube-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the loop; streams still open end with ``RequestAbortedError``."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        for outputs in list(self._queues.values()):
            outputs.put_nowait(RequestAbortedError("the engine shut down"))

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        if request_id in self._queues:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", "request_id")
        # Registered before any await, so a concurrent duplicate id is refused and a
        # shutdown or a dying loop (both walk the registered queues) can reach this stream.
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = outputs
        submitted = finished = False
        try:
            self._check_alive()
            # Validation may compile a grammar (milliseconds to seconds): keep it off the loop.
            if params.has_structured_output:
                grammar = await asyncio.to_thread(self.engine.validate, prompt_token_ids, params)
            else:
                grammar = self.engine.validate(prompt_token_ids, params)
            self._check_alive()  # the engine may have stopped while the grammar compiled
            self._submit(("add", (request_id, prompt_token_ids, params, grammar)))
            submitted = True
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if submitted and not finished:
                self._submit(("abort", request_id))

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop died: {self._error!r}")
        if not self.is_ready:
            raise EngineDeadError("the engine is not running")

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _submit(self, command: tuple[str, Any]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                self._deliver(self.engine.step())
        except BaseException as exc:  # the loop must report any death, not vanish
            logger.exception("engine loop died")
            self._error = exc
            dead = EngineDeadError(f"the engine loop died: {exc!r}")
            assert self._loop is not None
            for outputs in list(self._queues.values()):
                self._loop.call_soon_threadsafe(outputs.put_nowait, dead)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request_id, prompt, params, grammar = payload
                try:
                    self.engine.add_request(request_id, prompt, params, grammar)
                except Exception as exc:  # one bad request must not take the loop down
                    logger.exception("request %s rejected", request_id)
                    self._deliver_error(request_id, exc)
            else:
                output = self.engine.abort_request(payload)
                if output is not None:
                    self._deliver([output])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch_error, request_id, exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            target = self._queues.get(output.request_id)
            if target is not None:
                target.put_nowait(output)

    def _dispatch_error(self, request_id: str, exc: BaseException) -> None:
        target = self._queues.get(request_id)
        if target is not None:
            target.put_nowait(exc)
