"""Per-request sampling parameters, validated once at submission."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmkube.serving.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """What to sample and when to stop, for one request (all ``n`` samples share it).

    Semantics follow vLLM's ``SamplingParams`` so users of its extensions feel at home:
    ``temperature == 0`` is greedy; ``top_k == 0`` (or -1) disables top-k; ``stop`` strings
    are removed from the output unless ``include_stop_str_in_output``; ``logprobs`` is the
    number of top alternatives returned beside the sampled token (``None`` = no logprobs,
    ``0`` = only the sampled token's logprob); logprobs are those of the raw model
    distribution (before penalties, bias, temperature and grammar masks).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured output: at most one of these is set (see structured.py).
    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_structured_output(self) -> bool:
        return (
            self.json_schema is not None
            or self.json_object
            or self.regex is not None
            or self.grammar is not None
        )

    def validate(self, vocab_size: int) -> None:
        """Raise ``InvalidRequestError`` naming the first bad field."""
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                "max_tokens",
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                0.0 <= self.temperature <= 2.0,
                "temperature",
                f"temperature must be in [0, 2], got {self.temperature}",
            ),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, "top_k", f"top_k must be -1 (disabled) or at least 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                "presence_penalty",
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty",
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                0.0 < self.repetition_penalty <= 2.0,
                "repetition_penalty",
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}",
            ),
            (
                self.seed is None or 0 <= self.seed < 2**63 - self.n,
                "seed",
                f"seed must be in [0, 2**63 - n) (sample i uses seed + i), got {self.seed}",
            ),
            (
                sum([self.json_schema is not None, self.json_object, self.regex is not None,
                     self.grammar is not None]) <= 1,
                "response_format",
                "at most one structured-output constraint may be set",
            ),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param)
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids contains {token_id}, outside the vocabulary [0, {vocab_size})",
                    "stop_token_ids",
                )
        for token_id, bias in self.logit_bias.items():
            if not 0 <= int(token_id) < vocab_size:
                raise InvalidRequestError(
                    f"logit_bias names token {token_id}, outside the vocabulary [0, {vocab_size})",
                    "logit_bias",
                )
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}",
                    "logit_bias",
                )
