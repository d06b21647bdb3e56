"""/v1/completions end to end: real engine, real uvicorn, the official openai SDK."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai_server import (
    MODEL_NAME,
    RunningServer,
    assert_matches_spec,
    async_client,
    auth_headers,
    shared_server,
    sse_events,
    sync_client,
)

PROMPT = "The weather in Paris is"


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, qwen2_tiny: Path) -> RunningServer:
    return shared_server(request, qwen2_tiny)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return sync_client(server)


def create(client: openai.OpenAI, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """The parsed SDK object and the raw wire body (validated against the spec)."""
    raw = client.completions.with_raw_response.create(model=MODEL_NAME, **kwargs)
    body = raw.http_response.json()
    assert_matches_spec("CreateCompletionResponse", body)
    return raw.parse(), body


def greedy_text(client: openai.OpenAI, prompt: Any, max_tokens: int = 8) -> str:
    result, _ = create(client, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    return result.choices[0].text


def test_basic_completion_shape_and_usage(client: openai.OpenAI, server: RunningServer) -> None:
    result, body = create(client, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == MODEL_NAME
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert "stop_reason" in choice and choice["stop_reason"] is None
    assert isinstance(choice["text"], str) and choice["text"]
    prompt_tokens = len(server.engine.tokenizer.encode(PROMPT))
    assert result.usage.prompt_tokens == prompt_tokens
    assert result.usage.completion_tokens == 5
    assert result.usage.total_tokens == prompt_tokens + 5


def test_max_tokens_defaults_to_16(client: openai.OpenAI) -> None:
    result, _ = create(client, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 16
    assert result.choices[0].finish_reason == "length"


def test_prompt_forms_and_choice_order(client: openai.OpenAI, server: RunningServer) -> None:
    prompts = ["Hello there", "Once upon a time"]
    singles = [greedy_text(client, p) for p in prompts]
    assert singles[0] != singles[1]
    result, _ = create(client, prompt=prompts, n=2, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    # index = prompt_index * n + sample_index
    assert [c.text for c in result.choices] == [singles[0], singles[0], singles[1], singles[1]]
    ids = [server.engine.tokenizer.encode(p) for p in prompts]
    assert greedy_text(client, ids[1]) == singles[1]
    by_ids, _ = create(client, prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in by_ids.choices] == singles
    assert by_ids.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_echo_with_logprobs_offsets_point_into_the_text(client: openai.OpenAI) -> None:
    result, body = create(client, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=2,
                          extra_body={"ignore_eos": True})
    choice = body["choices"][0]
    assert choice["text"].startswith(PROMPT)
    lp = choice["logprobs"]
    n = len(lp["tokens"])
    assert n == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing precedes token 0
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == choice["text"]
    for i, offset in enumerate(lp["text_offset"]):
        assert offset == len("".join(lp["tokens"][:i]))
        assert choice["text"][offset : offset + len(lp["tokens"][i])] == lp["tokens"][i]
    assert n == result.usage.prompt_tokens + result.usage.completion_tokens


def test_logprobs_are_the_greedy_choice(client: openai.OpenAI) -> None:
    result, _ = create(client, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                       extra_body={"ignore_eos": True})
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == 6 and "".join(lp.tokens) == result.choices[0].text
    assert lp.text_offset[0] == 0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 4  # the 3 most likely plus the sampled token (OpenAI: up to logprobs + 1)
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the argmax


def test_stop_string_is_removed_and_reported(client: openai.OpenAI) -> None:
    full = greedy_text(client, PROMPT, max_tokens=12)
    stop = full[4:6]
    assert stop
    _, body = create(client, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "zzzz"])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == full[: full.index(stop)]
    kept, _ = create(client, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[: full.index(stop) + len(stop)]


def test_stop_token_ids_and_logit_bias(client: openai.OpenAI, server: RunningServer) -> None:
    tokenizer = server.engine.tokenizer
    ids = tokenizer.encode(greedy_text(client, PROMPT, max_tokens=8), add_special_tokens=False)
    target = ids[2]
    _, body = create(client, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"stop_token_ids": [target]})
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["stop_reason"] == target
    forced = tokenizer.encode(" sunny", add_special_tokens=False)[0]
    biased, _ = create(client, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={str(forced): 100},
                       extra_body={"ignore_eos": True})
    assert biased.choices[0].text == tokenizer.decode([forced] * 4)


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0,
                              "extra_body": {"ignore_eos": True}}
    a, _ = create(client, seed=1234, **kwargs)
    b, _ = create(client, seed=1234, **kwargs)
    c, _ = create(client, seed=999, **kwargs)
    assert a.choices[0].text == b.choices[0].text
    assert c.choices[0].text != a.choices[0].text


def test_stream_matches_non_stream_and_ends_with_usage(server: RunningServer, client: openai.OpenAI) -> None:
    expected = greedy_text(client, PROMPT, max_tokens=10)
    request = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.v1 + "/completions", json=request, headers=auth_headers()) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(resp.read().decode()))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        assert_matches_spec("CreateCompletionResponse", chunk)
        assert "usage" in chunk  # null until the last chunk when include_usage is set
    *choice_chunks, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 10
    assert all(c["usage"] is None for c in choice_chunks)
    assert "".join(c["choices"][0]["text"] for c in choice_chunks) == expected
    finishes = [c["choices"][0]["finish_reason"] for c in choice_chunks]
    assert finishes[-1] == "length" and finishes.count(None) == len(finishes) - 1


def test_sdk_stream_without_usage(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, stream=True))
    assert chunks and all(c.usage is None for c in chunks)
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1


async def test_async_stream_multiple_prompts_and_n(server: RunningServer, client: openai.OpenAI) -> None:
    prompts = ["Hello there", "Once upon a time"]
    expected = [greedy_text(client, p, max_tokens=6) for p in prompts]
    aclient = async_client(server)
    stream = await aclient.completions.create(model=MODEL_NAME, prompt=prompts, n=2, max_tokens=6,
                                              temperature=0, stream=True, extra_body={"ignore_eos": True})
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert texts == {0: expected[0], 1: expected[0], 2: expected[1], 3: expected[1]}
    assert finishes == {i: ["length"] for i in range(4)}
    non_stream = await aclient.completions.create(model=MODEL_NAME, prompt=prompts[0], max_tokens=6,
                                                  temperature=0, extra_body={"ignore_eos": True})
    assert non_stream.choices[0].text == expected[0]
    await aclient.close()


def test_stream_with_echo_and_logprobs(server: RunningServer) -> None:
    request = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
               "stream": True, "echo": True, "logprobs": 1}
    resp = httpx.post(server.v1 + "/completions", json=request, headers=auth_headers())
    chunks = [json.loads(e) for e in sse_events(resp.text) if e != "[DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert text.startswith(PROMPT) and "".join(tokens) == text
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]


def test_structured_output_extension_on_completions(client: openai.OpenAI) -> None:
    result, _ = create(client, prompt="Answer:", max_tokens=40, temperature=0,
                       extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert result.choices[0].text in {"yes", "no", "maybe"}
    assert result.choices[0].finish_reason == "stop"


def test_echo_of_token_ids_with_special_tokens(client: openai.OpenAI, server: RunningServer) -> None:
    ids = httpx.post(server.base_url + "/tokenize", headers=auth_headers(),
                     json={"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
    result, _ = create(client, prompt=ids, max_tokens=4, temperature=0, echo=True, logprobs=0,
                       extra_body={"ignore_eos": True})
    choice = result.choices[0]
    assert choice.text.startswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    tokens, offsets = choice.logprobs.tokens, choice.logprobs.text_offset
    assert "".join(tokens) == choice.text and len(tokens) == len(ids) + 4
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
