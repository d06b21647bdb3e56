"""Deterministic random-weight Hugging Face checkpoints for tests, the demo and benchmarks.

``write_checkpoint`` writes a directory that ``transformers`` loads as-is
(``config.json``, ``generation_config.json``, safetensors weights, optionally
sharded with an index, and a byte-level BPE tokenizer with a ChatML template
that supports tools). The weights are random but scaled so that the logits have
real spread: greedy decoding depends on the prompt instead of repeating one
token, which makes token-for-token comparisons against ``transformers``
meaningful.

Everything is a pure function of the arguments: the same call writes
byte-identical files.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from llmkube.serving.testing._corpus import CORPUS
from llmkube.serving.testing.chat_template import CHATML_TOOLS_TEMPLATE

# Bump whenever the generated files change (corpus, scales, config keys): it
# names the demo checkpoint's cache directory.
GENERATOR_VERSION = "1"

ARCHITECTURES: tuple[str, ...] = ("llama", "llama3", "mistral", "qwen2", "qwen3")

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
# Added but not special: they survive ``decode(skip_special_tokens=True)`` so a
# tool-call parser sees them in the text.
ADDED_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>")

BPE_VOCAB_SIZE = 1000  # base vocabulary (256 bytes + merges), before the added tokens
VOCAB_MULTIPLE = 64  # the model's embedding rows are padded up to a multiple of this
MODEL_MAX_LENGTH = 2048
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class Size:
    """Transformer dimensions of one named size."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


SIZES: dict[str, Size] = {
    "tiny": Size(64, 2, 4, 2, 128),
    "demo": Size(256, 4, 8, 2, 512),
    "small": Size(1024, 8, 16, 4, 2816),
}


@dataclass(frozen=True)
class _ArchSpec:
    hf_class: str
    model_type: str
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool = False
    qk_norm: bool = False
    explicit_head_dim: bool = False
    llama3_rope: bool = False


_ARCH_SPECS: dict[str, _ArchSpec] = {
    "llama": _ArchSpec("LlamaForCausalLM", "llama", 10000.0, 1e-5),
    "llama3": _ArchSpec("LlamaForCausalLM", "llama", 500000.0, 1e-5, llama3_rope=True),
    "mistral": _ArchSpec("MistralForCausalLM", "mistral", 1000000.0, 1e-5),
    "qwen2": _ArchSpec("Qwen2ForCausalLM", "qwen2", 1000000.0, 1e-6, qkv_bias=True),
    "qwen3": _ArchSpec("Qwen3ForCausalLM", "qwen3", 1000000.0, 1e-6, qk_norm=True, explicit_head_dim=True),
}


# --------------------------------------------------------------------------- tokenizer


@functools.cache
def _tokenizer_json() -> str:
    """Train the byte-level BPE once per process and return its serialized JSON."""
    tok = Tokenizer(models.BPE())
    # Exactly Qwen2's pipeline: transformers 5 rebuilds a ``Qwen2Tokenizer`` for
    # model_type qwen2 with this normalizer and pre-tokenizer whatever
    # tokenizer.json says, so any other choice would make HF disagree with the file.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tok.to_str(pretty=True)


def build_tokenizer() -> Tokenizer:
    """The ``tokenizers.Tokenizer`` that every generated checkpoint ships."""
    return Tokenizer.from_str(_tokenizer_json())


def _tokenizer_files(tok: Tokenizer) -> dict[str, Any]:
    """tokenizer_config.json and special_tokens_map.json contents."""
    added: dict[str, Any] = {}
    for token in (*SPECIAL_TOKENS, *ADDED_TOKENS):
        tid = tok.token_to_id(token)
        added[str(tid)] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in SPECIAL_TOKENS,
        }
    tokenizer_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHATML_TOOLS_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    special_tokens_map = {
        "additional_special_tokens": [IM_START, IM_END],
        "eos_token": {"content": IM_END, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False},
        "pad_token": {"content": ENDOFTEXT, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False},
    }
    return {"tokenizer_config.json": tokenizer_config, "special_tokens_map.json": special_tokens_map}


