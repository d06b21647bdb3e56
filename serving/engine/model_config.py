"""The subset of a Hugging Face ``config.json`` our model code needs, validated."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmkube.serving.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # normalised: always has "rope_type"
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    sliding_window: int | None
    torch_dtype: str | None
    eos_token_ids: frozenset[int]

    @classmethod
    def from_pretrained(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: no config.json in the checkpoint directory") from None
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        architectures = raw.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: field 'architectures' is {architectures!r}; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )

        def field(name: str, kind: type = int, default: Any = ...) -> Any:
            value = raw.get(name, default)
            if value is ... or (value is None and default is ...):
                raise ModelLoadError(f"{source}: missing required field '{name}'")
            try:
                return kind(value) if value is not None else None
            except (TypeError, ValueError):
                raise ModelLoadError(f"{source}: field '{name}' = {value!r} is not a {kind.__name__}") from None

        num_heads = field("num_attention_heads")
        hidden = field("hidden_size")
        head_dim = field("head_dim", int, None) or hidden // num_heads
        num_kv_heads = field("num_key_value_heads", int, None) or num_heads
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads ({num_heads}) is not a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        rope_theta, rope_scaling = _rope(raw)
        eos = raw.get("eos_token_id")
        eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        sliding_window = raw.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window", False):
            sliding_window = None
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=field("intermediate_size"),
            num_hidden_layers=field("num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=field("vocab_size"),
            rms_norm_eps=field("rms_norm_eps", float, 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=field("max_position_embeddings", int, 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=int(sliding_window) if sliding_window else None,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=eos_ids,
        )


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Read rope settings from the classic (``rope_theta`` + ``rope_scaling``) or the
    transformers-5 (``rope_parameters``) layout."""
    params = raw.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"} or None
    if scaling is not None:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return theta, scaling
