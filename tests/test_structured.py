"""Structured output: xgrammar constraints against the tiny checkpoints' real tokenizer.

Random logits stand in for a random-weight model: every step is greedy under the
grammar's bitmask, through the real Sampler, until the grammar accepts EOS.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from llmkube.serving.engine.errors import InvalidRequestError
from llmkube.serving.engine.sampler import Sampler
from llmkube.serving.engine.sampling_params import SamplingParams
from llmkube.serving.engine.structured import (
    GrammarCompilerCache,
    GrammarState,
    allocate_bitmask,
    detect_vocab_metadata,
)
from llmkube.serving.engine.tokenizer import Tokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "color", "tags"],
}


@dataclass
class Row:
    params: SamplingParams
    grammar: GrammarState | None
    prompt_token_ids: list[int] = field(default_factory=lambda: [1])
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


@pytest.fixture(scope="module")
def tokenizer(qwen2_tiny: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(qwen2_tiny)


@pytest.fixture(scope="module")
def vocab_size(qwen2_tiny: Path) -> int:
    return int(json.loads((qwen2_tiny / "config.json").read_text())["vocab_size"])


@pytest.fixture(scope="module")
def cache(tokenizer: Tokenizer, vocab_size: int) -> GrammarCompilerCache:
    return GrammarCompilerCache(tokenizer, vocab_size)


def allowed(state: GrammarState, vocab_size: int) -> set[int]:
    bitmask = allocate_bitmask(1, vocab_size)
    state.fill_bitmask(bitmask, 0)
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()[:vocab_size]).flatten().tolist())


def generate(
    cache: GrammarCompilerCache, tokenizer: Tokenizer, params: SamplingParams, seed: int, max_steps: int = 4000
) -> str:
    """Greedy decoding of random logits under the constraint, as the engine drives it."""
    compiled = cache.compile(params)
    assert compiled is not None
    state = cache.new_state(compiled)
    sampler = Sampler(cache.vocab_size, tokenizer.eos_token_ids)
    row = Row(SamplingParams(temperature=0.0), state)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(max_steps):
        token = sampler(torch.randn(1, cache.vocab_size, generator=gen), [row]).token_ids[0]
        assert state.accept(token), f"sampled token {token} the grammar rejects"
        if token in tokenizer.eos_token_ids:
            assert state.is_terminated()
            return tokenizer.decode(row.output_token_ids, skip_special_tokens=True)
        row.output_token_ids.append(token)
    raise AssertionError(f"no EOS after {max_steps} steps: {tokenizer.decode(row.output_token_ids)!r}")


def skeleton(text: str) -> str:
    """The JSON text with string literals emptied: what the whitespace rule applies to."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_validates(cache: GrammarCompilerCache, tokenizer: Tokenizer, seed: int) -> None:
    text = generate(cache, tokenizer, SamplingParams(json_schema=SCHEMA), seed)
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    assert list(value) == ["name", "age", "color", "tags"]  # the schema's order, not sorted
    # Compact: no whitespace but the fixed separators ", " and ": ".
    assert not re.search(r"\s", skeleton(text).replace(", ", ",").replace(": ", ":")), text


def test_schema_as_string_and_strict_mode(cache: GrammarCompilerCache, tokenizer: Tokenizer) -> None:
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = SamplingParams(json_schema=json.dumps(open_schema))
    text = generate(cache, tokenizer, params, seed=0)
    jsonschema.validate(json.loads(text), open_schema)

    def accepts(document: str) -> bool:
        compiled = cache.compile(params)
        assert compiled is not None
        state = cache.new_state(compiled)
        return all(state.accept(t) for t in tokenizer.encode(document, add_special_tokens=False))

    assert accepts('{"a": 12}')
    assert accepts("{}")
    assert not accepts('{"b": 1}')  # strict: no properties beyond the schema's


@pytest.mark.parametrize("seed", range(3))
def test_json_object_output_is_an_object(cache: GrammarCompilerCache, tokenizer: Tokenizer, seed: int) -> None:
    text = generate(cache, tokenizer, SamplingParams(json_object=True), seed)
    assert isinstance(json.loads(text), dict)
    assert not re.search(r"\s", skeleton(text).replace(", ", ",").replace(": ", ":")), text


@pytest.mark.parametrize("seed", range(3))
def test_regex_and_grammar_outputs_match(cache: GrammarCompilerCache, tokenizer: Tokenizer, seed: int) -> None:
    pattern = r"[a-z]{3}-\d{2,4}"
    assert re.fullmatch(pattern, generate(cache, tokenizer, SamplingParams(regex=pattern), seed))
    ebnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
    text = generate(cache, tokenizer, SamplingParams(grammar=ebnf), seed)
    assert re.fullmatch(r"yes|no|maybe [0-9]", text)


# --------------------------------------------------------------------------- the bitmask


