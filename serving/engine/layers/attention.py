"""Attention over the block-paged KV cache.

One step's tokens arrive flattened (``[T, heads, head_dim]``): first one token per
decoding sequence, then the chunks of sequences still prefilling. Each layer writes the
new keys and values into its cache slots, then attends:

* decode tokens, all in one batched call: each sequence's blocks are gathered from the
  cache by block id (whole blocks, not slot by slot — one big contiguous copy per block)
  and padding beyond its context is masked;
* prefill chunks, one call each (a step holds few): against the chunk's own keys when
  nothing precedes it, else against its gathered context, with a causal mask offset by
  the cached prefix.

The model runner publishes the step's layout through ``set_forward_context``, as in
nano-vllm, so model code stays oblivious of paging.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PrefillChunk:
    query_start: int  # offset of the chunk's first token in the step's flattened batch
    query_len: int
    context_len: int  # tokens in the cache after this step, the chunk's own included
    block_table: torch.Tensor  # [num_blocks] long


@dataclass
class ForwardContext:
    slot_mapping: torch.Tensor  # [T] long: flat cache slot of each new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] long, padded with block 0
    decode_context_lens: torch.Tensor | None  # [B] long
    prefills: list[PrefillChunk]


_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    global _context
    _context = context
    try:
        yield
    finally:
        _context = None


def _mask_out_of_window(positions: torch.Tensor, key_len: int, window: int | None) -> torch.Tensor:
    """Boolean ``[..., key_len]`` mask: key j is visible from query position p when
    ``j <= p`` and, with a sliding window, ``j > p - window``."""
    keys = torch.arange(key_len, device=positions.device)
    visible = keys <= positions.unsqueeze(-1)
    if window is not None:
        visible &= keys > positions.unsqueeze(-1) - window
    return visible


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, reading and writing the paged cache."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # Bound by the model runner once the cache is allocated: [num_blocks, block_size, kv_heads, head_dim].
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = _context
        assert ctx is not None, "Attention runs only inside set_forward_context()"
        flat_k = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, ctx.slot_mapping, k)
        flat_v.index_copy_(0, ctx.slot_mapping, v)

        out = torch.empty_like(q)
        if ctx.num_decode_tokens:
            n = ctx.num_decode_tokens
            out[:n] = self._decode(q[:n], ctx.decode_block_tables, ctx.decode_context_lens)
        for chunk in ctx.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], chunk)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _gather(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks: ``[B, kv_heads, blocks * block_size, head_dim]``.

        ``index_select`` on the block dimension: on CPU about 4x faster than the
        equivalent advanced indexing.
        """
        batch = block_tables.shape[0]
        flat_ids = block_tables.flatten()
        keys = self.k_cache.index_select(0, flat_ids).view(batch, -1, self.num_kv_heads, self.head_dim)
        values = self.v_cache.index_select(0, flat_ids).view(batch, -1, self.num_kv_heads, self.head_dim)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def _decode(self, q: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        keys, values = self._gather(block_tables)
        mask = _mask_out_of_window(context_lens - 1, keys.shape[2], self.sliding_window)
        # The queries sharing a KV head become that head's "query positions" (all with the
        # same mask): plain multi-head SDPA, about 2x faster on CPU than enable_gqa.
        batch, group = q.shape[0], self.num_heads // self.num_kv_heads
        out = F.scaled_dot_product_attention(
            q.view(batch, self.num_kv_heads, group, self.head_dim),
            keys,
            values,
            attn_mask=mask[:, None, None, :],
            scale=self.scale,
        )
        return out.reshape(batch, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        query = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
        fresh = chunk.context_len == chunk.query_len
        if fresh and (self.sliding_window is None or chunk.query_len <= self.sliding_window):
            out = F.scaled_dot_product_attention(
                query,
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                is_causal=True,
                scale=self.scale,
                enable_gqa=True,
            )
        else:
            keys, values = self._gather(chunk.block_table.unsqueeze(0))
            positions = torch.arange(chunk.context_len - chunk.query_len, chunk.context_len, device=q.device)
            mask = _mask_out_of_window(positions, keys.shape[2], self.sliding_window)
            out = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask[None, None], scale=self.scale, enable_gqa=True
            )
        return out.squeeze(0).transpose(0, 1)
