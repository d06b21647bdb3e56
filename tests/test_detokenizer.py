"""Incremental detokenization: exact deltas, whole characters, stop strings across tokens."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models

from llmkube.serving.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from llmkube.serving.testing import build_tokenizer

FFFD = "\ufffd"
TEXTS = [
    "café 日本語 🎉 emoji",
    "Hello world, 日本語 is fun. Ünïcödé: naïve façade 🎉🚀👍🏽!",
    "Line one\nLine two\n\n  indented 日本 text 😀 end",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_tokenizer()


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def stream(
    detok: IncrementalDetokenizer,
    ids: Sequence[int],
    rng: random.Random | None = None,
) -> tuple[list[str], str | None, int]:
    """Push ``ids`` (until a stop), taking deltas after every token or at ``rng``'s random points.

    Returns the deltas (the last one with finished=True), the stop string and how many tokens were
    pushed.
    """
    deltas: list[str] = []
    stop = None
    pushed = 0
    for token_id in ids:
        stop = detok.push(token_id)
        pushed += 1
        if stop is not None:
            break
        if rng is None or rng.random() < 0.4:
            deltas.append(detok.take_delta(finished=False))
    deltas.append(detok.take_delta(finished=True))
    return deltas, stop, pushed


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode_and_never_split_a_character(tok: Tokenizer, text: str) -> None:
    ids = encode(tok, text)
    # The test is only meaningful if some character really is split across tokens.
    assert any(FFFD in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, encode(tok, "Prompt: "))
    deltas, stop, _ = stream(detok, ids)
    assert stop is None
    assert "".join(deltas) == detok.text == tok.decode(ids) == text
    assert all(FFFD not in d for d in deltas)


def test_any_split_of_take_delta_calls_gives_the_same_text(tok: Tokenizer) -> None:
    ids = encode(tok, TEXTS[1])
    for seed in range(20):
        detok = IncrementalDetokenizer(tok, [])
        deltas, _, _ = stream(detok, ids, random.Random(seed))
        assert "".join(deltas) == TEXTS[1]
        assert all(FFFD not in d for d in deltas)


def test_random_tokens_match_reference_decode(tok: Tokenizer) -> None:
    """A random model emits arbitrary byte tokens, invalid UTF-8 included; the final text is decode's."""
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))]
        detok = IncrementalDetokenizer(tok, prompt)
        deltas, _, _ = stream(detok, ids, rng)
        assert "".join(deltas) == detok.text == tok.decode(ids)


def test_incomplete_character_is_held_until_finished(tok: Tokenizer) -> None:
    ids = encode(tok, "ok 🎉")
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith(FFFD))
    detok = IncrementalDetokenizer(tok, [])
    for token_id in ids[:cut]:
        detok.push(token_id)
    # The token holding the emoji's first bytes may carry the space too: both wait.
    first = detok.take_delta(finished=False)
    assert first in ("ok", "ok ") and detok.text == first
    # max_tokens ended the sequence mid-character: the final delta shows what decode shows.
    last = detok.take_delta(finished=True)
    assert first + last == detok.text == tok.decode(ids[:cut])
    assert last.endswith(FFFD)
    assert detok.take_delta(finished=True) == ""


def test_prompt_ending_mid_character(tok: Tokenizer) -> None:
    ids = encode(tok, "日本語")
    split = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith(FFFD))
    detok = IncrementalDetokenizer(tok, ids[:split])
    deltas, _, _ = stream(detok, ids[split:])
    assert "".join(deltas) == tok.decode(ids[split:])


def test_skip_special_tokens(tok: Tokenizer) -> None:
    ids = encode(tok, "<tool_call>{\"a\": 1}</tool_call><|im_end|>done<|endoftext|>")
    assert tok.token_to_id("<|im_end|>") in ids
    skipped = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    deltas, _, _ = stream(skipped, ids)
    assert "".join(deltas) == '<tool_call>{"a": 1}</tool_call>done' == tok.decode(ids)
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    deltas, _, _ = stream(kept, ids)
    assert "".join(deltas) == '<tool_call>{"a": 1}</tool_call><|im_end|>done<|endoftext|>'