# --------------------------------------------------------------------------- config


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _head_dim(spec: _ArchSpec, size: Size) -> int:
    base = size.hidden_size // size.num_attention_heads
    # Qwen3 checkpoints have num_heads * head_dim != hidden_size (0.6B: 16 * 128 vs 1024);
    # reproduce that so model code cannot silently assume hidden_size // num_heads.
    return 2 * base if spec.explicit_head_dim else base


def _config(
    arch: str,
    size: Size,
    vocab_size: int,
    *,
    dtype: str,
    tie_word_embeddings: bool,
    max_position_embeddings: int,
    bos_id: int,
    eos_id: int,
) -> dict[str, Any]:
    spec = _ARCH_SPECS[arch]
    cfg: dict[str, Any] = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "hidden_act": "silu",
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_hidden_layers,
        "num_attention_heads": size.num_attention_heads,
        "num_key_value_heads": size.num_key_value_heads,
        "vocab_size": vocab_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
    }
    if spec.model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if spec.llama3_rope:
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # Short on purpose: with 256 the scaled band covers positions tests reach.
            "original_max_position_embeddings": 256,
        }
    if arch == "mistral":
        cfg["sliding_window"] = None
    if arch in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=size.num_hidden_layers)
    if arch == "qwen3":
        cfg.update(attention_bias=False, head_dim=_head_dim(spec, size))
    return cfg


# --------------------------------------------------------------------------- weights


# The final norm leaves unit-RMS states, so lm_head rows of std GAIN/sqrt(hidden)
# give logits of std ~GAIN: peaked enough that greedy decoding is robust to
# float noise, spread enough that the continuation follows the prompt.
LM_HEAD_GAIN = 3.0


