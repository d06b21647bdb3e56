"""An ``EngineClient`` that exists before its engine does.

``llmkube serve`` starts listening at once and loads the model in the background, so
``/health`` can answer 503 while loading (and Kubernetes probes see the difference between
"starting" and "gone"). Until ``set`` is called every request gets a 503 ``not_ready``;
after ``fail`` the server reports the engine dead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from llmkube.serving.engine.outputs import RequestOutput
from llmkube.serving.engine.protocol import EngineClient, EngineStats, ModelInfo
from llmkube.serving.engine.sampling_params import SamplingParams
from llmkube.serving.engine.tokenizer import Tokenizer
from llmkube.serving.openai import errors


class PendingEngine:
    def __init__(self) -> None:
        self._engine: EngineClient | None = None
        self.error: BaseException | None = None

    def set(self, engine: EngineClient) -> None:
        self._engine = engine

    def fail(self, error: BaseException) -> None:
        self.error = error

    @property
    def engine(self) -> EngineClient:
        if self._engine is None:
            raise errors.engine_dead() if self.error is not None else errors.not_ready()
        return self._engine

    @property
    def is_ready(self) -> bool:
        return self._engine is not None and self._engine.is_ready

    @property
    def is_dead(self) -> bool:
        return self.error is not None or (self._engine is not None and self._engine.is_dead)

    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(prompt_token_ids, params, request_id)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def start(self) -> None:  # the lifespan starts the real engine
        pass

    async def shutdown(self) -> None:
        engine: Any = self._engine
        if engine is not None and hasattr(engine, "shutdown"):
            await engine.shutdown()
