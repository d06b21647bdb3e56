"""Token accounting of one HTTP request (``usage`` in responses and the final stream chunk)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from llmkube.serving.engine.outputs import RequestOutput


@dataclass
class UsageCounter:
    prompt_tokens: int
    completion_tokens: dict[tuple[int, int], int] = field(default_factory=dict)  # (run, sample) -> n
    cached_tokens: dict[int, int] = field(default_factory=dict)  # run -> prompt tokens from cache

    @classmethod
    def for_prompts(cls, prompts: Iterable[list[int]]) -> UsageCounter:
        return cls(prompt_tokens=sum(len(p) for p in prompts))

    def observe(self, run: int, output: RequestOutput) -> None:
        self.cached_tokens[run] = max(self.cached_tokens.get(run, 0), output.num_cached_tokens)
        for sample in output.outputs:
            self.completion_tokens[(run, sample.index)] = sample.num_output_tokens

    def to_dict(self) -> dict[str, Any]:
        completion = sum(self.completion_tokens.values())
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }
