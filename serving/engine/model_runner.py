"""Turns a step's scheduled chunks into tensors, runs the model, and samples.

Owns the weights, the KV cache tensors and the sampler; knows nothing about requests'
lifecycles. On CPU it runs eagerly; on CUDA the same code runs (SDPA picks the fused
flash / memory-efficient kernels), see ``docs/architecture.md`` for CUDA graphs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from llmkube.serving.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from llmkube.serving.engine.layers.attention import ForwardContext, PrefillChunk, set_forward_context
from llmkube.serving.engine.loader import iter_safetensors
from llmkube.serving.engine.model_config import ModelConfig
from llmkube.serving.engine.models.llama import LlamaForCausalLM
from llmkube.serving.engine.outputs import TokenLogprob
from llmkube.serving.engine.sampler import Sampler, SamplerOutput, prompt_logprobs
from llmkube.serving.engine.scheduler import ScheduledChunk
from llmkube.serving.engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    sampled: list[Sequence]  # the sequences that produced a token, aligned with ``output``
    output: SamplerOutput


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        model_dir: Path,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.config = model_config
        self.block_size = engine_config.block_size
        self.device = device
        self.dtype = dtype
        with torch.device("meta"):
            model = LlamaForCausalLM(model_config, max_model_len, dtype, device)
        model = model.to_empty(device=device).to(dtype)
        model.load_weights(iter_safetensors(model_dir, dtype, device), source=str(model_dir))
        self.model = model.eval()
        self.sampler = Sampler(model_config.vocab_size, eos_token_ids)
        self.num_blocks = self._size_kv_cache(engine_config, max_model_len)
        shape = (
            2,
            model_config.num_hidden_layers,
            self.num_blocks,
            self.block_size,
            model_config.num_key_value_heads,
            model_config.head_dim,
        )
        # Zeroed, not empty: padding slots are masked out of attention, but a NaN there
        # would still poison the weighted sum (0 * NaN = NaN).
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        for layer_index, attention in enumerate(self.model.attention_layers()):
            attention.k_cache = self.kv_cache[0, layer_index]
            attention.v_cache = self.kv_cache[1, layer_index]

    @property
    def bytes_per_block(self) -> int:
        config = self.config
        element = torch.tensor([], dtype=self.dtype).element_size()
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element
        return per_token * self.block_size

    def _size_kv_cache(self, engine_config: EngineConfig, max_model_len: int) -> int:
        if engine_config.kv_cache_memory_bytes is not None:
            budget = engine_config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            # Leave room for activations of the largest step: a rough but safe reserve.
            activations = engine_config.max_num_batched_tokens * self.config.intermediate_size * 2 * 4 * 4
            budget = int(total * engine_config.gpu_memory_utilization) - used_by_others - activations
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        blocks_per_seq = -(-max_model_len // self.block_size)
        # No point holding more than every running sequence at full length could use.
        num_blocks = min(budget // self.bytes_per_block, blocks_per_seq * engine_config.max_num_seqs)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"the KV cache budget ({budget / 2**20:.1f} MiB) holds {num_blocks * self.block_size} tokens, "
                f"fewer than max_model_len ({max_model_len}); raise the budget or lower max_model_len"
            )
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB)",
            num_blocks,
            self.block_size,
            num_blocks * self.bytes_per_block / 2**20,
        )
        return num_blocks

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> StepResult:
        # Decode tokens first (batched attention), then prefill chunks.
        ordered = sorted(chunks, key=lambda chunk: chunk.num_tokens != 1)
        num_decode = next((i for i, chunk in enumerate(ordered) if chunk.num_tokens != 1), len(ordered))
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillChunk] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        sample_rows: list[int] = []  # rows of the logits that yield each sampled token
        prompt_logprob_chunks: list[tuple[ScheduledChunk, int]] = []
        bs = self.block_size
        for index, chunk in enumerate(ordered):
            seq, start, count = chunk.seq, chunk.seq.num_computed_tokens, chunk.num_tokens
            end = start + count
            query_start = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if index >= num_decode:
                blocks = torch.tensor(table[: -(-end // bs)], dtype=torch.long)
                prefills.append(PrefillChunk(query_start, count, end, blocks.to(self.device)))
            if self._wants_prompt_logprobs(seq, start):
                prompt_logprob_chunks.append((chunk, len(logit_rows)))
                logit_rows.extend(range(query_start, query_start + count))
            elif chunk.completes_sequence:
                logit_rows.append(query_start + count - 1)
            if chunk.completes_sequence:
                sampled.append(seq)
                sample_rows.append(len(logit_rows) - 1)

        decode_tables = decode_lens = None
        if num_decode:
            decode_seqs = [chunk.seq for chunk in ordered[:num_decode]]
            width = max(len(seq.block_table) for seq in decode_seqs)
            decode_tables = torch.tensor(
                [seq.block_table + [0] * (width - len(seq.block_table)) for seq in decode_seqs],
                dtype=torch.long,
                device=self.device,
            )
            decode_lens = torch.tensor(
                [seq.num_computed_tokens + 1 for seq in decode_seqs], dtype=torch.long, device=self.device
            )
        context = ForwardContext(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decode_tokens=num_decode,
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            prefills=prefills,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        with set_forward_context(context):
            hidden = self.model(ids, pos)
        logits = self.model.compute_logits(hidden[logit_rows])

        for chunk, first_row in prompt_logprob_chunks:
            self._record_prompt_logprobs(chunk, logits[first_row : first_row + chunk.num_tokens])
        if not sampled:
            return StepResult([], SamplerOutput([], []))
        return StepResult(sampled, self.sampler(logits[sample_rows], sampled))

    @staticmethod
    def _wants_prompt_logprobs(seq: Sequence, start: int) -> bool:
        # Not again after a preemption once they were sent: the list now belongs to the caller.
        return (
            seq.index == 0
            and seq.params.prompt_logprobs is not None
            and not seq.request.prompt_logprobs_sent
            and start < len(seq.prompt_token_ids)
        )

    @staticmethod
    def _record_prompt_logprobs(chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """Logits at position p score prompt token p + 1; position 0 has no logprob."""
        seq = chunk.seq
        request = seq.request
        prompt = seq.prompt_token_ids
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None] * len(prompt)
        start = seq.num_computed_tokens
        targets = [p + 1 for p in range(start, start + chunk.num_tokens) if p + 1 < len(prompt)]
        if not targets:
            return
        results: list[TokenLogprob] = prompt_logprobs(
            logits[: len(targets)], [prompt[t] for t in targets], seq.params.prompt_logprobs or 0
        )
        for target, result in zip(targets, results, strict=True):
            request.prompt_logprobs[target] = result
