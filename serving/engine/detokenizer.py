"""Incremental detokenization of one sequence, with stop strings.

The engine makes one ``IncrementalDetokenizer`` per sequence, ``push``es every generated token and
asks ``take_delta`` for the text to stream. Two things make this more than ``decode(ids)`` per step:

* Byte-level BPE emits partial UTF-8 characters ("日" may be three tokens). Decoding is done by
  ``tokenizers.decoders.DecodeStream``, the tokenizer library's own incremental decoder (the
  prefix/read-offset technique of HF TGI and vLLM, in Rust): it releases text only once the tokens
  decode to whole characters, and decodes each new token after a few tokens of context so that
  SentencePiece-style decoders keep the leading space of a word.
* Stop strings can span tokens, and must never reach the client. An Aho-Corasick automaton over the
  stop strings is fed each new piece of text once; its state is exactly the longest tail of the text
  that could still grow into a stop string, which ``take_delta`` holds back.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from llmkube.serving.engine.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens primed into the decode stream: enough for any decoder to see the word boundary.
_CONTEXT_TOKENS = 6
_INVALID_PREFIX = "Invalid prefix"

_special_ids_cache: weakref.WeakKeyDictionary[BackendTokenizer, frozenset[int]] = (
    weakref.WeakKeyDictionary()
)


def _special_ids(backend: BackendTokenizer) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops: the added tokens marked special.

    Not ``Tokenizer.all_special_ids``, which also names tokens from the config files that decode
    may keep. Cached per tokenizer: listing the added tokens costs ~1 µs each (Llama 3 has 256).
    """
    ids = _special_ids_cache.get(backend)
    if ids is None:
        ids = frozenset(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        _special_ids_cache[backend] = ids
    return ids


class StopStringMatcher:
    """Aho-Corasick automaton over the stop strings, fed the output text piece by piece.

    After each character its state is the longest suffix of the text so far that is a prefix of some
    stop string (``pending``), so one pass over new text answers both questions the detokenizer has:
    where does the first stop string end, and how much of the tail might still become one. Work is
    amortized O(1) per new character; text already fed is never scanned again.

    The first match is the one that *ends* first (the longest stop string ending there on a tie),
    so where the text is cut depends only on the text, never on how tokens split it.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        word: list[str | None] = [None]
        for stop in stops:
            node = 0
            for ch in stop:
                child = goto[node].get(ch)
                if child is None:
                    child = len(goto)
                    goto[node][ch] = child
                    goto.append({})
                    depth.append(depth[node] + 1)
                    word.append(None)
                node = child
            if node:
                word[node] = stop
        fail = [0] * len(goto)
        # match[n]: the longest stop string that is a suffix of node n's string (own word first,
        # then along the failure chain, whose nodes BFS has finished before n).
        match = list(word)
        queue = deque(goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0)
                if match[child] is None:
                    match[child] = match[fail[child]]
                queue.append(child)
        self._goto, self._fail, self._depth, self._match = goto, fail, depth, match
        self._state = 0

    def feed(self, text: str, start: int = 0) -> int | None:
        """Consume ``text[start:]``; stop after the first character that completes a stop string.

        Returns the index in ``text`` just past that character (``matched`` names the stop string),
        or None when no stop string ends in ``text[start:]``. Feeding the rest of ``text`` from the
        returned index continues the scan as if it had not stopped.
        """
        goto, fail, match = self._goto, self._fail, self._match
        state = self._state
        for i in range(start, len(text)):
            ch = text[i]
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if match[state] is not None:
                self._state = state
                return i + 1
        self._state = state
        return None

    @property
    def matched(self) -> str | None:
        """The stop string that the last character fed completed, if any."""
        return self._match[self._state]

    @property
    def pending(self) -> int:
        """Length of the longest tail of the text fed so far that is a prefix of some stop string."""
        return self._depth[self._state]


class IncrementalDetokenizer:
    """Text of one sequence, built token by token, released as deltas that never take back a byte.

    Guarantees: the concatenation of every ``take_delta`` equals ``text`` after the final call; a
    delta never ends inside a UTF-8 character that a later token completes; a stop string (unless
    ``include_stop_str_in_output``) and anything after it is never released, even when it spans
    tokens. When the sequence ends in the middle of a character (``max_tokens`` hit), the final
    delta carries the U+FFFD that ``decode`` shows there.

    ``min_tokens`` follows vLLM: a stop string completed by one of the first ``min_tokens - 1``
    output tokens does not stop the sequence (the text runs on; a later occurrence still stops it).
    """

    def __init__(
        self,
        tokenizer: Tokenizer | BackendTokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        backend: BackendTokenizer = getattr(tokenizer, "backend", tokenizer)
        self._backend = backend
        self._skip_special = skip_special_tokens
        self._skip_ids = _special_ids(backend) if skip_special_tokens else frozenset()
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        stops = [s for s in stop if s]
        self._matcher = StopStringMatcher(stops) if stops else None
        self._context = self._prompt_context(prompt_token_ids)
        self._stream = DecodeStream(self._context, skip_special_tokens=skip_special_tokens)
        self._token_ids: list[int] = []
        self._num_decoded = 0  # leading output tokens whose text is in self.text
        self._released: list[str] = []  # joined lazily by `text`
        self._unreleased = ""
        self._stop_str: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """The output text so far: whole characters only; after a stop match, the cut final text."""
        if len(self._released) > 1:
            self._released[:] = ["".join(self._released)]
        return (self._released[0] if self._released else "") + self._unreleased

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the sequence, if one did."""
        return self._stop_str

    def push(self, token_id: int) -> str | None:
        """Add one generated token; return the stop string if the text now contains one."""
        if self._stop_str is not None or self._finished:
            raise RuntimeError("push() after the sequence stopped or finished")
        self._token_ids.append(token_id)
        if token_id in self._skip_ids:
            # Decodes to nothing. Kept out of the stream, whose buffer (re-decoded every step until
            # it releases text) would otherwise grow without bound on a run of special tokens.
            if self._num_decoded == len(self._token_ids) - 1:
                self._num_decoded += 1
            return None
        piece = self._step(token_id)
        if piece is not None:
            self._num_decoded = len(self._token_ids)
            self._append(piece)
        return self._stop_str

    def take_delta(self, finished: bool) -> str:
        """Text released since the previous call (see the class docstring for what is held back)."""
        if finished and not self._finished:
            self._finished = True
            if self._stop_str is None:
                self._flush()
        hold = 0
        if not self._finished and self._stop_str is None and self._matcher is not None:
            hold = self._matcher.pending
        size = len(self._unreleased) - hold
        if size <= 0:
            return ""
        delta, self._unreleased = self._unreleased[:size], self._unreleased[size:]
        self._released.append(delta)
        return delta

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The last few prompt tokens, to decode the first output tokens as they read after the prompt.

        Tokens at the end that leave an incomplete character are dropped: the output's continuation
        bytes then read as U+FFFD, as in ``decode(output_ids)``, instead of breaking the stream.
        """
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        while context and self._backend.decode(context, self._skip_special).endswith(_REPLACEMENT_CHAR):
            context.pop()
        return context

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as exc:
            # Byte-fallback decoders (Llama 2, Mistral) can decode invalid byte runs differently
            # once more tokens follow, so the stream's prefix no longer matches; vLLM restarts the
            # stream too. The undecoded tokens are replayed into the fresh stream.
            if _INVALID_PREFIX not in str(exc):
                raise
        self._stream = DecodeStream(skip_special_tokens=self._skip_special)
        return self._stream.step(self._backend, self._token_ids[self._num_decoded :])

    def _flush(self) -> None:
        """Decode the tokens the stream still holds (an incomplete character at the very end)."""
        pending = self._token_ids[self._num_decoded :]
        if not pending:
            return
        context = (self._context + self._token_ids[: self._num_decoded])[-_CONTEXT_TOKENS:]
        prefix = self._backend.decode(context, self._skip_special)
        full = self._backend.decode(context + pending, self._skip_special)
        piece = full[len(prefix) :] if full.startswith(prefix) else self._backend.decode(
            pending, self._skip_special
        )
        self._num_decoded = len(self._token_ids)
        self._append(piece)

    def _append(self, piece: str) -> None:
        if self._matcher is None:
            self._unreleased += piece
            return
        end = self._matcher.feed(piece)
        while end is not None and len(self._token_ids) < self._min_tokens:
            end = self._matcher.feed(piece, end)
        if end is None:
            self._unreleased += piece
            return
        stop = self._matcher.matched
        assert stop is not None
        cut = len(self._unreleased) + end - (0 if self._include_stop else len(stop))
        # take_delta held back every tail that could start a stop string, so the cut never
        # reaches into text already released.
        assert cut >= 0, "stop string started in released text"
        self._unreleased = (self._unreleased + piece[:end])[:cut]
        self._stop_str = stop
