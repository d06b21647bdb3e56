"""The random-weight checkpoint generator: files, determinism, and that transformers loads them."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jinja2
import pytest
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors import safe_open
from safetensors.torch import load_file

from llmkube.serving.testing import ARCHITECTURES, SIZES, demo_checkpoint, write_checkpoint
from llmkube.serving.testing.checkpoint import (
    GENERATOR_VERSION,
    LM_HEAD_GAIN,
    build_tokenizer,
    checkpoint_files,
)

transformers = pytest.importorskip("transformers")

HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "llama3": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
PROMPTS = ["Hello, how are you?", "The capital of France is", "def fibonacci(n):", '{"name": "get_weather"']


def _hash_dir(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in checkpoint_files(path)}


def _all_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _expected_names(arch: str, layers: int, tied: bool) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not tied:
        names.add("lm_head.weight")
    for i in range(layers):
        p = f"model.layers.{i}."
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if arch == "qwen2":
            names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
        if arch == "qwen3":
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names


# --------------------------------------------------------------------------- files


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_config_and_tensors(tiny_checkpoint: Callable[..., Path], arch: str) -> None:
    path = tiny_checkpoint(arch)
    cfg = json.loads((path / "config.json").read_text())
    size = SIZES["tiny"]
    assert cfg["architectures"] == [HF_CLASSES[arch]]
    assert cfg["model_type"] == {"llama3": "llama"}.get(arch, arch)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (64, 2, 4)
    assert (cfg["num_key_value_heads"], cfg["intermediate_size"]) == (2, 128)
    assert cfg["max_position_embeddings"] == 2048
    assert cfg["torch_dtype"] == "float32" and cfg["tie_word_embeddings"] is False
    tok_size = build_tokenizer().get_vocab_size(with_added_tokens=True)
    assert cfg["vocab_size"] % 64 == 0 and cfg["vocab_size"] > tok_size
    if arch == "llama3":
        assert cfg["rope_scaling"]["rope_type"] == "llama3"
        assert cfg["rope_scaling"]["original_max_position_embeddings"] == 256
    else:
        assert cfg["rope_scaling"] is None
    if arch == "mistral":
        assert "sliding_window" in cfg and cfg["sliding_window"] is None
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    if arch == "qwen3":
        assert cfg["head_dim"] == 32  # != hidden_size / num_heads, as in real Qwen3

    gen = json.loads((path / "generation_config.json").read_text())
    tok = build_tokenizer()
    assert gen["eos_token_id"] == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    assert cfg["eos_token_id"] == tok.token_to_id("<|im_end|>")

    tensors = _all_tensors(path)
    assert set(tensors) == _expected_names(arch, size.num_hidden_layers, tied=False)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert tensors["model.embed_tokens.weight"].shape == (cfg["vocab_size"], 64)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * head_dim, 64)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (2 * head_dim, 64)
    assert tensors["model.layers.1.mlp.down_proj.weight"].shape == (64, 128)
    # Rows past the tokenizer's vocabulary are padding: zero, so never the argmax.
    assert tensors["lm_head.weight"][tok_size:].abs().sum() == 0
    assert tensors["lm_head.weight"][:tok_size].abs().min(dim=1).values.ne(0).any()
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_tied_and_bfloat16(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("qwen2", tie_word_embeddings=True, dtype="bfloat16")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "bfloat16"
    tensors = _all_tensors(path)
    assert "lm_head.weight" not in tensors
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    # Per-tensor seeding: tying or casting changes nothing else; the tied
    # embedding is the same draw at the lm_head's scale.
    ref = _all_tensors(tiny_checkpoint("qwen2"))
    for name, t in tensors.items():
        expected = ref[name] * (LM_HEAD_GAIN / 8.0) if name == "model.embed_tokens.weight" else ref[name]
        torch.testing.assert_close(t, expected.to(torch.bfloat16), rtol=0, atol=0)


def test_tokenizer_files(qwen2_tiny: Path) -> None:
    tok = build_tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    assert 900 <= vocab <= 1100
    added = tok.get_added_tokens_decoder()
    special = {t.content for t in added.values() if t.special}
    plain = {t.content for t in added.values() if not t.special}
    assert special == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    assert plain == {"<tool_call>", "</tool_call>"}
    # Multi-byte characters exist that are split over several tokens.
    enc = tok.encode("日本語 😀 café")
    assert tok.decode(enc.ids) == "日本語 😀 café"
    assert len(enc.ids) > 3  # more tokens than words
    assert any("\ufffd" in tok.decode([i]) for i in enc.ids)

    tc = json.loads((qwen2_tiny / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|im_end|>" and tc["bos_token"] is None and tc["pad_token"] == "<|endoftext|>"
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tc["added_tokens_decoder"][str(tok.token_to_id("<tool_call>"))]["special"] is False
    stm = json.loads((qwen2_tiny / "special_tokens_map.json").read_text())
    assert stm["eos_token"]["content"] == "<|im_end|>"


def test_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        write_checkpoint(tmp_path, "gpt2")
    with pytest.raises(ValueError, match="size"):
        write_checkpoint(tmp_path, "llama", "huge")
    with pytest.raises(ValueError, match="dtype"):
        write_checkpoint(tmp_path, "llama", dtype="int8")
    with pytest.raises(ValueError, match="num_shards"):
        write_checkpoint(tmp_path, "llama", sharded=True, num_shards=1)


# --------------------------------------------------------------------------- determinism


def test_deterministic(tmp_path: Path) -> None:
    a = _hash_dir(write_checkpoint(tmp_path / "a", "qwen3", sharded=True))
    b = _hash_dir(write_checkpoint(tmp_path / "b", "qwen3", sharded=True))
    assert a == b
    c = _hash_dir(write_checkpoint(tmp_path / "c", "qwen3", sharded=True, seed=1))
    assert c["tokenizer.json"] == a["tokenizer.json"]
    assert c["model-00001-of-00002.safetensors"] != a["model-00001-of-00002.safetensors"]


def test_deterministic_across_processes(tmp_path: Path, qwen2_tiny: Path) -> None:
    """A fresh interpreter (new hash seeds, retrained tokenizer) writes the same bytes."""
    code = (
        "import sys; from llmkube.serving.testing import write_checkpoint; "
        "write_checkpoint(sys.argv[1], 'qwen2', 'tiny')"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "fresh")], check=True, timeout=120)
    assert _hash_dir(tmp_path / "fresh") == _hash_dir(qwen2_tiny)


def test_architectures_have_distinct_weights(tiny_checkpoint: Callable[..., Path]) -> None:
    a = _all_tensors(tiny_checkpoint("llama"))["model.layers.0.self_attn.q_proj.weight"]
    b = _all_tensors(tiny_checkpoint("mistral"))["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(a, b)


# --------------------------------------------------------------------------- sharding


def test_sharded_index(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama", sharded=True, num_shards=3)
    assert not (path / "model.safetensors").exists()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(set(index["weight_map"].values())) == shards
    total = 0
    for shard in shards:
        tensors = load_file(path / shard)
        assert tensors, f"{shard} is empty"
        assert {n for n, f in index["weight_map"].items() if f == shard} == set(tensors)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == total
    single = _all_tensors(tiny_checkpoint("llama"))
    sharded = _all_tensors(path)
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[n], sharded[n]) for n in single)


# --------------------------------------------------------------------------- transformers


def _greedy(model: torch.nn.Module, tok, prompt: str, n: int) -> list[int]:
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_transformers_loads_and_generates(tiny_checkpoint: Callable[..., Path], arch: str) -> None:
    path = tiny_checkpoint(arch)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == HF_CLASSES[arch]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok_size = len(tok)
    outputs = [_greedy(model, tok, p, 8) for p in PROMPTS]
    # Logits have real spread: the continuation depends on the prompt and is not one repeated token.
    assert len({tuple(o) for o in outputs}) == len(PROMPTS)
    assert len({o[0] for o in outputs}) >= 3
    assert all(len(set(o)) >= 3 for o in outputs)
    assert all(t < tok_size for o in outputs for t in o), "greedy picked a padding row"
    with torch.no_grad():
        logits = model(tok(PROMPTS[0], return_tensors="pt").input_ids).logits[0, -1, :tok_size]
    assert 1.0 < logits.std().item() < 10.0


def test_transformers_sharded_and_tied_match(tiny_checkpoint: Callable[..., Path]) -> None:
    ids = torch.tensor([[5, 100, 200, 300, 42]])
    single = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen2"), dtype=torch.float32)
    sharded = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint("qwen2", sharded=True), dtype=torch.float32
    )
    tied = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint("qwen2", tie_word_embeddings=True), dtype=torch.float32
    )
    with torch.no_grad():
        torch.testing.assert_close(single(ids).logits, sharded(ids).logits, rtol=0, atol=0)
        assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
        assert not torch.allclose(single(ids).logits, tied(ids).logits)
        assert 1.0 < tied(ids).logits[0, -1].std().item() < 10.0
    tok = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint("qwen2"))
    assert len({tuple(_greedy(tied, tok, p, 6)) for p in PROMPTS}) == len(PROMPTS)


def test_llama3_rope_scaling_matters(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """The llama3 rope scaling changes logits well inside the lengths tests use."""
    src = tiny_checkpoint("llama3")
    plain = tmp_path / "plain"
    shutil.copytree(src, plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg["rope_scaling"] = None
    (plain / "config.json").write_text(json.dumps(cfg))
    scaled_model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    plain_model = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    assert scaled_model.config.rope_parameters["rope_type"] == "llama3"
    ids = torch.arange(1, 65).unsqueeze(0)
    with torch.no_grad():
        diff = (scaled_model(ids).logits - plain_model(ids).logits).abs().amax().item()
    assert diff > 1e-2


# --------------------------------------------------------------------------- chat template

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Zürich?"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12 °C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "10 °C"},
    {"role": "assistant", "content": "Zürich 12 °C, Bern 10 °C."},
    {"role": "user", "content": "Thanks"},
]
EXPECTED_TOOLS_PROMPT = (
    "<|im_start|>system\nYou are terse.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(WEATHER_TOOL, ensure_ascii=False)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Zürich?<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n12 °C\n</tool_response>\n"
    "<tool_response>\n10 °C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nZürich 12 °C, Bern 10 °C.<|im_end|>\n"
    "<|im_start|>user\nThanks<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _plain_jinja_render(template: str, **context: object) -> str:
    """Render the way a server without transformers would: a jinja2 sandbox plus two helpers."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment()
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(**context)


def test_chat_template_with_tools(qwen2_tiny: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(qwen2_tiny)
    rendered = tok.apply_chat_template(
        TOOL_MESSAGES, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False
    )
    assert rendered == EXPECTED_TOOLS_PROMPT
    template = json.loads((qwen2_tiny / "tokenizer_config.json").read_text())["chat_template"]
    plain = _plain_jinja_render(template, messages=TOOL_MESSAGES, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert plain == rendered


def test_chat_template_without_tools(qwen2_tiny: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(qwen2_tiny)
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == "<|im_start|>user\nHi<|im_end|>\n"
    with_system = [{"role": "system", "content": "Be nice."}, *msgs]
    assert tok.apply_chat_template(with_system, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    # The special tokens of the rendered prompt encode to single ids.
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    with pytest.raises(jinja2.TemplateError, match="Unexpected message role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


# --------------------------------------------------------------------------- demo


def test_demo_checkpoint_is_cached(tmp_path: Path) -> None:
    first = demo_checkpoint(tmp_path)
    assert first == tmp_path / f"demo-{GENERATOR_VERSION}"
    cfg = json.loads((first / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["hidden_size"] == SIZES["demo"].hidden_size
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert demo_checkpoint(tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp dirs left behind
