"""Llama 3.1 / 3.2 JSON tool calls: ``{"name": ..., "parameters": {...}}``, several joined by ``;``,
optionally after ``<|python_tag|>``."""

from __future__ import annotations

import json

from llmkube.serving.openai.tool_parsers.whole_message import WholeMessageToolParser

_PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonToolParser(WholeMessageToolParser):
    name = "llama3_json"

    def _looks_like_calls(self, text: str) -> bool | None:
        if text.startswith(("{", _PYTHON_TAG)):
            return True
        return None if _PYTHON_TAG.startswith(text) else False

    def _parse_calls(self, text: str) -> list[tuple[str, str]] | None:
        text = text.removeprefix(_PYTHON_TAG)
        calls: list[tuple[str, str]] = []
        pos = 0
        while True:
            while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
                pos += 1
            if pos >= len(text):
                break
            try:
                obj, pos = _DECODER.raw_decode(text, pos)
            except ValueError:
                return None
            call = self._valid_call(obj, args_key="parameters")
            if call is None:
                return None
            calls.append(call)
        return calls or None
