"""Request models, their conversion to SamplingParams, tool plans and message normalization (no server)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmkube.serving.engine.errors import InvalidRequestError
from llmkube.serving.engine.protocol import ModelInfo
from llmkube.serving.openai.errors import OpenAIError, from_exception
from llmkube.serving.openai.messages import to_template_messages
from llmkube.serving.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    resolve_max_tokens,
)
from llmkube.serving.openai.structured import from_response_format, from_structured_outputs
from llmkube.serving.openai.tool_choice import plan_tools

INFO = ModelInfo(max_model_len=100, vocab_size=1000, eos_token_ids=frozenset({1}), architecture="test")
MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, json.dumps({"model": "m", "messages": MSGS, **fields}).encode())


def completion(**fields: Any) -> CompletionRequest:
    return parse_request(CompletionRequest, json.dumps({"model": "m", "prompt": "x", **fields}).encode())


def bad(body: bytes | dict[str, Any], model: type = ChatCompletionRequest) -> OpenAIError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(OpenAIError) as err:
        parse_request(model, raw)
    assert err.value.status_code == 400
    return err.value


def test_shape_errors_name_the_field() -> None:
    assert bad({"messages": MSGS}).param == "model"
    assert "Missing required parameter: 'model'" in bad({"messages": MSGS}).message
    err = bad({"model": "m", "messages": MSGS, "temperature": "warm"})
    assert err.param == "temperature" and err.code == "invalid_type"
    assert bad({"model": "m", "messages": MSGS, "n": True}).param == "n"  # a boolean is not an integer
    err = bad({"model": "m", "messages": MSGS, "max_token": 5})
    assert err.param == "max_token" and "Unrecognized request argument" in err.message
    assert bad({"model": "m", "messages": [{"content": "x"}]}).param == "messages[0].role"
    assert bad({"model": "m", "messages": []}).code == "empty_array"
    assert bad(b"{").code == "invalid_json"
    assert bad(b"[]").message == "The request body must be a JSON object."
    assert bad({"model": "m", "prompt": {"a": 1}}, CompletionRequest).param == "prompt"
    assert bad({"model": "m", "messages": MSGS, "stream_options": {"nope": 1}}).param == "stream_options.nope"


def test_chat_sampling_params() -> None:
    req = chat(temperature=0, top_p=0, stop="END", logit_bias={"5": -100}, seed=3, n=2, logprobs=True,
               top_logprobs=4, presence_penalty=0.5, frequency_penalty=-0.5, max_completion_tokens=7,
               top_k=5, min_p=0.1, repetition_penalty=1.2, min_tokens=2, stop_token_ids=[9],
               include_stop_str_in_output=True, ignore_eos=True, skip_special_tokens=False)
    req.check()
    p = req.to_sampling_params(10, INFO)
    assert (p.temperature, p.stop, p.logit_bias, p.seed, p.n, p.logprobs) == (0.0, ["END"], {5: -100.0}, 3, 2, 4)
    assert 0 < p.top_p < 1e-6  # OpenAI's top_p=0 means "the most likely token only"
    assert (p.presence_penalty, p.frequency_penalty, p.max_tokens) == (0.5, -0.5, 7)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens, p.stop_token_ids) == (5, 0.1, 1.2, 2, [9])
    assert p.include_stop_str_in_output and p.ignore_eos and not p.skip_special_tokens
    defaults = chat().to_sampling_params(10, INFO)
    assert (defaults.temperature, defaults.top_p, defaults.logprobs, defaults.max_tokens) == (1.0, 1.0, None, 90)
    assert chat(logprobs=True).to_sampling_params(10, INFO).logprobs == 0
    assert chat(max_tokens=5).to_sampling_params(10, INFO).max_tokens == 5


def test_completion_max_tokens_default_and_context() -> None:
    assert completion().to_sampling_params(10, INFO).max_tokens == 16
    assert completion().to_sampling_params(95, INFO).max_tokens == 5  # the default fits into the context
    assert completion(max_tokens=None).to_sampling_params(10, INFO).max_tokens == 90
    with pytest.raises(InvalidRequestError) as err:
        completion(max_tokens=50).to_sampling_params(60, INFO)
    assert err.value.param == "max_tokens" and "110 tokens (60 in the prompt, 50 in the completion)" in str(err.value)
    with pytest.raises(InvalidRequestError, match="resulted in 100 tokens"):
        completion().to_sampling_params(100, INFO)
    p = completion(echo=True, logprobs=2).to_sampling_params(10, INFO)
    assert p.logprobs == 2 and p.prompt_logprobs == 2
    assert completion(logprobs=2).to_sampling_params(10, INFO).prompt_logprobs is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_completion_checks(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        completion(**fields).check()
    assert err.value.param == param


@pytest.mark.parametrize(("fields", "param"), [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
])
def test_chat_checks(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        chat(**fields).check()
    assert err.value.param == param


def test_bookkeeping_fields_are_accepted() -> None:
    chat(user="u", metadata={"a": "b"}, store=False, service_tier="auto", safety_identifier="s",
         prompt_cache_key="k", modalities=["text"], stream=True,
         stream_options={"include_usage": True, "include_obfuscation": False}).check()


def test_engine_validation_surfaces_as_400() -> None:
    for fields, param in [({"temperature": 2.5}, "temperature"), ({"top_p": 1.5}, "top_p"),
                          ({"logit_bias": {"5000": 1}}, "logit_bias"), ({"stop_token_ids": [-1]}, "stop_token_ids")]:
        with pytest.raises(InvalidRequestError) as err:
            chat(**fields).to_sampling_params(10, INFO)
        assert err.value.param == param
        mapped = from_exception(err.value)
        assert mapped.status_code == 400 and mapped.param == param


def test_resolve_max_tokens() -> None:
    assert resolve_max_tokens(None, 10, 100, param="max_tokens", what="messages") == 90
    assert resolve_max_tokens(None, 10, 100, param="max_tokens", what="messages", default=16) == 16
    with pytest.raises(InvalidRequestError, match=r"requested 101 tokens \(10 in the messages, 91"):
        resolve_max_tokens(91, 10, 100, param="max_tokens", what="messages")


def test_response_formats() -> None:
    assert not from_response_format(None).is_set
    assert not from_response_format({"type": "text"}).is_set
    assert from_response_format({"type": "json_object"}).json_object
    schema = {"type": "object"}
    assert from_response_format({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
                                ).json_schema == schema
    for fmt, param in [({"type": "yaml"}, "response_format.type"),
                       ({"type": "json_schema"}, "response_format.json_schema"),
                       ({"type": "json_schema", "json_schema": {"name": "bad name", "schema": schema}},
                        "response_format.json_schema.name"),
                       ({"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}},
                        "response_format.json_schema.schema")]:
        with pytest.raises(InvalidRequestError) as err:
            from_response_format(fmt)
        assert err.value.param == param
    choice = from_structured_outputs({"choice": ["a.b", "c (d)"]})
    assert choice.regex == r"(a\.b|c \(d\))"
    assert from_structured_outputs({"json": '{"type": "integer"}'}).json_schema == {"type": "integer"}
    assert from_structured_outputs({"grammar": 'root ::= "x"'}).grammar == 'root ::= "x"'
    with pytest.raises(InvalidRequestError):
        from_structured_outputs({"regex": "a", "grammar": "b"})
    with pytest.raises(InvalidRequestError):
        chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}).to_sampling_params(5, INFO)


TOOLS = [
    {"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "b", "description": "bee"}},
]


def test_tool_plans() -> None:
    assert plan_tools(None, None, None, auto_parser_available=True).mode == "none"
    auto = plan_tools(TOOLS, None, None, auto_parser_available=True)
    assert auto.mode == "auto" and auto.structured is None and [t["function"]["name"] for t in auto.tools] == ["a", "b"]
    required = plan_tools(TOOLS, "required", False, auto_parser_available=True)
    schema = required.structured.json_schema  # type: ignore[union-attr]
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "b"}}, None, auto_parser_available=False)
    assert named.mode == "named" and named.structured.json_schema == {"type": "object", "properties": {}}  # type: ignore[union-attr]
    assert len(named.tools) == 2  # the template still sees every tool
    allowed = plan_tools(TOOLS, {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "a"}}]}}, None,
        auto_parser_available=True)
    assert allowed.mode == "required" and list(allowed.callable) == ["a"]
    none = plan_tools(TOOLS, "none", None, auto_parser_available=True)
    assert none.mode == "none" and none.make_parser(None) is None and none.tools


@pytest.mark.parametrize(("tools", "choice", "param"), [
    (None, "auto", "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "zzz"}}, "tool_choice.function.name"),
    (TOOLS, {"type": "function"}, "tool_choice.function.name"),
    ([TOOLS[0], TOOLS[0]], None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "x", "parameters": "nope"}}], None, "tools[0].function.parameters"),
    ([{"type": "web_search"}], None, "tools[0].type"),
])
def test_tool_plan_errors(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        plan_tools(tools, choice, None, auto_parser_available=True)
    assert err.value.param == param


def test_auto_needs_a_parser() -> None:
    with pytest.raises(InvalidRequestError, match="tool-call-parser"):
        plan_tools(TOOLS, "auto", None, auto_parser_available=False)


def test_messages_normalization() -> None:
    req = chat(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "q", "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
         "reasoning_content": "hmm"},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ])
    out = to_template_messages(req.messages)
    assert out[0] == {"role": "system", "content": "a\nb"}
    assert out[1] == {"role": "user", "content": "q", "name": "bob"}
    assert out[2]["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}, "id": "c1"}]
    assert out[2]["content"] is None and out[2]["reasoning_content"] == "hmm"
    assert out[3] == {"role": "tool", "content": "42", "tool_call_id": "c1"}


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "function", "content": "x"}, "messages[0].role"),
    ({"role": "user"}, "messages[0].content"),
    ({"role": "assistant"}, "messages[0].content"),
    ({"role": "user", "content": []}, "messages[0].content"),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, "messages[0].content[0].type"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0].text"),
    ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]},
     "messages[0].tool_calls[0].function.name"),
])
def test_message_errors(message: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        to_template_messages(chat(messages=[message]).messages)
    assert err.value.param == param


def test_api_layer_imports_no_torch() -> None:
    """The ingress (and Ray's router, which reuses it) must stay free of torch, transformers and xgrammar."""
    import subprocess
    import sys

    code = ("import sys, llmkube.serving.openai.app, llmkube.serving.cli; "
            "print(sorted(m for m in ('torch', 'transformers', 'xgrammar') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
