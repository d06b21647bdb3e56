"""Structured output: xgrammar grammars applied to the logits as a token bitmask.

A request's constraint (JSON schema, any JSON object, regex or EBNF grammar) is
compiled once per distinct constraint (LRU cache) against the tokenizer's vocabulary;
each sequence then walks the compiled grammar with its own ``GrammarState``. The
sampler asks every constrained row for its bitmask of allowed next tokens, and the
engine feeds every sampled token back through ``GrammarState.accept``.

JSON (schema and ``json_object``) is compiled with ``any_whitespace=False``: the
separators are fixed (``", "`` and ``": "``, as ``json.dumps`` writes them) and no
other whitespace is allowed. With free whitespace a weak model can emit blanks
forever and never finish the document (measured here with xgrammar 0.2.8: a
random-weight model ran to ``max_tokens``; constrained, it finished in 36 tokens).

The grammar's stop tokens are the tokenizer's EOS ids: once the document is
complete, only EOS is allowed, so the sequence ends there.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from typing import Any, Protocol

import tokenizers
import torch
import xgrammar as xgr

from llmkube.serving.engine.errors import InvalidRequestError
from llmkube.serving.engine.sampling_params import SamplingParams

DEFAULT_CACHE_SIZE = 128
# Special tokens (chat markers, padding) are hidden from the grammar, as an empty
# string, which xgrammar never allows: the detokenizer drops them from the text, so a
# constraint accepting them would disagree with the text the user gets. Stop tokens
# are allowed by id regardless.
_HIDDEN = ""


class TokenizerLike(Protocol):
    """What the compiler needs of the engine's ``Tokenizer``."""

    @property
    def backend(self) -> tokenizers.Tokenizer: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def all_special_ids(self) -> frozenset[int]: ...


# --------------------------------------------------------------------------- tokenizer info


def _component_types(component: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Flatten a tokenizer.json normalizer/pre_tokenizer/decoder into its leaf components."""
    if not component:
        return []
    for key in ("decoders", "pretokenizers", "normalizers"):
        if component.get("type") == "Sequence" and key in component:
            return [leaf for child in component[key] for leaf in _component_types(child)]
    return [component]


def detect_vocab_metadata(tokenizer_json: dict[str, Any]) -> tuple[xgr.VocabType, bool]:
    """The vocabulary encoding and add_prefix_space of a ``tokenizer.json``, read from its decoder.

    - a ``ByteLevel`` decoder: GPT-2 style byte-to-unicode tokens (Llama 3, Qwen, Mistral-Nemo);
    - a ``ByteFallback`` decoder: SentencePiece pieces with ``<0xNN>`` bytes (Llama 2, Mistral);
    - anything else: the tokens are the raw text.

    ``add_prefix_space`` is whether encoding prepends a space: a ``Metaspace``
    pre-tokenizer that prepends, or a ``Prepend("▁")`` normalizer.
    """
    decoders = {c.get("type") for c in _component_types(tokenizer_json.get("decoder"))}
    if "ByteLevel" in decoders:
        vocab_type = xgr.VocabType.BYTE_LEVEL
    elif "ByteFallback" in decoders:
        vocab_type = xgr.VocabType.BYTE_FALLBACK
    else:
        vocab_type = xgr.VocabType.RAW
    add_prefix_space = False
    for c in _component_types(tokenizer_json.get("pre_tokenizer")):
        if c.get("type") == "Metaspace":
            scheme = c.get("prepend_scheme", "always" if c.get("add_prefix_space", True) else "never")
            add_prefix_space |= scheme in ("always", "first")
    for c in _component_types(tokenizer_json.get("normalizer")):
        if c.get("type") == "Prepend" and c.get("prepend") == "▁":
            add_prefix_space = True
    return vocab_type, add_prefix_space


def build_tokenizer_info(
    backend: tokenizers.Tokenizer,
    vocab_size: int,
    stop_token_ids: frozenset[int] | set[int],
    special_token_ids: frozenset[int] | set[int] = frozenset(),
) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, built from a ``tokenizers.Tokenizer`` (no transformers).

    ``vocab_size`` is the model's output width: ids the tokenizer lacks (padding rows)
    are never allowed, tokenizer ids past it are dropped (as xgrammar's
    ``from_huggingface`` does). ``special_token_ids`` and the added tokens the backend
    marks special are hidden from the grammar.
    """
    encoded = [_HIDDEN] * vocab_size
    for token, idx in backend.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = token
    hidden = set(special_token_ids)
    hidden.update(idx for idx, added in backend.get_added_tokens_decoder().items() if added.special)
    for idx in hidden:
        if 0 <= idx < vocab_size:
            encoded[idx] = _HIDDEN
    vocab_type, add_prefix_space = detect_vocab_metadata(json.loads(backend.to_str()))
    stops = sorted(t for t in stop_token_ids if 0 <= t < vocab_size)
    if not stops:
        raise ValueError("structured output needs at least one EOS token id inside the vocabulary")
    return xgr.TokenizerInfo(
        encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=stops, add_prefix_space=add_prefix_space
    )


# --------------------------------------------------------------------------- compiler


def _constraint_key(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, canonical text) of a request's constraint, or None when it has none."""
    if params.json_schema is not None:
        schema = params.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"json_schema is not valid JSON: {e}", "response_format") from e
        if not isinstance(schema, dict):
            raise InvalidRequestError("json_schema must be a JSON object", "response_format")
        return "json_schema", json.dumps(schema)
    if params.json_object:
        return "json_object", ""
    if params.regex is not None:
        return "regex", params.regex
    if params.grammar is not None:
        return "grammar", params.grammar
    return None


