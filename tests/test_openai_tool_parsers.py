"""Tool-call parsers: whole-text results, and streaming that agrees with them however the text is cut."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from llmkube.serving.openai.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedToolParser,
    PythonicToolParser,
    RequiredToolsParser,
    ToolParser,
    get_tool_parser,
    parse_whole,
    required_schema,
)

TOOLS = ["get_weather", "get_time"]

# (parser class, model text, expected content, expected [(name, arguments)], expected parse failures)
CASES: list[tuple[type[ToolParser], str, str | None, list[tuple[str, dict[str, Any]]], int]] = [
    (HermesToolParser, "Just text, no calls.", "Just text, no calls.", [], 0),
    (HermesToolParser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})], 0),
    (HermesToolParser,
     'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})], 0),
    (HermesToolParser, '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>',
     None, [("get_time", {"zone": "UTC"})], 0),
    (HermesToolParser, '<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", {})], 0),
    (HermesToolParser, 'Hi <tool_call>{"name": "get_time", "arguments": {oops}}</tool_call> bye',
     'Hi <tool_call>{"name": "get_time", "arguments": {oops}}</tool_call> bye', [], 1),
    (HermesToolParser, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', [], 1),
    (HermesToolParser, 'a < b and <tool but not a call', "a < b and <tool but not a call", [], 0),
    (HermesToolParser, '<tool_call>\n{"name": "get_weather", "argu', '<tool_call>\n{"name": "get_weather", "argu',
     [], 1),
    (MistralToolParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                        '{"name": "get_time", "arguments": {}}]',
     None, [("get_weather", {"city": "Oslo"}), ("get_time", {})], 0),
    (MistralToolParser, 'Sure [TOOL_CALLS]{"name": "get_time", "arguments": {"zone": "X"}}', "Sure",
     [("get_time", {"zone": "X"})], 0),
    (MistralToolParser, '[TOOL_CALLS] [{"name": "get_time", "arguments": [1]}]',
     '[TOOL_CALLS] [{"name": "get_time", "arguments": [1]}]', [], 1),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_weather", {"city": "Rome"})], 0),
    (Llama3JsonToolParser, '<|python_tag|>{"name": "get_time", "parameters": {}}; '
                           '{"name": "get_weather", "parameters": {"city": "Rome"}}',
     None, [("get_time", {}), ("get_weather", {"city": "Rome"})], 0),
    (Llama3JsonToolParser, "The answer is 42.", "The answer is 42.", [], 0),
    (Llama3JsonToolParser, '{"name": "get_time", "parameters": {', '{"name": "get_time", "parameters": {', [], 1),
    (PythonicToolParser, '[get_weather(city="Paris"), get_time(zone="CET")]', None,
     [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})], 0),
    (PythonicToolParser, '<|python_start|>[get_time(zone=None)]<|python_end|>', None,
     [("get_time", {"zone": None})], 0),
    (PythonicToolParser, '[get_time(zone=open("/etc/passwd"))]', '[get_time(zone=open("/etc/passwd"))]', [], 1),
    (PythonicToolParser, '[1, 2, 3]', '[1, 2, 3]', [], 1),
    (PythonicToolParser, "plain words", "plain words", [], 0),
]


def stream(parser: ToolParser, text: str, size: int) -> tuple[str, dict[int, dict[str, Any]]]:
    """Feed ``text`` in pieces of ``size``; check the delta protocol; gather content and calls."""
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    for delta in deltas:
        content += delta.content
        for call in delta.tool_calls:
            if call.index not in calls:
                assert call.id and call.id.startswith("call_") and call.name  # the first delta names the call
                calls[call.index] = {"name": call.name, "arguments": ""}
            else:
                assert call.id is None and call.name is None
            calls[call.index]["arguments"] += call.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, calls


@pytest.mark.parametrize(("cls", "text", "content", "calls", "failures"), CASES)
def test_whole_text(cls: type[ToolParser], text: str, content: str | None,
                    calls: list[tuple[str, dict[str, Any]]], failures: int) -> None:
    parsed = parse_whole(cls(TOOLS), text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert parsed.parse_failures == failures
    assert len({c.id for c in parsed.tool_calls}) == len(calls)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(("cls", "text", "content", "calls", "failures"), CASES)
def test_streaming_agrees_with_whole_text(cls: type[ToolParser], text: str, content: str | None,
                                          calls: list[tuple[str, dict[str, Any]]], failures: int,
                                          size: int) -> None:
    parser = cls(TOOLS)
    streamed, streamed_calls = stream(parser, text, size)
    assert (streamed if streamed.strip() or not calls else None) == content
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls.values()] == calls
    assert parser.parse_failures == failures


def test_hermes_streams_text_before_a_call_at_once_and_holds_a_possible_marker() -> None:
    parser = HermesToolParser(TOOLS)
    assert parser.feed("Hello wor").content == "Hello wor"
    assert parser.feed("ld <tool").content == "ld"  # " <tool" might start a call
    assert parser.feed("s are fun").content == " <tools are fun"
    assert parser.feed("\n<tool_call>").content == ""
    delta = parser.feed('{"name": "get_time", "arguments": {}}</tool_call>')
    assert delta.content == "" and delta.tool_calls[0].name == "get_time"
    assert parser.finish().content == ""  # trailing whitespace after calls is dropped


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>')
    parsed = parse_whole(HermesToolParser(TOOLS, parallel=False), text)
    assert [c.name for c in parsed.tool_calls] == ["get_time"] and parsed.content is None
    parsed = parse_whole(PythonicToolParser(TOOLS, parallel=False), "[get_time(), get_weather(city='A')]")
    assert [c.name for c in parsed.tool_calls] == ["get_time"]


def test_required_scanner_streams_arguments_as_they_come() -> None:
    text = ('[{"name": "get_weather", "arguments": {"city": "}{\\"[", "n": [1, {"x": 2}]}}, '
            '{"name": "get_time", "arguments": {}}]')
    for size in (1, 4, len(text)):
        content, calls = stream(RequiredToolsParser(TOOLS), text, size)
        assert content == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            ("get_weather", {"city": '}{"[', "n": [1, {"x": 2}]}), ("get_time", {})]
    parser = RequiredToolsParser(TOOLS)
    first = parser.feed('[{"name": "get_weather", "arguments": {"ci')
    assert first.tool_calls[0].name == "get_weather" and first.tool_calls[0].arguments == '{"ci'
    assert parser.feed('ty": "X"}}').tool_calls[0].arguments == 'ty": "X"}'  # not the closing brace of the item


def test_required_scanner_respects_parallel_false() -> None:
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}]'
    parsed = parse_whole(RequiredToolsParser(TOOLS, parallel=False), text)
    assert [c.name for c in parsed.tool_calls] == ["get_time"]


def test_named_parser_is_all_arguments() -> None:
    content, calls = stream(NamedToolParser("get_time"), '{"zone": "UTC"}', 3)
    assert content == "" and calls == {0: {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    assert parse_whole(NamedToolParser("get_time"), "").tool_calls[0].arguments == ""


def test_required_schema_accepts_calls_and_rejects_others() -> None:
    params = {"get_time": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
              "get_weather": None}
    schema = required_schema(params, parallel=True)
    jsonschema.validate([{"name": "get_time", "arguments": {"zone": "x"}},
                         {"name": "get_weather", "arguments": {}}], schema)
    for bad in ([], [{"name": "get_time", "arguments": {}}], [{"name": "nope", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema(params, parallel=False)
    assert single["maxItems"] == 1
    one = {"get_time": params["get_time"]}
    assert required_schema(one, parallel=True)["items"]["properties"]["name"] == {"const": "get_time"}


def test_registry() -> None:
    assert set(TOOL_PARSERS) >= {"hermes", "qwen", "llama3_json", "mistral", "pythonic"}
    assert get_tool_parser("qwen") is HermesToolParser
    assert MistralToolParser.needs_special_tokens and not HermesToolParser.needs_special_tokens
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_tool_parser("nope")
    parser = HermesToolParser(TOOLS)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("late")
