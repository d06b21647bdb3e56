"""Test and demo helpers: deterministic random-weight Hugging Face checkpoints."""

from llmkube.serving.testing.checkpoint import (
    ARCHITECTURES,
    GENERATOR_VERSION,
    SIZES,
    build_tokenizer,
    default_cache_dir,
    demo_checkpoint,
    write_checkpoint,
)

__all__ = [
    "ARCHITECTURES",
    "GENERATOR_VERSION",
    "SIZES",
    "build_tokenizer",
    "default_cache_dir",
    "demo_checkpoint",
    "write_checkpoint",
]