def test_run_of_special_tokens_inside_a_split_character(tok: Tokenizer) -> None:
    ids = encode(tok, "🎉")
    im_end = tok.token_to_id("<|im_end|>")
    detok = IncrementalDetokenizer(tok, [])
    detok.push(ids[0])
    for _ in range(3000):
        assert detok.push(im_end) is None
    assert detok.take_delta(finished=False) == ""
    for token_id in ids[1:]:
        detok.push(token_id)
    assert detok.take_delta(finished=True) == "🎉"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok: Tokenizer, include: bool) -> None:
    text = "Hello world, 日本語 is fun, and more text follows"
    stop_str = "ld, 日本"
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, [], stop=["zzz", stop_str], include_stop_str_in_output=include)
    deltas, stop, pushed = stream(detok, ids)
    assert stop == stop_str == detok.stop_str
    # The token that completed the stop string is the one pushed last.
    assert stop_str in tok.decode(ids[:pushed]) and stop_str not in tok.decode(ids[: pushed - 1])
    expected = "Hello wor" + (stop_str if include else "")
    assert "".join(deltas) == detok.text == expected
    with pytest.raises(RuntimeError):
        detok.push(ids[pushed])


def test_stop_string_prefix_is_held_back_then_released(tok: Tokenizer) -> None:
    ids = encode(tok, "Hello world, 日本語 is fun")
    detok = IncrementalDetokenizer(tok, [], stop=["world peace", "日本人"])
    released = ""
    for token_id in ids:
        assert detok.push(token_id) is None
        released += detok.take_delta(finished=False)
        # Nothing that could still grow into a stop string has been released.
        for stop in ("world peace", "日本人"):
            assert not any(
                detok.text.endswith(stop[:k]) and len(released) > len(detok.text) - k
                for k in range(1, len(stop))
            )
        assert detok.text.startswith(released)
    assert released == "Hello world, 日本語 is fun"
    assert detok.take_delta(finished=True) == ""


def test_partial_stop_at_the_end_is_released_when_finished(tok: Tokenizer) -> None:
    ids = encode(tok, "Hello wor")
    detok = IncrementalDetokenizer(tok, [], stop=["world"])
    deltas, stop, _ = stream(detok, ids)
    assert stop is None
    assert "".join(deltas[:-1]) == "Hello "  # "wor" could still have become "world"
    assert deltas[-1] == "wor"
    assert detok.text == "Hello wor"


def test_stop_inside_one_token_cuts_the_rest_of_it(tok: Tokenizer) -> None:
    ids = encode(tok, "Hello world")
    assert tok.decode(ids[:1]) == "Hel"  # the stop string lies inside the first token
    detok = IncrementalDetokenizer(tok, [], stop=["el"])
    deltas, stop, pushed = stream(detok, ids)
    assert (stop, pushed) == ("el", 1)
    assert "".join(deltas) == detok.text == "H"


def test_earliest_ending_stop_wins_then_longest(tok: Tokenizer) -> None:
    ids = encode(tok, "xabcd")
    detok = IncrementalDetokenizer(tok, [], stop=["abc", "b"])
    _, stop, _ = stream(detok, ids)
    assert (stop, detok.text) == ("b", "xa")
    detok = IncrementalDetokenizer(tok, [], stop=["c", "bc"])
    _, stop, _ = stream(detok, ids)
    assert (stop, detok.text) == ("bc", "xa")


def test_stop_strings_against_naive_reference(tok: Tokenizer) -> None:
    """Random texts over a small alphabet with random stops: same cut as a whole-text search."""
    rng = random.Random(1)
    alphabet = "ab 日c"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 25)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(2)]
        include = rng.random() < 0.5
        ids = encode(tok, text)
        detok = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
        deltas, stop, _ = stream(detok, ids, rng)
        full = tok.decode(ids)
        hits = [(full.find(s) + len(s), -len(s), s) for s in stops if s in full]
        if hits:
            end, _, first = min(hits)
            assert stop == first
            assert detok.text == full[: end if include else end - len(first)]
        else:
            assert stop is None and detok.text == full
        assert "".join(deltas) == detok.text


