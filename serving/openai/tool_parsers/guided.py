"""Tool calls the engine's grammar forces (``tool_choice`` "required" or a named function).

Rather than each model's native markup, the grammar makes the model write plain JSON
(as vLLM does), so the same constraint works for every parser and model:

* named function: the output *is* the arguments object, constrained by its ``parameters``;
* "required": ``[{"name": <one of the tools>, "arguments": {...}}, ...]`` (``maxItems: 1``
  when ``parallel_tool_calls`` is false), each item constrained by its tool's schema.

The output is valid by construction, so arguments stream token by token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from llmkube.serving.openai.tool_parsers.base import ParseDelta, ToolCallDelta, ToolParser, new_call_id

_EMPTY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_schema(parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(parameters) if parameters else dict(_EMPTY_OBJECT_SCHEMA)


def required_schema(tools: Mapping[str, Mapping[str, Any] | None], *, parallel: bool) -> dict[str, Any]:
    """JSON schema of a non-empty array of calls to the given ``{name: parameters}``."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters_schema(params)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, params in tools.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {
        "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedToolParser(ToolParser):
    """The whole output is the arguments of one named call."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        super().__init__([function_name], parallel=False)
        self.function_name = function_name
        self._started = False

    def _feed(self, text: str) -> ParseDelta:
        if not self._started:
            self._started = True
            self._num_calls = 1
            return ParseDelta(tool_calls=[ToolCallDelta(0, text, new_call_id(), self.function_name)])
        return ParseDelta(tool_calls=[ToolCallDelta(0, text)])

    def _finish(self) -> ParseDelta:
        if not self._started:  # nothing generated at all: still one (empty) call
            self._started = True
            self._num_calls = 1
            return ParseDelta(tool_calls=[ToolCallDelta(0, "", new_call_id(), self.function_name)])
        return ParseDelta()


class _CallSpan:
    __slots__ = ("announced", "args_emitted", "args_end", "args_start", "name")

    def __init__(self) -> None:
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.args_emitted = 0  # absolute position up to which arguments were sent
        self.announced = False


class RequiredToolsParser(ToolParser):
    """Incremental scanner of ``[{"name": ..., "arguments": {...}}, ...]``."""

    name = "required"

    def __init__(self, tool_names: Iterable[str], *, parallel: bool = True) -> None:
        super().__init__(tool_names, parallel=parallel)
        self._text = ""
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._string_start = 0
        self._key: str | None = None
        self._expect_value = False
        self._spans: list[_CallSpan] = []

    def _feed(self, text: str) -> ParseDelta:
        self._text += text
        self._scan()
        return self._emit()

    def _finish(self) -> ParseDelta:
        return self._emit()

    def _scan(self) -> None:
        text = self._text
        for i in range(self._pos, len(text)):
            ch = text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    self._string_done(text[self._string_start : i + 1])
                continue
            if ch == '"':
                self._in_string = True
                self._string_start = i
                if self._depth == 2 and self._expect_value and self._key == "arguments":
                    self._spans[-1].args_start = i
            elif ch in "{[":
                if self._depth == 1 and ch == "{":
                    self._spans.append(_CallSpan())
                    self._key, self._expect_value = None, False
                elif self._depth == 2 and self._expect_value and self._key == "arguments":
                    self._spans[-1].args_start = i
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                span = self._spans[-1] if self._spans else None
                if self._depth == 2 and span and span.args_start is not None and span.args_end is None:
                    span.args_end = i + 1
            elif self._depth == 2 and ch == ":":
                self._expect_value = True
            elif self._depth == 2 and ch == ",":
                self._key, self._expect_value = None, False
        self._pos = len(text)

    def _string_done(self, literal: str) -> None:
        if self._depth != 2 or not self._spans:
            return
        span = self._spans[-1]
        value = json.loads(literal)
        if not self._expect_value:
            self._key = value
        elif self._key == "name":
            span.name = value
        elif self._key == "arguments" and span.args_end is None and span.args_start is not None:
            span.args_end = span.args_start + len(literal)  # arguments given as a JSON string

    def _emit(self) -> ParseDelta:
        out = ParseDelta()
        for index, span in enumerate(self._spans):
            if span.name is None:
                break  # later calls cannot be announced before this one
            if not self.parallel and index > 0:
                break
            delta = ToolCallDelta(index)
            if not span.announced:
                span.announced = True
                delta.id, delta.name = new_call_id(), span.name
                self._num_calls += 1
            if span.args_start is not None:
                end = span.args_end if span.args_end is not None else len(self._text)
                begin = max(span.args_start, span.args_emitted)
                if end > begin:
                    delta.arguments = self._text[begin:end]
                    span.args_emitted = end
            if delta.id is not None or delta.arguments:
                out.tool_calls.append(delta)
        return out
