"""KV-cache blocks: allocation, reference counts and the prefix cache.

A full block is identified by a chained hash of its tokens and every token before it,
so two sequences sharing a prefix share its blocks. Freed blocks keep their content and
hash and join the free queue in LRU order: a later request may revive them (prefix hit)
until they are handed out again, oldest first. The block's tokens are kept beside the
hash and compared on a hit, so a hash collision can never serve wrong keys and values.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from llmkube.serving.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[int, int] = {}  # content hash -> block id
        self.prefix_queries = 0  # cumulative prompt tokens looked up
        self.prefix_hits = 0  # cumulative prompt tokens found

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def reuse_cached_prefix(self, seq: Sequence) -> None:
        """Give a newly admitted sequence the cached blocks of its longest cached prefix.

        The last token is always left to compute (its logits start generation), so at most
        ``(num_tokens - 1) // block_size`` blocks are reused; ``seq.num_computed_tokens``
        says how many tokens that covers.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        self._extend_hashes(seq)
        if not self.enable_prefix_caching:
            return
        reusable = (seq.num_tokens - 1) // self.block_size
        for index, block_hash in enumerate(seq.block_hashes[:reusable]):
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != self._block_tokens(seq, index):
                break
            self._take(block_id)
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size

    def record_admission(self, seq: Sequence) -> None:
        """Count an admitted sequence's prefix lookup (failed admissions retry; count once)."""
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens; False (nothing taken) if it can't."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            block_id = next(iter(self.free_blocks))
            self._evict(block_id)
            self._take(block_id)
            seq.block_table.append(block_id)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's blocks that became full and computed this step."""
        if not self.enable_prefix_caching:
            return
        self._extend_hashes(seq)
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for index in range(full):
            block = self.blocks[seq.block_table[index]]
            if block.hash is not None:
                continue
            block.hash = seq.block_hashes[index]
            block.token_ids = self._block_tokens(seq, index)
            self.cached_blocks.setdefault(block.hash, block.block_id)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks no one holds become reusable (LRU:
        the sequence's last blocks are the least likely to be shared, so they go first)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None and self.cached_blocks.get(block.hash) == block_id:
            del self.cached_blocks[block.hash]
        block.hash = None
        block.token_ids = ()

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])

    def _extend_hashes(self, seq: Sequence) -> None:
        for index in range(len(seq.block_hashes), seq.num_tokens // self.block_size):
            parent = seq.block_hashes[-1] if seq.block_hashes else 0
            seq.block_hashes.append(hash((parent, self._block_tokens(seq, index))))
