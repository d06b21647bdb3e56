"""Tool calling end to end: tool_choice auto / required / named / none, stream and non-stream.

The tiny model has random weights, so "required" and named calls rely on the engine's
grammar (they must validate anyway); for "auto" the model's text is steered with the
``structured_outputs`` regex extension into exactly what a real model would write, and
the server's hermes parser must turn it into tool calls.
"""

from __future__ import annotations

import json
import re
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

from llmkube.serving.openai.observer import NullObserver

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 8}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, qwen2_tiny: Path) -> RunningServer:
    return shared_server(request, qwen2_tiny)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return sync_client(server)


def chat(client: openai.OpenAI, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    kwargs.setdefault("messages", MESSAGES)
    raw = client.chat.completions.with_raw_response.create(model=MODEL_NAME, **kwargs)
    body = raw.http_response.json()
    assert_matches_spec("CreateChatCompletionResponse", body)
    return raw.parse(), body


def assert_valid_calls(calls: list[Any]) -> None:
    ids = [c.id for c in calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
    for call in calls:
        assert call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def stream_tool_calls(server: RunningServer, **request: Any) -> tuple[dict[int, dict[str, Any]], str, str]:
    """Reassemble streamed tool calls by index (checking the delta protocol); also content and finish."""
    body = {"model": MODEL_NAME, "messages": MESSAGES, "stream": True, **request}
    resp = httpx.post(server.v1 + "/chat/completions", json=body, headers=auth_headers(), timeout=60)
    assert resp.status_code == 200, resp.text
    calls: dict[int, dict[str, Any]] = {}
    content, finishes = "", []
    for event in sse_events(resp.text):
        if event == "[DONE]":
            break
        chunk = json.loads(event)
        assert_matches_spec("CreateChatCompletionStreamResponse", chunk)
        choice = chunk["choices"][0]
        content += choice["delta"].get("content") or ""
        if choice["finish_reason"] is not None:
            finishes.append(choice["finish_reason"])
        for delta in choice["delta"].get("tool_calls") or []:
            index = delta["index"]
            if index not in calls:  # the first delta of a call names it
                assert delta["id"].startswith("call_") and delta["type"] == "function"
                assert delta["function"]["name"] in SCHEMAS
                calls[index] = {"id": delta["id"], "name": delta["function"]["name"], "arguments": ""}
            else:
                assert "id" not in delta and "name" not in delta["function"]
            calls[index]["arguments"] += delta["function"].get("arguments", "")
    assert len(finishes) == 1
    return calls, content, finishes[0]


def test_required_calls_validate_against_the_schemas(client: openai.OpenAI) -> None:
    result, body = chat(client, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    assert_valid_calls(choice.message.tool_calls)
    assert body["choices"][0]["message"]["content"] is None


def test_required_with_parallel_tool_calls_false_keeps_one(client: openai.OpenAI) -> None:
    for seed in (1, 2, 3):
        result, _ = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                         max_tokens=300, temperature=1.0, seed=seed)
        assert result.choices[0].finish_reason == "tool_calls"
        assert len(result.choices[0].message.tool_calls) == 1
        assert_valid_calls(result.choices[0].message.tool_calls)


def test_named_tool_choice_finishes_with_stop(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    result, _ = chat(client, tools=TOOLS, tool_choice=named, max_tokens=300, temperature=0)
    choice = result.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI does for a forced function
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    assert_valid_calls([call])


def test_streamed_required_calls_match_non_stream(server: RunningServer, client: openai.OpenAI) -> None:
    result, _ = chat(client, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0)
    calls, content, finish = stream_tool_calls(server, tools=TOOLS, tool_choice="required", max_tokens=300,
                                               temperature=0)
    assert finish == "tool_calls" and content == ""
    expected = [(c.function.name, c.function.arguments) for c in result.choices[0].message.tool_calls]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected


def test_streamed_named_call(server: RunningServer) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls, _, finish = stream_tool_calls(server, tools=TOOLS, tool_choice=named, max_tokens=300, temperature=0)
    assert finish == "stop" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


def test_length_in_the_middle_of_a_forced_call(client: openai.OpenAI, server: RunningServer) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    result, _ = chat(client, tools=TOOLS, tool_choice=named, max_tokens=3, temperature=0)
    assert result.choices[0].finish_reason == "length"
    _, _, finish = stream_tool_calls(server, tools=TOOLS, tool_choice=named, max_tokens=3, temperature=0)
    assert finish == "length"


def _hermes_regex(name: str, arguments: str) -> str:
    text = '<tool_call>\n{"name": "' + name + '", "arguments": ' + arguments + "}\n</tool_call>"
    return "".join("\\" + ch if ch in "\\.^$*+?()[]{}|/-" else ch for ch in text)


def test_auto_parses_the_models_hermes_markup(client: openai.OpenAI, server: RunningServer) -> None:
    steer = {"structured_outputs": {"regex": _hermes_regex("get_weather", '{"city": "Paris", "unit": "celsius"}')}}
    result, _ = chat(client, tools=TOOLS, max_tokens=60, temperature=0, extra_body=steer)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    calls, content, finish = stream_tool_calls(server, tools=TOOLS, max_tokens=60, temperature=0, **steer)
    assert finish == "tool_calls" and content == ""
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "celsius"}


class RecordingObserver:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def choice_finished(self, model: str, endpoint: str, finish_reason: str) -> None:
        self.events.append(("finished", model, endpoint, finish_reason))

    def tool_calls_parsed(self, model: str, parser: str, num_calls: int) -> None:
        self.events.append(("parsed", model, parser, num_calls))

    def tool_parse_failed(self, model: str, parser: str) -> None:
        self.events.append(("failed", model, parser))


def test_auto_returns_malformed_markup_as_content(client: openai.OpenAI, server: RunningServer) -> None:
    steer = {"structured_outputs": {"regex": _hermes_regex("not_a_tool", "{}")}}
    ctx = server.app.state.ctx
    recorder = RecordingObserver()
    ctx.observer = recorder
    try:
        result, _ = chat(client, tools=TOOLS, max_tokens=60, temperature=0, extra_body=steer)
        good = {"structured_outputs": {"regex": _hermes_regex("get_time", '{"zone": "UTC"}')}}
        chat(client, tools=TOOLS, max_tokens=60, temperature=0, extra_body=good)
    finally:
        ctx.observer = NullObserver()
    choice = result.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert re.search(r"<tool_call>\s*\{\"name\": \"not_a_tool\"", choice.message.content)
    assert recorder.events == [  # the metrics hooks: one parse failure, then one well-formed call
        ("finished", MODEL_NAME, "chat.completions", "stop"),
        ("failed", MODEL_NAME, "hermes"),
        ("finished", MODEL_NAME, "chat.completions", "tool_calls"),
        ("parsed", MODEL_NAME, "hermes", 1),
    ]


def test_auto_cut_by_length_mid_call_is_length_and_content(client: openai.OpenAI) -> None:
    steer = {"structured_outputs": {"regex": _hermes_regex("get_weather", '{"city": "Paris", "unit": "celsius"}')}}
    result, _ = chat(client, tools=TOOLS, max_tokens=6, temperature=0, extra_body=steer)
    choice = result.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith("<tool_call>")


def test_tool_choice_none_never_parses(client: openai.OpenAI) -> None:
    steer = {"structured_outputs": {"regex": _hermes_regex("get_time", '{"zone": "UTC"}')}}
    result, _ = chat(client, tools=TOOLS, tool_choice="none", max_tokens=60, temperature=0, extra_body=steer)
    assert result.choices[0].finish_reason == "stop" and not result.choices[0].message.tool_calls
    assert "<tool_call>" in result.choices[0].message.content


async def test_multi_turn_with_tool_results(server: RunningServer) -> None:
    aclient = async_client(server)
    first = await aclient.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                                  tool_choice="required", max_tokens=300, temperature=0)
    message = first.choices[0].message
    history = [*MESSAGES, message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "22 C, sunny"} for c in message.tool_calls]
    second = await aclient.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS,
                                                   max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert second.choices[0].finish_reason in {"length", "stop", "tool_calls"}
    rendered = httpx.post(server.base_url + "/tokenize", headers=auth_headers(),
                          json={"messages": history, "tools": TOOLS}).json()
    assert second.usage.prompt_tokens == rendered["count"]
    text = httpx.post(server.base_url + "/detokenize", headers=auth_headers(),
                      json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in text
    assert f'"name": "{message.tool_calls[0].function.name}"' in text
    await aclient.close()


def test_bad_tool_requests_are_400(client: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
          "tool_choice": "required"}, "tools"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, **kwargs)
        assert err.value.status_code == 400
        assert err.value.body["param"] == param, err.value.body
    ok, _ = chat(client, tools=TOOLS, tool_choice="required", max_tokens=300)
    assert ok.choices[0].message.tool_calls