def test_no_free_whitespace_and_no_special_tokens(
    cache: GrammarCompilerCache, tokenizer: Tokenizer, vocab_size: int
) -> None:
    compiled = cache.compile(SamplingParams(json_object=True))
    assert compiled is not None
    state = cache.new_state(compiled)
    whitespace = {t for t in range(tokenizer.vocab_size)
                  if tokenizer.token_bytes(t) and not tokenizer.token_bytes(t).strip()}
    assert len(whitespace) > 3
    assert not allowed(state, vocab_size) & whitespace  # nothing before "{"
    for token in tokenizer.encode('{"key', add_special_tokens=False):
        assert state.accept(token)
    inside_string = allowed(state, vocab_size)
    assert len(inside_string) > 500
    assert not inside_string & tokenizer.all_special_ids  # <|im_start|> would vanish from the text
    assert not inside_string & set(range(tokenizer.vocab_size, vocab_size))  # padded embedding rows
    for token in tokenizer.encode('": 1', add_special_tokens=False):
        assert state.accept(token)
    after_value = allowed(state, vocab_size)
    assert not after_value & whitespace
    assert {tokenizer.token_to_id(","), tokenizer.token_to_id("}")} <= after_value


def test_complete_document_forces_eos(cache: GrammarCompilerCache, tokenizer: Tokenizer, vocab_size: int) -> None:
    compiled = cache.compile(SamplingParams(regex="ab"))
    assert compiled is not None
    state = cache.new_state(compiled)
    a, b = tokenizer.token_to_id("a"), tokenizer.token_to_id("b")
    assert a is not None and b is not None
    assert not state.accept(b)  # rejected, state unchanged
    assert allowed(state, vocab_size) & {a, b} == {a}
    assert state.accept(a) and state.accept(b)
    assert allowed(state, vocab_size) == set(tokenizer.eos_token_ids)
    assert not state.is_terminated()
    eos = min(tokenizer.eos_token_ids)
    assert state.accept(eos) and state.is_terminated()
    # After termination (the engine may go on with ignore_eos) only EOS stays allowed.
    assert allowed(state, vocab_size) == set(tokenizer.eos_token_ids)
    assert not state.accept(a)
    assert state.accept(eos)


# --------------------------------------------------------------------------- compiling


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(json_schema={"type": "strin"}),
        SamplingParams(json_schema="{not json"),
        SamplingParams(json_schema="[1, 2]"),
        SamplingParams(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
        SamplingParams(regex="a(b"),
        SamplingParams(grammar="root ::= undefined_rule"),
    ],
    ids=["bad-type", "not-json", "not-an-object", "bad-ref", "regex", "ebnf"],
)
def test_invalid_constraints_are_request_errors(cache: GrammarCompilerCache, params: SamplingParams) -> None:
    with pytest.raises(InvalidRequestError) as info:
        cache.compile(params)
    assert info.value.param == "response_format"
    assert "/project/" not in info.value.message  # xgrammar's source location is stripped


def test_cache_returns_compiled_grammars_and_evicts_lru(tokenizer: Tokenizer, vocab_size: int) -> None:
    cache = GrammarCompilerCache(tokenizer, vocab_size, max_entries=2)
    assert cache.compile(SamplingParams()) is None
    first = cache.compile(SamplingParams(regex="a+"))
    assert isinstance(first, xgr.CompiledGrammar)
    assert cache.compile(SamplingParams(regex="a+")) is first
    same_schema = cache.compile(SamplingParams(json_schema=SCHEMA))
    assert cache.compile(SamplingParams(json_schema=json.dumps(SCHEMA))) is same_schema
    cache.compile(SamplingParams(regex="a+"))  # refresh: the schema is now the oldest
    cache.compile(SamplingParams(json_object=True))
    assert len(cache) == 2
    assert cache.compile(SamplingParams(regex="a+")) is first
    assert cache.compile(SamplingParams(json_schema=SCHEMA)) is not same_schema


# --------------------------------------------------------------------------- vocabulary metadata


def _sentencepiece_style(metaspace: bool) -> RawTokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({"▁a": 259, "b": 260})
    tok = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    if metaspace:  # Mistral / Llama 2 as converted by recent transformers
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    else:  # Llama 2 as originally converted
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
        ])
    return tok


def _raw_vocab() -> RawTokenizer:
    tok = RawTokenizer(models.WordLevel(vocab={"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (None, (xgr.VocabType.BYTE_LEVEL, False)),
        (lambda: _sentencepiece_style(metaspace=False), (xgr.VocabType.BYTE_FALLBACK, True)),
        (lambda: _sentencepiece_style(metaspace=True), (xgr.VocabType.BYTE_FALLBACK, True)),
        (_raw_vocab, (xgr.VocabType.RAW, False)),
    ],
    ids=["byte-level", "byte-fallback-prepend", "byte-fallback-metaspace", "raw"],
)
def test_vocab_metadata_detection(tokenizer: Tokenizer, make: Any, expected: tuple[Any, bool]) -> None:
    backend = tokenizer.backend if make is None else make()
    detected = detect_vocab_metadata(json.loads(backend.to_str()))
    assert detected == expected
    xgrammar_detector = getattr(xgr.TokenizerInfo, "_detect_metadata_from_hf", None)
    if xgrammar_detector is not None:  # agree with what xgrammar's from_huggingface would use
        theirs = xgrammar_detector(backend.to_str())
        assert (theirs["vocab_type"], theirs["add_prefix_space"]) == expected
