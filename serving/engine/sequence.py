"""A request and its samples: the state the scheduler, block manager and sampler share."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from llmkube.serving.engine.detokenizer import IncrementalDetokenizer
from llmkube.serving.engine.outputs import FinishReason, TokenLogprob
from llmkube.serving.engine.sampling_params import SamplingParams
from llmkube.serving.engine.structured import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    """One sample of a request: its tokens, what of them the KV cache holds, where.

    ``num_computed_tokens`` counts tokens whose keys and values are in the cache; the
    scheduler advances it chunk by chunk and resets it to the prefix-cache hit on
    admission (and to zero on preemption, when everything is recomputed).
    """

    def __init__(
        self,
        request: Request,
        index: int,
        detokenizer: IncrementalDetokenizer,
        generator: torch.Generator | None,
        grammar: GrammarState | None,
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.params = request.params
        self.prompt_token_ids = request.prompt_token_ids
        self.output_token_ids: list[int] = []
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained content hashes of the full blocks so far
        self.status = SequenceStatus.WAITING
        self.detokenizer = detokenizer
        self.generator = generator
        self.grammar = grammar
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        # Delta since the last output, drained by the engine after every step.
        self.new_token_ids: list[int] = []
        self.new_logprobs: list[TokenLogprob] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        self.new_token_ids.append(token_id)
        if logprob is not None:
            self.new_logprobs.append(logprob)


@dataclass
class Request:
    """A submitted request; ``seqs`` are its ``n`` samples. The first is the leader: the
    others wait for it to finish prefilling, then find the prompt in the prefix cache."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_model_len: int
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens the leader found cached on its first admission
    admitted: bool = False
    prompt_logprobs_sent: bool = False

    @property
    def leader(self) -> Sequence:
        return self.seqs[0]

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    @property
    def max_total_tokens(self) -> int:
        """Where a sample stops growing: max_tokens past the prompt, capped by the context."""
        limit = self.max_model_len
        if self.params.max_tokens is not None:
            limit = min(limit, len(self.prompt_token_ids) + self.params.max_tokens)
        return limit
