"""What the engine streams back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class TokenLogprob:
    """Logprob of one position: the chosen token plus the top alternatives (best first)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token of the raw distribution
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One of a request's ``n`` samples, as a delta since the previous output.

    ``text`` and ``token_ids`` are the *new* text and tokens of this step; concatenating
    every delta gives the final text exactly (stop strings already removed unless asked).
    ``logprobs`` is aligned with ``token_ids`` when the request asked for logprobs.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    num_output_tokens: int  # cumulative
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A step's news for one request: deltas of the samples that advanced this step."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool  # every sample has finished
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only; [0] is None
