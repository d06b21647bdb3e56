"""What runs in the next step: continuous batching with chunked prefill.

Each step has a token budget (``max_num_batched_tokens``). Running sequences go first,
in admission order: one token each when decoding, the next chunk of their prompt when
still prefilling. Then waiting sequences are admitted first come, first served, while
the budget, the cap on running sequences and the free blocks allow. When a running
sequence needs a block and none is free, the most recently admitted one is preempted:
its blocks are freed and it goes back to the head of the queue to be recomputed later
(its cached blocks often survive in the prefix cache, making that cheap).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from llmkube.serving.engine.block_manager import BlockManager
from llmkube.serving.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens computed this step, from seq.num_computed_tokens on

    @property
    def completes_sequence(self) -> bool:
        """The chunk reaches the sequence's last token, so its logits yield the next token."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate(seq, num_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                chunks.append(ScheduledChunk(seq, num_tokens))
                budget -= num_tokens
                index += 1
        # Admitting while others were just preempted would only thrash.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if seq.index > 0 and not self._leader_prefilled(seq):
                break
            # Prompt logprobs need every prompt position's logits: no prefix reuse then.
            if seq.params.prompt_logprobs is None:
                self.block_manager.reuse_cached_prefix(seq)
                if seq.index == 0 and not seq.request.admitted:
                    seq.request.num_cached_tokens = seq.num_computed_tokens
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.allocate(seq, num_tokens):
                # All or nothing: a waiting sequence must never pin blocks, or it could
                # starve the ones ahead of it.
                self.block_manager.free(seq)
                break
            self.waiting.popleft()
            self.block_manager.record_admission(seq)
            seq.request.admitted = True
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens
        return chunks

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    @staticmethod
    def _leader_prefilled(seq: Sequence) -> bool:
        leader = seq.request.leader
        return leader.is_finished or leader.num_computed_tokens >= len(leader.prompt_token_ids)
