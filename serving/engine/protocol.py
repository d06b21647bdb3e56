"""The one async interface the API layer uses to talk to an engine.

The in-process ``AsyncEngine`` implements it, and so does the Ray Serve client that
forwards to a remote replica: the OpenAI layer cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from llmkube.serving.engine.outputs import RequestOutput
from llmkube.serving.engine.sampling_params import SamplingParams
from llmkube.serving.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the served checkpoint that the API layer needs."""

    max_model_len: int
    vocab_size: int  # the model's output width (may exceed the tokenizer's)
    eos_token_ids: frozenset[int]
    architecture: str


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics and load reporting."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # used blocks / total blocks, 0..1
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative prompt tokens looked up
    prefix_cache_hits: int  # cumulative prompt tokens found


class EngineClient(Protocol):
    model_info: ModelInfo
    tokenizer: Tokenizer

    @property
    def is_ready(self) -> bool: ...

    @property
    def is_dead(self) -> bool: ...

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and stream its outputs until every sample finished.

        Raises ``InvalidRequestError`` (before the first output) for bad input. Closing
        the iterator early (client gone, task cancelled) aborts the request and frees
        its KV blocks.
        """
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...