class GrammarCompilerCache:
    """Compiles request constraints against one tokenizer; a bounded LRU of compiled grammars.

    Thread-safe: the async engine compiles off its event loop.
    """

    def __init__(
        self, tokenizer: TokenizerLike, vocab_size: int, *, max_entries: int = DEFAULT_CACHE_SIZE
    ) -> None:
        self.vocab_size = vocab_size
        self.tokenizer_info = build_tokenizer_info(
            tokenizer.backend, vocab_size, tokenizer.eos_token_ids, tokenizer.all_special_ids
        )
        # Our LRU is the only cache: xgrammar's own would grow without bound by default.
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False
        )
        self._max_entries = max_entries
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: SamplingParams) -> xgr.CompiledGrammar | None:
        """The compiled constraint of ``params``; raises ``InvalidRequestError`` if it is invalid."""
        key = _constraint_key(params)
        if key is None:
            return None
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(*key)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        try:
            if kind == "json_schema":
                return self._compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                # Any JSON object (OpenAI's json_object mode), whitespace fixed like schemas.
                return self._compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if kind == "regex":
                return self._compiler.compile_regex(spec)
            return self._compiler.compile_grammar(spec)
        except (RuntimeError, ValueError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            # xgrammar prefixes its messages with "[time] /path/file.cc:line: ".
            reason = reason.split(": ", 1)[1] if reason.startswith("[") and ": " in reason else reason
            raise InvalidRequestError(f"invalid {kind.replace('_', ' ')}: {reason}", "response_format") from e

    def new_state(self, compiled: xgr.CompiledGrammar) -> GrammarState:
        return GrammarState(compiled, self.tokenizer_info.stop_token_ids)

    def __len__(self) -> int:
        return len(self._cache)


# --------------------------------------------------------------------------- per-sequence state


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int]) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._stop_token_ids = stop_token_ids

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into ``bitmask[row]`` (CPU int32); False if all are allowed.

        After termination (EOS accepted, e.g. with ``ignore_eos``) only EOS stays allowed,
        so the text remains the complete document.
        """
        if self._matcher.is_terminated():
            bitmask[row].zero_()
            for token_id in self._stop_token_ids:
                word, bit = divmod(token_id, 32)
                bitmask[row, word] |= _bit(bit)
            return True
        return bool(self._matcher.fill_next_token_bitmask(bitmask, row))

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) if the grammar does not allow it."""
        if self._matcher.is_terminated():
            return token_id in self._stop_token_ids
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        """True once the document is complete and a stop token was accepted."""
        return bool(self._matcher.is_terminated())


def _bit(position: int) -> int:
    """The int32 value with only ``position`` set (bit 31 is the sign bit)."""
    return -(1 << 31) if position == 31 else 1 << position


# --------------------------------------------------------------------------- bitmask helpers


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed CPU bitmask of shape [batch_size, ceil(vocab_size / 32)] (int32)."""
    return xgr.allocate_token_bitmask(batch_size, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of disallowed tokens to -inf in ``rows`` (row i of logits uses bitmask[i])."""
    if rows:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
