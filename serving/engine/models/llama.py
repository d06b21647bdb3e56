"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) for the paged KV cache.

The four architectures differ only in flags read from the config: q/k/v bias (Qwen2),
per-head q/k RMSNorm (Qwen3), rope scaling (Llama 3.1), sliding window (Mistral).
Projections are fused (q|k|v, gate|up) so each layer runs four matmuls; ``load_weights``
maps Hugging Face tensor names onto the fused parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from llmkube.serving.engine.errors import ModelLoadError
from llmkube.serving.engine.layers.attention import Attention
from llmkube.serving.engine.layers.norm import RMSNorm
from llmkube.serving.engine.layers.rotary import RotaryEmbedding
from llmkube.serving.engine.model_config import ModelConfig

# Tensors that some checkpoints carry but the model recomputes or never uses.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.split_sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.split_sizes), bias=config.attention_bias)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(heads, kv_heads, head_dim, head_dim**-0.5, config.sliding_window)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        q = q.view(-1, self.heads, self.head_dim)
        k = k.view(-1, self.kv_heads, self.head_dim)
        v = v.view(-1, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        # The rotary tables are computed, not loaded: build them on the real device even
        # when the module tree itself is created on the meta device.
        rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, config.rope_scaling, dtype, device
        )
        self.model = LlamaModel(config, rotary)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Copy checkpoint tensors into the (fused) parameters; every parameter must be filled."""
        params = dict(self.named_parameters())
        if self.config.tie_word_embeddings:
            params.pop("lm_head.weight")
        filled: dict[str, int] = {}  # parameter -> rows filled so far
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and "lm_head.weight" not in params):
                continue
            target, row_offset = self._locate(name)
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"{source}: unexpected tensor '{name}' for {self.config.architecture}")
            rows = param.data.narrow(0, row_offset, tensor.shape[0]) if row_offset is not None else param.data
            if (row_offset is not None and row_offset + tensor.shape[0] > param.shape[0]) or rows.shape != tensor.shape:
                raise ModelLoadError(
                    f"{source}: tensor '{name}' has shape {list(tensor.shape)}, "
                    f"expected {list(rows.shape if row_offset is None else (-1, *param.shape[1:]))}"
                )
            rows.copy_(tensor)
            filled[target] = filled.get(target, 0) + tensor.shape[0]
        missing = [name for name, param in params.items() if filled.get(name, 0) != param.shape[0]]
        if missing:
            raise ModelLoadError(f"{source}: missing tensors for {', '.join(sorted(missing)[:8])}")
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _locate(self, name: str) -> tuple[str, int | None]:
        """Map a HF tensor name to (our parameter, first row) — rows only for fused projections."""
        config = self.config
        q_rows = config.num_attention_heads * config.head_dim
        kv_rows = config.num_key_value_heads * config.head_dim
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", q_rows),
            "v_proj": ("qkv_proj", q_rows + kv_rows),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", config.intermediate_size),
        }
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in fused:
            fused_name, offset = fused[parts[-2]]
            return ".".join([*parts[:-2], fused_name, parts[-1]]), offset
        return name, None
