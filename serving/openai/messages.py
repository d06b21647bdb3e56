"""Chat messages as sent -> the plain dicts a Hugging Face chat template expects.

Checks what OpenAI checks (known roles, required content, text-only parts, well-formed
``tool_calls``) and normalizes the rest the way vLLM does: text parts are joined with
newlines, ``developer`` becomes ``system`` (templates do not know it), and tool-call
``arguments`` strings are decoded to objects so templates can ``tojson`` them.
"""

from __future__ import annotations

import json
from typing import Any

from llmkube.serving.engine.errors import InvalidRequestError
from llmkube.serving.openai.protocol import ChatMessage

ROLES = ("system", "developer", "user", "assistant", "tool")
_TEXT_PART_TYPES = {"text", "input_text"}
_MEDIA_PART_TYPES = {"image_url", "input_audio", "file", "input_image", "audio_url", "video_url"}


def to_template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [_convert(i, m) for i, m in enumerate(messages)]


def _convert(i: int, message: ChatMessage) -> dict[str, Any]:
    where = f"messages[{i}]"
    role = message.role
    if role not in ROLES:
        raise InvalidRequestError(
            f"Invalid value for '{where}.role': {role!r}. Supported values are: "
            + ", ".join(f"'{r}'" for r in ROLES)
            + ".",
            f"{where}.role",
        )
    out: dict[str, Any] = dict(message.model_extra or {})
    out["role"] = "system" if role == "developer" else role
    content = _content_text(where, role, message.content)
    has_calls = bool(message.tool_calls)
    if content is None and not (role == "assistant" and has_calls):
        raise InvalidRequestError(
            f"Invalid value for '{where}.content': expected a string or an array of text parts, got null.",
            f"{where}.content",
        )
    out["content"] = content
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls is not None:
        if role != "assistant":
            raise InvalidRequestError(
                f"'{where}.tool_calls' is only allowed on assistant messages.", f"{where}.tool_calls"
            )
        out["tool_calls"] = [_tool_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(message.tool_calls)]
    if role == "tool":
        if not message.tool_call_id:
            raise InvalidRequestError(
                f"Missing required parameter: '{where}.tool_call_id'.", f"{where}.tool_call_id"
            )
        out["tool_call_id"] = message.tool_call_id
    elif message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _content_text(where: str, role: str, content: str | list[Any] | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not content:
        raise InvalidRequestError(
            f"Invalid '{where}.content': an array of content parts must not be empty.", f"{where}.content"
        )
    texts: list[str] = []
    for j, part in enumerate(content):
        param = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise InvalidRequestError(f"Invalid type for '{param}': expected an object.", param)
        kind = part.get("type")
        if kind in _TEXT_PART_TYPES or (kind == "refusal" and role == "assistant"):
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                key = "refusal" if kind == "refusal" else "text"
                raise InvalidRequestError(f"Missing required parameter: '{param}.{key}'.", f"{param}.{key}")
            texts.append(text)
        elif kind in _MEDIA_PART_TYPES:
            raise InvalidRequestError(
                f"Content parts of type '{kind}' are not supported: the served model accepts text only.",
                f"{param}.type",
            )
        else:
            raise InvalidRequestError(
                f"Invalid value for '{param}.type': {kind!r}. Supported values are: 'text'.", f"{param}.type"
            )
    return "\n".join(texts)


def _tool_call(param: str, call: Any) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise InvalidRequestError(f"Invalid type for '{param}': expected an object.", param)
    if call.get("type", "function") != "function":
        raise InvalidRequestError(
            f"Invalid value for '{param}.type': only 'function' tool calls are supported.", f"{param}.type"
        )
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"Missing required parameter: '{param}.function.name'.", f"{param}.function.name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            decoded = arguments  # rendered verbatim by templates that accept strings
        arguments = decoded
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
