"""Logprob builders with the real checkpoint tokenizer: token strings, offsets and bytes line up."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from llmkube.serving.engine.outputs import TokenLogprob
from llmkube.serving.engine.tokenizer import Tokenizer
from llmkube.serving.openai.logprobs import (
    MIN_LOGPROB,
    CompletionLogprobs,
    TokenTextSplitter,
    TokenVocab,
    chat_logprob_entries,
    chat_logprobs,
    clean_logprob,
)

TEXT = "Héllo wörld, 世界! 🙂 done"


@pytest.fixture(scope="module")
def tokenizer(qwen2_tiny: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(qwen2_tiny)


def fake_logprobs(ids: list[int], k: int = 2) -> list[TokenLogprob]:
    return [TokenLogprob(t, -0.5 - i, 1, [(t, -0.5 - i), ((t + 1) % 900, -3.0)][:k]) for i, t in enumerate(ids)]


def test_splitter_pieces_concatenate_to_the_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT) // 4  # several multi-byte characters span tokens
    splitter = TokenTextSplitter(tokenizer, skip_special_tokens=True)
    pieces = [splitter.push(t) for t in ids]
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # a token ending inside a character yields "" and the next one the character


def test_completion_logprobs_offsets_and_top(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    builder = CompletionLogprobs(TokenVocab(tokenizer), TokenTextSplitter(tokenizer, skip_special_tokens=True))
    first = builder.add(ids[:3], [None, *fake_logprobs(ids[1:3])])
    assert first["token_logprobs"][0] is None and first["top_logprobs"][0] is None
    builder.add(ids[3:], fake_logprobs(ids[3:]))
    total = builder.total
    assert "".join(total["tokens"]) == TEXT
    assert total["text_offset"] == [len("".join(total["tokens"][:i])) for i in range(len(ids))]
    for token, chosen, top in zip(total["tokens"][1:], total["token_logprobs"][1:], total["top_logprobs"][1:],
                                  strict=True):
        assert chosen in top.values() and len(top) <= 3
        if token:
            assert top[token] == chosen
    builder.switch_splitter(TokenTextSplitter(tokenizer, skip_special_tokens=True), offset=100)
    assert builder.add(ids[:1], fake_logprobs(ids[:1]))["text_offset"] == [100]


def test_chat_entries_carry_exact_bytes(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    entries = chat_logprob_entries(TokenVocab(tokenizer), ids, fake_logprobs(ids))
    assert bytes(b for e in entries for b in e["bytes"]) == TEXT.encode("utf-8")
    for entry, token_id in zip(entries, ids, strict=True):
        assert entry["bytes"] == list(tokenizer.token_bytes(token_id))
        assert entry["top_logprobs"][0] == {"token": entry["token"], "logprob": entry["logprob"],
                                            "bytes": entry["bytes"]}
        assert set(entry["top_logprobs"][1]) == {"token", "logprob", "bytes"}
    assert chat_logprobs(entries) == {"content": entries, "refusal": None}


def test_special_tokens_have_their_text_as_bytes(tokenizer: Tokenizer) -> None:
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert im_end is not None
    (entry,) = chat_logprob_entries(TokenVocab(tokenizer), [im_end], fake_logprobs([im_end], k=1))
    assert entry["token"] == "<|im_end|>" and bytes(entry["bytes"]) == b"<|im_end|>"


def test_clean_logprob_keeps_json_finite() -> None:
    assert clean_logprob(-math.inf) == MIN_LOGPROB
    assert clean_logprob(math.nan) == MIN_LOGPROB
    assert clean_logprob(-1.25) == -1.25
