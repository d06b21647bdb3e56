"""/v1/chat/completions end to end (no tools): real engine, real uvicorn, the official openai SDK."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
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

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Describe Paris."}]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, qwen2_tiny: Path) -> RunningServer:
    return shared_server(request, qwen2_tiny)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return sync_client(server)


def chat(client: openai.OpenAI, messages: list[dict[str, Any]] = MESSAGES, **kwargs: Any) -> tuple[Any, dict]:
    raw = client.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=messages, **kwargs)
    body = raw.http_response.json()
    assert_matches_spec("CreateChatCompletionResponse", body)
    return raw.parse(), body


def stream_chunks(server: RunningServer, **request: Any) -> list[dict[str, Any]]:
    """Raw chunks of a streamed chat completion (each validated), without the [DONE] marker."""
    body = {"model": MODEL_NAME, "messages": MESSAGES, "stream": True, **request}
    resp = httpx.post(server.v1 + "/chat/completions", json=body, headers=auth_headers(), timeout=60)
    assert resp.status_code == 200, resp.text
    events = list(sse_events(resp.text))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        assert_matches_spec("CreateChatCompletionStreamResponse", chunk)
        assert chunk["object"] == "chat.completion.chunk"
    return chunks


def prompt_token_count(server: RunningServer, messages: list[dict[str, Any]], **extra: Any) -> int:
    resp = httpx.post(server.base_url + "/tokenize", json={"model": MODEL_NAME, "messages": messages, **extra},
                      headers=auth_headers())
    assert resp.status_code == 200, resp.text
    return resp.json()["count"]


def test_basic_chat_shape_and_usage(client: openai.OpenAI, server: RunningServer) -> None:
    result, body = chat(client, max_completion_tokens=6, temperature=0, extra_body=NO_EOS)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    message = choice["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str) and message["content"]
    assert message["refusal"] is None and "tool_calls" not in message
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None and choice["stop_reason"] is None
    assert result.usage.completion_tokens == 6
    assert result.usage.prompt_tokens == prompt_token_count(server, MESSAGES)


def test_content_parts_and_developer_role_render_like_strings(client: openai.OpenAI) -> None:
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nWorld"}]
    parts = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]},
    ]
    a, _ = chat(client, plain, max_tokens=8, temperature=0, extra_body=NO_EOS)
    b, _ = chat(client, parts, max_tokens=8, temperature=0, extra_body=NO_EOS)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_max_tokens_and_max_completion_tokens(client: openai.OpenAI) -> None:
    a, _ = chat(client, max_tokens=3, extra_body=NO_EOS)
    b, _ = chat(client, max_completion_tokens=4, extra_body=NO_EOS)
    assert a.usage.completion_tokens == 3 and b.usage.completion_tokens == 4


def test_chat_logprobs_shape_and_bytes(client: openai.OpenAI) -> None:
    result, body = chat(client, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_EOS)
    logprobs = body["choices"][0]["logprobs"]
    assert set(logprobs) == {"content", "refusal"} and logprobs["refusal"] is None
    entries = logprobs["content"]
    assert len(entries) == 6
    for entry in entries:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 3
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-4)  # greedy
        assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"]
    text = bytes(b for entry in entries for b in entry["bytes"]).decode("utf-8", errors="replace")
    assert text == result.choices[0].message.content
    none, _ = chat(client, max_tokens=2, logprobs=True)
    assert none.choices[0].logprobs.content and all(e.top_logprobs == [] for e in none.choices[0].logprobs.content)


def test_end_of_turn_token_is_not_in_the_message(client: openai.OpenAI, server: RunningServer) -> None:
    im_end = server.engine.tokenizer.token_to_id("<|im_end|>")
    assert im_end in server.engine.model_info.eos_token_ids
    result, _ = chat(client, max_tokens=5, logprobs=True, logit_bias={str(im_end): 100})
    choice = result.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == ""
    assert choice.logprobs.content == [] and result.usage.completion_tokens == 1


def test_n_and_seed(client: openai.OpenAI) -> None:
    result, _ = chat(client, n=3, max_tokens=8, temperature=1.0, seed=7, extra_body=NO_EOS)
    assert [c.index for c in result.choices] == [0, 1, 2]
    again, _ = chat(client, n=3, max_tokens=8, temperature=1.0, seed=7, extra_body=NO_EOS)
    assert [c.message.content for c in result.choices] == [c.message.content for c in again.choices]
    assert result.usage.completion_tokens == 24


def test_stop_and_stop_reason(client: openai.OpenAI) -> None:
    full, _ = chat(client, max_tokens=12, temperature=0, extra_body=NO_EOS)
    text = full.choices[0].message.content
    stop = text[3:5]
    result, body = chat(client, max_tokens=12, temperature=0, stop=stop)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["stop_reason"] == stop
    assert result.choices[0].message.content == text[: text.index(stop)]


def test_stream_role_first_one_finish_and_usage(server: RunningServer, client: openai.OpenAI) -> None:
    expected, _ = chat(client, n=2, max_tokens=7, temperature=0, extra_body=NO_EOS)
    chunks = stream_chunks(server, n=2, max_tokens=7, temperature=0, ignore_eos=True,
                           stream_options={"include_usage": True})
    *choice_chunks, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 14
    assert all(c["usage"] is None for c in choice_chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in choice_chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("finish_reason" in c for c in mine)
        finishes = [c["finish_reason"] for c in mine]
        assert finishes[-1] == "length" and finishes[:-1] == [None] * (len(finishes) - 1)
        content = "".join(c["delta"].get("content") or "" for c in mine)
        assert content == expected.choices[index].message.content


def test_stream_without_usage_has_no_usage_key(server: RunningServer) -> None:
    chunks = stream_chunks(server, max_tokens=3)
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in {"stop", "length"}


def test_continuous_usage_stats(server: RunningServer) -> None:
    chunks = stream_chunks(server, max_tokens=4, ignore_eos=True,
                           stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4 and all(c["usage"] for c in chunks[1:])


def test_stream_logprobs_chunks(server: RunningServer) -> None:
    chunks = stream_chunks(server, max_tokens=5, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=1)
    entries = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert len(entries) == 5 and all(len(e["top_logprobs"]) == 1 for e in entries)


async def test_async_client_chat_and_stream(server: RunningServer) -> None:
    aclient = async_client(server)
    result = await aclient.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6,
                                                   temperature=0, extra_body=NO_EOS)
    stream = await aclient.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6,
                                                   temperature=0, stream=True, extra_body=NO_EOS)
    pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    assert "".join(pieces) == result.choices[0].message.content
    await aclient.close()


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}


def test_response_format_json_schema(client: openai.OpenAI, server: RunningServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
    result, _ = chat(client, max_tokens=80, temperature=0, response_format=fmt)
    assert result.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(result.choices[0].message.content), SCHEMA)
    chunks = stream_chunks(server, max_tokens=80, temperature=0, response_format=fmt)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == result.choices[0].message.content


def test_response_format_json_object(client: openai.OpenAI) -> None:
    result, _ = chat(client, max_tokens=60, temperature=0.7, seed=1, response_format={"type": "json_object"})
    if result.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(result.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a valid JSON prefix starting an object
        assert result.choices[0].message.content.startswith("{")


def test_continue_final_message(server: RunningServer, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "The city is"}]
    tokens = httpx.post(server.base_url + "/tokenize", headers=auth_headers(), json={
        "messages": messages, "continue_final_message": True, "add_generation_prompt": False}).json()["tokens"]
    prompt = httpx.post(server.base_url + "/detokenize", headers=auth_headers(),
                        json={"tokens": tokens}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\nThe city is")
    result, _ = chat(client, messages, max_tokens=3, extra_body={"continue_final_message": True, **NO_EOS})
    assert result.usage.prompt_tokens == len(tokens)
