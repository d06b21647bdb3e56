"""Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

``[TOOL_CALLS]`` is a special token, so this parser asks for special tokens to be kept
in the decoded text.
"""

from __future__ import annotations

import json

from llmkube.serving.openai.tool_parsers.marker import MarkerToolParser

_DECODER = json.JSONDecoder()


class MistralToolParser(MarkerToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"
    needs_special_tokens = True

    def _take_call(self, buf: str, final: bool) -> tuple[str, str, int] | None:
        body = buf.lstrip()
        try:
            _, end = _DECODER.raw_decode(body)
        except ValueError:
            return (buf, self.start + buf, len(buf)) if final else None
        consumed = len(buf) - len(body) + end
        return buf[:consumed], self.start + buf[:consumed], consumed

    def _calls_from(self, inner: str) -> list[tuple[str, str]] | None:
        try:
            obj = json.loads(inner)
        except ValueError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        calls = [self._valid_call(item) for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]
