"""Our chat-template renderer against transformers' ``apply_chat_template`` (the reference)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from llmkube.serving.engine.errors import InvalidRequestError
from llmkube.serving.engine.tokenizer import Tokenizer
from llmkube.serving.openai.chat_template import ChatTemplate
from llmkube.serving.openai.messages import to_template_messages
from llmkube.serving.openai.protocol import ChatCompletionRequest

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'Weather <now> & "later", in °C',
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERSATIONS: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ("single user", [{"role": "user", "content": "Hello!"}], None),
    ("system and turns", [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Ünïcödé ✓ 世界"},
    ], None),
    ("tools, calls and results", [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        ]},
        {"role": "tool", "tool_call_id": "a", "content": "21"},
        {"role": "tool", "tool_call_id": "b", "content": "9"},
    ], [WEATHER_TOOL]),
    ("tools with a system prompt", [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "?"},
    ], [WEATHER_TOOL]),
    ("content parts", [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
     None),
]


@pytest.fixture(scope="module")
def hf_tokenizer(qwen2_tiny: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(qwen2_tiny))


@pytest.fixture(scope="module")
def ours(qwen2_tiny: Path) -> ChatTemplate:
    tokenizer = Tokenizer.from_pretrained(qwen2_tiny)
    assert tokenizer.chat_template
    return ChatTemplate(tokenizer.chat_template, {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token})


@pytest.mark.parametrize(("name", "messages", "tools"), CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_checkpoint_template_matches_transformers(hf_tokenizer: Any, ours: ChatTemplate, name: str,
                                                  messages: list[dict[str, Any]], tools: Any,
                                                  add_generation_prompt: bool) -> None:
    expected = hf_tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                tokenize=False)
    assert ours.render(messages, tools=tools, add_generation_prompt=add_generation_prompt) == expected


def test_openai_request_renders_like_transformers(hf_tokenizer: Any, ours: ChatTemplate) -> None:
    """The whole path: an OpenAI request (arguments as a JSON string) -> template messages -> prompt."""
    body = {"model": "m", "tools": [WEATHER_TOOL], "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "30"},
    ]}
    req = ChatCompletionRequest.model_validate_json(json.dumps(body))
    rendered = ours.render(to_template_messages(req.messages), tools=body["tools"])
    reference = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "30"},
    ]
    expected = hf_tokenizer.apply_chat_template(reference, tools=body["tools"], add_generation_prompt=True,
                                                tokenize=False)
    assert rendered == expected
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in rendered


def test_continue_final_message_matches_transformers(hf_tokenizer: Any, ours: ChatTemplate) -> None:
    messages = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two,"}]
    expected = hf_tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    rendered = ours.render(messages, continue_final_message=True)
    assert rendered == expected and rendered.endswith("one, two,")


# A template exercising what Hub templates use: whitespace control, namespace, loop controls,
# tojson with options, strftime_now, raise_exception, the generation tag and special tokens.
FEATURE_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(n=0, sys='') %}
{%- for m in messages %}
    {%- if m.role == 'system' %}{% set ns.sys = m.content %}{% continue %}{% endif %}
    {%- if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
    {%- set ns.n = ns.n + 1 %}
<|{{ m.role }}|>
    {% if m.role == 'assistant' %}{% generation %}{{ m.content | trim }}{% endgeneration %}{% else %}
{{- m.content }}{% endif %}
{{ eos_token }}
{%- endfor %}
{%- if tools %}
TOOLS: {{ tools | tojson(indent=2) }}
{%- endif %}
SYS={{ ns.sys }} N={{ ns.n }} DATE={{ strftime_now('%Y') }} D={{ dict(a=1) | tojson(sort_keys=True) }}
{%- if add_generation_prompt %}
<|assistant|>
{% endif %}"""


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_hub_template_features_match_transformers(add_generation_prompt: bool) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "<b>&</b>"},
                {"role": "assistant", "content": "  ok  "}]
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    ours = ChatTemplate(FEATURE_TEMPLATE, tokens).render(messages, tools=[WEATHER_TOOL],
                                                         add_generation_prompt=add_generation_prompt)
    (expected,), _ = render_jinja_template(conversations=[messages], tools=[WEATHER_TOOL],
                                           chat_template=FEATURE_TEMPLATE,
                                           add_generation_prompt=add_generation_prompt, **tokens)
    assert ours == expected
    assert "<b>&</b>" in ours and "°C" in ours  # tojson neither HTML-escapes nor ASCII-escapes


def test_template_errors_are_client_errors() -> None:
    template = ChatTemplate(FEATURE_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(InvalidRequestError, match="bad role tool") as err:
        template.render([{"role": "tool", "content": "x"}])
    assert err.value.param == "messages"
    sandbox = ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", {})
    with pytest.raises(InvalidRequestError):
        sandbox.render([{"role": "user", "content": "x"}])
    escaping = ChatTemplate("{% set ns = namespace() %}{% set ns._secret = 1 %}", {})
    with pytest.raises(InvalidRequestError):
        escaping.render([])
    with pytest.raises(InvalidRequestError, match="continue_final_message"):
        template.render([{"role": "user", "content": None}], continue_final_message=True)


def test_named_template_set_uses_tool_use_variant() -> None:
    templates = {"default": "plain", "tool_use": "tools:{{ tools | length }}"}
    template = ChatTemplate(templates, {})
    assert template.render([]) == "plain"
    assert template.render([], tools=[WEATHER_TOOL]) == "tools:1"
    with pytest.raises(ValueError, match="default"):
        ChatTemplate({"tool_use": "x"}, {})
