"""Our transformers-free Tokenizer against transformers' AutoTokenizer on the same checkpoints."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models

from llmkube.serving.engine.errors import ModelLoadError
from llmkube.serving.engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "  leading spaces\n\nand   tabs\t123456 it's we'll",
    "Le café est très bon; naïve Zürich façade.",
    "日本語のテキスト 中文 한국어 😀🚀🤖 ❤️",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # squared\n",
    "",
]


@pytest.fixture(scope="module")
def tok(qwen2_tiny: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(qwen2_tiny)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # transformers picks Qwen2Tokenizer vs TokenizersBackend
def test_matches_transformers(tiny_checkpoint: Callable[..., Path], arch: str) -> None:
    path = tiny_checkpoint(arch)
    ours = Tokenizer.from_pretrained(path)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert ours.vocab_size == len(hf)
    assert ours.eos_token == hf.eos_token == "<|im_end|>"
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.bos_token is None and ours.bos_token_id is None and hf.bos_token is None
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.all_special_ids == frozenset(hf.all_special_ids)
    assert ours.chat_template == hf.chat_template
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_special_tokens(tok: Tokenizer) -> None:
    im_end, eot, im_start = (tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<|im_start|>"))
    assert tok.eos_token_ids == frozenset({im_end, eot})  # tokenizer eos + generation_config list
    assert tok.all_special_ids == frozenset({im_end, eot, im_start})
    assert tok.model_max_length == 2048
    assert tok.add_bos_token is False
    ids = tok.encode("<tool_call>x</tool_call><|im_end|>")
    assert tok.decode(ids) == "<tool_call>x</tool_call>"  # added non-special tokens survive skipping
    assert tok.decode(ids, skip_special_tokens=False) == "<tool_call>x</tool_call><|im_end|>"


def test_token_bytes_concatenate_to_text(tok: Tokenizer) -> None:
    split_chars = 0
    for text in TEXTS:
        ids = tok.encode(text)
        joined = b"".join(tok.token_bytes(i) for i in ids)
        assert joined == tok.decode(ids, skip_special_tokens=False).encode("utf-8")
        for i in ids:
            try:
                tok.token_bytes(i).decode("utf-8")
            except UnicodeDecodeError:
                split_chars += 1
    assert split_chars > 0, "expected some tokens holding part of a multi-byte character"
    assert tok.token_bytes(tok.token_to_id("Ġc") or -1) == b" c"
    assert tok.token_bytes(tok.token_to_id("<|im_end|>") or -1) == b"<|im_end|>"
    # Every single-byte token maps to its own byte.
    assert {tok.token_bytes(i) for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1} == {
        bytes([b]) for b in range(256)
    }


def test_padding_ids_beyond_tokenizer(tok: Tokenizer) -> None:
    pad_id = tok.vocab_size + 3  # the model's vocab is padded to a multiple of 64
    assert tok.convert_ids_to_tokens([pad_id]) == [""]
    assert tok.token_bytes(pad_id) == b""
    hello = tok.encode("Hello")
    assert tok.decode([*hello, pad_id]) == "Hello"


def test_config_variants(qwen2_tiny: Path, tmp_path: Path) -> None:
    path = _copy(qwen2_tiny, tmp_path / "ckpt")
    _edit_json(path / "tokenizer_config.json", add_bos_token=True, bos_token="<|endoftext|>")
    _edit_json(path / "generation_config.json", eos_token_id=7)
    _edit_json(path / "config.json", eos_token_id=[8, 9])
    tok = Tokenizer.from_pretrained(path)
    bos = tok.token_to_id("<|endoftext|>")
    assert tok.bos_token_id == bos and tok.add_bos_token
    assert tok.encode("hi")[0] == bos and tok.encode("hi")[1:] == tok.encode("hi", add_special_tokens=False)
    assert tok.encode("<|endoftext|>hi").count(bos) == 1  # never a doubled BOS
    assert tok.eos_token_ids == frozenset({tok.eos_token_id, 7, 8, 9})


def test_chat_template_sources(qwen2_tiny: Path, tmp_path: Path) -> None:
    path = _copy(qwen2_tiny, tmp_path / "ckpt")
    _edit_json(
        path / "tokenizer_config.json",
        chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    )
    assert Tokenizer.from_pretrained(path).chat_template == "D"
    (path / "chat_template.jinja").write_text("J{{ messages }}")
    assert Tokenizer.from_pretrained(path).chat_template == "J{{ messages }}"
    (path / "chat_template.jinja").unlink()
    _edit_json(path / "tokenizer_config.json", chat_template=None)
    assert Tokenizer.from_pretrained(path).chat_template is None


def test_minimal_directory(qwen2_tiny: Path, tmp_path: Path) -> None:
    """Only tokenizer.json is required; the other files just add settings."""
    (tmp_path / "tokenizer.json").write_bytes((qwen2_tiny / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token is None and tok.eos_token_ids == frozenset() and tok.chat_template is None
    assert tok.all_special_ids == frozenset(tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    assert tok.decode(tok.encode("naïve")) == "naïve"


def test_errors_name_the_file(qwen2_tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_pretrained(tmp_path)
    path = _copy(qwen2_tiny, tmp_path / "ckpt")
    (path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json"):
        Tokenizer.from_pretrained(path)
    (path / "tokenizer_config.json").write_text("{}")
    (path / "tokenizer.json").write_text('{"model": 42}')
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_pretrained(path)


def test_sentencepiece_byte_fallback_bytes(tmp_path: Path) -> None:
    """Llama-2-style vocabularies: ``▁`` is a space and ``<0xNN>`` tokens are raw bytes."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁hello": 257, "▁": 258, "h": 259}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.token_bytes(257) == b" hello"
    assert tok.token_bytes(1 + 0xE6) == b"\xe6"
    assert b"".join(tok.token_bytes(i) for i in (1 + 0xE6, 1 + 0x97, 1 + 0xA5)).decode() == "日"


def test_import_does_not_pull_transformers() -> None:
    code = (
        "import sys; import llmkube.serving.engine.tokenizer; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
