"""Engine configuration: what to load and how much room to give it."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3


@dataclass
class EngineConfig:
    """Knobs of one engine instance (one replica).

    ``model`` is a local checkpoint directory or ``hf://org/name[@revision]``.
    The KV cache takes ``gpu_memory_utilization`` of the GPU memory left after loading
    the weights, or ``kv_cache_memory_bytes`` when given (always on CPU).
    """

    model: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True
