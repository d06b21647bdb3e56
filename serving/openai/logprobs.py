"""Logprobs in the two shapes of the OpenAI API.

* completions: ``{tokens, token_logprobs, top_logprobs, text_offset}``; ``tokens`` are the
  pieces of the returned text (they concatenate to it, so ``text_offset`` points into it,
  echoed prompt included); ``top_logprobs`` maps token strings to logprobs and always
  contains the sampled token (so up to ``logprobs + 1`` entries, as OpenAI documents).
* chat: ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}],
  refusal: null}`` with each token's exact UTF-8 bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from llmkube.serving.engine.outputs import TokenLogprob
from llmkube.serving.engine.tokenizer import Tokenizer

# OpenAI's stand-in for "very unlikely" (also keeps -inf out of the JSON).
MIN_LOGPROB = -9999.0
_CONTEXT_TOKENS = 6


def clean_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else float(value)


class TokenVocab:
    """Cached per-token strings and bytes (one instance per served tokenizer)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def entry(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            raw = self._tokenizer.token_bytes(token_id)
            cached = (raw.decode("utf-8", errors="replace"), list(raw))
            if len(self._cache) < 1 << 18:
                self._cache[token_id] = cached
        return cached

    def text(self, token_id: int) -> str:
        return self.entry(token_id)[0]


class TokenTextSplitter:
    """Splits a token stream into per-token strings that concatenate to the decoded text.

    Incremental detokenization as vLLM does it: a token that ends inside a UTF-8 character
    gets ``""`` and the character goes to the token that completes it.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool, context: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(context[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            piece = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return piece
        return ""


class CompletionLogprobs:
    """Builds the completions-shape logprobs of one choice, delta by delta."""

    def __init__(self, vocab: TokenVocab, splitter: TokenTextSplitter, *, text_start: int = 0) -> None:
        self._vocab = vocab
        self._splitter = splitter
        self._offset = text_start
        self.total: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                            "text_offset": []}

    def switch_splitter(self, splitter: TokenTextSplitter, *, offset: int) -> None:
        """Split the next tokens with ``splitter`` (generated text after an echoed prompt)."""
        self._splitter = splitter
        self._offset = offset

    def add(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None]) -> dict[str, list[Any]]:
        """Append tokens (``None`` logprob: the first prompt token); return this delta's part."""
        delta: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            piece = self._splitter.push(token_id)
            delta["tokens"].append(piece)
            delta["text_offset"].append(self._offset)
            self._offset += len(piece)
            if lp is None:
                delta["token_logprobs"].append(None)
                delta["top_logprobs"].append(None)
                continue
            delta["token_logprobs"].append(clean_logprob(lp.logprob))
            top: dict[str, float] = {}
            for alt_id, alt_lp in lp.top:
                top.setdefault(self._vocab.text(alt_id), clean_logprob(alt_lp))
            top.setdefault(piece if piece else self._vocab.text(token_id), clean_logprob(lp.logprob))
            delta["top_logprobs"].append(top)
        for key, values in delta.items():
            self.total[key].extend(values)
        return delta


def chat_logprob_entries(vocab: TokenVocab, token_ids: Sequence[int],
                         logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    entries = []
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        text, raw = vocab.entry(token_id)
        top = []
        for alt_id, alt_lp in lp.top:
            alt_text, alt_raw = vocab.entry(alt_id)
            top.append({"token": alt_text, "logprob": clean_logprob(alt_lp), "bytes": alt_raw})
        entries.append({"token": text, "logprob": clean_logprob(lp.logprob), "bytes": raw, "top_logprobs": top})
    return entries


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"content": entries, "refusal": None}