def test_stop_search_scans_each_character_once(tok: Tokenizer) -> None:
    ids = encode(tok, " ".join(TEXTS) * 20)
    detok = IncrementalDetokenizer(tok, [], stop=["never appears", "日本人"])
    matcher = detok._matcher
    assert matcher is not None
    scanned: list[int] = []
    feed = matcher.feed

    def spy(text: str, start: int = 0) -> int | None:
        scanned.append(len(text) - start)
        return feed(text, start)

    matcher.feed = spy  # type: ignore[method-assign]
    stream(detok, ids)
    assert sum(scanned) == len(detok.text)
    assert max(scanned) <= max(len(tok.decode([i])) for i in ids) + 1


def test_min_tokens_defers_stop_strings(tok: Tokenizer) -> None:
    ids = encode(tok, "ab ab ab ab")
    detok = IncrementalDetokenizer(tok, [], stop=["ab"], min_tokens=3)
    deltas, stop, pushed = stream(detok, ids)
    assert stop == "ab" and pushed >= 3
    assert detok.text == tok.decode(ids[:pushed])[: -len("ab")]
    assert "".join(deltas) == detok.text


def test_stop_string_matcher_state() -> None:
    matcher = StopStringMatcher(["abcd", "bce"])
    assert matcher.feed("xab") is None and matcher.pending == 2
    assert matcher.feed("c") is None and matcher.pending == 3  # "abc" (and "bc")
    assert matcher.feed("e") == 1 and matcher.matched == "bce"
    assert matcher.feed("zz") is None and matcher.pending == 0 and matcher.matched is None


# --------------------------------------------------------------- SentencePiece-style tokenizer


def byte_fallback_tokenizer() -> Tokenizer:
    """A Llama-2-style tokenizer: "▁" word marks, <0xNN> byte fallback, first leading space stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁hello": 3, "▁world": 4, "d": 5}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok


def test_prompt_context_keeps_the_leading_space() -> None:
    tok = byte_fallback_tokenizer()
    hi = "日".encode()
    out = [4, *(6 + b for b in hi), 5, 2, 4]
    assert tok.decode(out) == "world日d world"  # decoded alone, the first space is stripped
    detok = IncrementalDetokenizer(tok, [1, 3])
    deltas, _, _ = stream(detok, out)
    assert "".join(deltas) == " world日d world"
    assert all(FFFD not in d for d in deltas)


def test_byte_fallback_invalid_bytes_recover() -> None:
    """Invalid byte runs make DecodeStream's prefix check fail; the stream restarts and goes on."""
    tok = byte_fallback_tokenizer()
    rng = random.Random(2)
    for _ in range(300):
        ids = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randrange(1, 12))]
        detok = IncrementalDetokenizer(tok, [1, 3])
        deltas, _, _ = stream(detok, ids, rng)
        assert "".join(deltas) == detok.text


def test_through_the_checkpoint_tokenizer(tmp_path) -> None:
    """The engine's wrapper loaded from a written checkpoint, with a chat prompt as context."""
    from llmkube.serving.engine.tokenizer import Tokenizer as CheckpointTokenizer
    from llmkube.serving.testing import write_checkpoint

    tokenizer = CheckpointTokenizer.from_pretrained(write_checkpoint(tmp_path, arch="qwen2", size="tiny"))
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    ids = tokenizer.encode("<tool_call>日本語 🎉</tool_call><|im_end|>", add_special_tokens=False)
    assert tokenizer.eos_token_ids & set(ids)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip, stop=["</tool"])
        deltas, stop, pushed = stream(detok, ids)
        assert stop == "</tool"
        assert "".join(deltas) == detok.text == tokenizer.decode(ids[:pushed], skip).split("</tool")[0]
        assert detok.text == "<tool_call>日本語 🎉"
