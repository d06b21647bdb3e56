"""Shared pytest fixtures.

Checkpoint fixtures are session-scoped and shared by every test: treat the
directories they return as read-only (copy one with ``shutil.copytree`` into
``tmp_path`` before editing files in it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from llmkube.serving.testing import write_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory ``tiny_checkpoint(arch="qwen2", **write_checkpoint_kwargs) -> Path``.

    Each distinct argument set is generated once per session (a tiny
    checkpoint takes milliseconds once the tokenizer is trained).
    """
    cache: dict[tuple[str, tuple[tuple[str, Any], ...]], Path] = {}

    def make(arch: str = "qwen2", **kwargs: Any) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in cache:
            name = "-".join([arch, *(f"{k}-{v}" for k, v in key[1])])
            cache[key] = write_checkpoint(tmp_path_factory.mktemp(name), arch, "tiny", **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def qwen2_tiny(tiny_checkpoint: Callable[..., Path]) -> Path:
    """The default tiny checkpoint: Qwen2 architecture, float32, one safetensors file."""
    return tiny_checkpoint("qwen2")