def _randn(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """Normal(0, std) values that depend only on (seed, tensor name, shape).

    A generator per tensor keeps each tensor independent of the others: tying
    the embeddings or adding a bias leaves every other tensor unchanged.
    ``name`` is prefixed with the architecture by the caller so that two
    architectures never share weights (which could hide a wrong code path).
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen, dtype=torch.float32).mul_(std)


def _norm_weight(seed: int, name: str, dim: int) -> torch.Tensor:
    return _randn(seed, name, (dim,), 0.1).add_(1.0)


def _linear(seed: int, name: str, out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
    # std 1/sqrt(fan_in) keeps activations at unit scale through the stack, so
    # every layer changes the residual stream instead of vanishing in it.
    return _randn(seed, name, (out_features, in_features), gain / math.sqrt(in_features))


def _weights(
    arch: str, size: Size, vocab_size: int, tok_vocab: int, *, seed: int, tie: bool
) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint in float32, in HF naming and order.

    Rows ``tok_vocab..vocab_size`` of the embedding and lm_head (padding no
    tokenizer id maps to) are zero, as untrained rows are in practice near
    zero: their logit is 0, far below the top logits, so greedy decoding never
    picks them (sampling still could, rarely).
    """
    spec = _ARCH_SPECS[arch]
    seed = seed * 1_000_003 + zlib.crc32(arch.encode())
    h, inter = size.hidden_size, size.intermediate_size
    hd = _head_dim(spec, size)
    q_out, kv_out = size.num_attention_heads * hd, size.num_key_value_heads * hd
    # Untied: unit-scale embeddings, on a par with what each layer adds to the
    # residual stream. Tied: the embedding is also the lm_head, so it gets the
    # lm_head's scale (same random draw, scaled) instead of logits of std sqrt(hidden).
    embed_std = LM_HEAD_GAIN / math.sqrt(h) if tie else 1.0
    embed = _randn(seed, "model.embed_tokens.weight", (vocab_size, h), embed_std)
    embed[tok_vocab:] = 0.0
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for i in range(size.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = _norm_weight(seed, p + "input_layernorm.weight", h)
        w[p + "self_attn.q_proj.weight"] = _linear(seed, p + "self_attn.q_proj.weight", q_out, h)
        w[p + "self_attn.k_proj.weight"] = _linear(seed, p + "self_attn.k_proj.weight", kv_out, h)
        w[p + "self_attn.v_proj.weight"] = _linear(seed, p + "self_attn.v_proj.weight", kv_out, h)
        if spec.qkv_bias:
            w[p + "self_attn.q_proj.bias"] = _randn(seed, p + "self_attn.q_proj.bias", (q_out,), 0.1)
            w[p + "self_attn.k_proj.bias"] = _randn(seed, p + "self_attn.k_proj.bias", (kv_out,), 0.1)
            w[p + "self_attn.v_proj.bias"] = _randn(seed, p + "self_attn.v_proj.bias", (kv_out,), 0.1)
        if spec.qk_norm:
            w[p + "self_attn.q_norm.weight"] = _norm_weight(seed, p + "self_attn.q_norm.weight", hd)
            w[p + "self_attn.k_norm.weight"] = _norm_weight(seed, p + "self_attn.k_norm.weight", hd)
        w[p + "self_attn.o_proj.weight"] = _linear(seed, p + "self_attn.o_proj.weight", h, q_out)
        w[p + "post_attention_layernorm.weight"] = _norm_weight(seed, p + "post_attention_layernorm.weight", h)
        w[p + "mlp.gate_proj.weight"] = _linear(seed, p + "mlp.gate_proj.weight", inter, h)
        w[p + "mlp.up_proj.weight"] = _linear(seed, p + "mlp.up_proj.weight", inter, h)
        w[p + "mlp.down_proj.weight"] = _linear(seed, p + "mlp.down_proj.weight", h, inter)
    w["model.norm.weight"] = _norm_weight(seed, "model.norm.weight", h)
    if not tie:
        lm_head = _linear(seed, "lm_head.weight", vocab_size, h, gain=LM_HEAD_GAIN)
        lm_head[tok_vocab:] = 0.0
        w["lm_head.weight"] = lm_head
    return w


def _shard_groups(names: list[str], tensors: dict[str, torch.Tensor], num_shards: int) -> list[list[str]]:
    """Split names (in order) into ``num_shards`` contiguous groups of similar byte size."""
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    total = sum(sizes)
    groups: list[list[str]] = [[] for _ in range(num_shards)]
    acc = 0
    for name, nbytes in zip(names, sizes, strict=True):
        # Assign by the tensor's midpoint so boundaries fall near total * k / num_shards.
        idx = min(num_shards - 1, int((acc + nbytes / 2) * num_shards / total))
        groups[idx].append(name)
        acc += nbytes
    # Every shard must hold at least one tensor (a huge tensor can swallow a
    # neighbour's share): take one from the largest group.
    for k in range(num_shards):
        if not groups[k]:
            donor = max(range(num_shards), key=lambda j: len(groups[j]))
            if donor < k:
                groups[k].insert(0, groups[donor].pop())
            else:
                groups[k].append(groups[donor].pop(0))
    return groups


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    # transformers refuses safetensors files without format metadata.
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates 0600 files; checkpoints are shared read-only data


def _write_weights(
    out: Path, tensors: dict[str, torch.Tensor], *, sharded: bool, num_shards: int
) -> None:
    if not sharded:
        _save(tensors, out / "model.safetensors")
        return
    if num_shards < 2:
        raise ValueError(f"sharded checkpoints need num_shards >= 2, got {num_shards}")
    names = list(tensors)
    if num_shards > len(names):
        raise ValueError(f"cannot split {len(names)} tensors into {num_shards} shards")
    weight_map: dict[str, str] = {}
    total_size = 0
    for k, group in enumerate(_shard_groups(names, tensors, num_shards), start=1):
        filename = f"model-{k:05d}-of-{num_shards:05d}.safetensors"
        shard = {n: tensors[n] for n in group}
        _save(shard, out / filename)
        for n, t in shard.items():
            weight_map[n] = filename
            total_size += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    _write_json(out / "model.safetensors.index.json", index)


# --------------------------------------------------------------------------- public API


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_checkpoint(
    path: str | os.PathLike[str],
    arch: str = "qwen2",
    size: str = "tiny",
    *,
    seed: int = 0,
    dtype: str = "float32",
    sharded: bool = False,
    num_shards: int = 2,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 2048,
) -> Path:
    """Write a random-weight Hugging Face checkpoint into ``path`` (created if needed) and return it.

    ``arch`` is one of ``ARCHITECTURES``, ``size`` one of ``SIZES``; ``dtype``
    ("float32", "bfloat16", "float16") is both the stored tensor dtype and the
    config's ``torch_dtype``. With ``sharded=True`` the weights are split over
    ``num_shards`` files plus ``model.safetensors.index.json``. Files already in
    ``path`` with the same names are overwritten; other files are left alone.
    """
    if arch not in _ARCH_SPECS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHITECTURES}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {tuple(SIZES)}")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {tuple(_DTYPES)}")
    dims = SIZES[size]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer()
    tok_vocab = tok.get_vocab_size(with_added_tokens=True)
    vocab_size = _round_up(tok_vocab, VOCAB_MULTIPLE)
    bos_id, eos_id = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)

    config = _config(
        arch, dims, vocab_size, dtype=dtype, tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings, bos_id=bos_id, eos_id=eos_id,
    )
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": bos_id,
        "eos_token_id": [eos_id, tok.token_to_id(ENDOFTEXT)],
        "pad_token_id": tok.token_to_id(ENDOFTEXT),
    })
    (out / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    for filename, content in _tokenizer_files(tok).items():
        _write_json(out / filename, content)

    tensors = _weights(arch, dims, vocab_size, tok_vocab, seed=seed, tie=tie_word_embeddings)
    target = _DTYPES[dtype]
    tensors = {n: t.to(target).contiguous() for n, t in tensors.items()}
    _write_weights(out, tensors, sharded=sharded, num_shards=num_shards)
    return out


DEMO_ARCH = "qwen2"
DEMO_SIZE = "demo"
_COMPLETE_MARKER = ".llmkube-complete"


def default_cache_dir() -> Path:
    """``$LLMKUBE_CACHE_DIR``, else ``$XDG_CACHE_HOME/llmkube``, else ``~/.cache/llmkube``."""
    env = os.environ.get("LLMKUBE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "llmkube"


def demo_checkpoint(cache_dir: Path | None = None) -> Path:
    """Return the demo checkpoint's directory, generating it on first use.

    The checkpoint lives at ``<cache_dir>/demo-<GENERATOR_VERSION>`` (``cache_dir``
    defaults to ``default_cache_dir()``). It is written into a temporary sibling
    and renamed into place, so concurrent callers and interrupted runs never
    see a half-written directory.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"demo-{GENERATOR_VERSION}"
    if (final / _COMPLETE_MARKER).exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".demo-{GENERATOR_VERSION}-", dir=root))
    try:
        write_checkpoint(tmp, DEMO_ARCH, DEMO_SIZE, seed=0)
        (tmp / _COMPLETE_MARKER).write_text(GENERATOR_VERSION + "\n", encoding="utf-8")
        if final.exists():  # stale partial dir from an older crash (no marker): replace it
            shutil.rmtree(final, ignore_errors=True)
        try:
            tmp.rename(final)
        except OSError:
            # Another process won the race; its copy is identical.
            if not (final / _COMPLETE_MARKER).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def checkpoint_files(path: Path) -> list[Path]:
    """All regular files of a checkpoint directory, sorted (for hashing and comparisons)."""
    return sorted(p for p in Path(path).iterdir() if p.is_file())
