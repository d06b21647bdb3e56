"""Hermes / Qwen 2.5 / Qwen 3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import json

from llmkube.serving.openai.tool_parsers.marker import MarkerToolParser


class HermesToolParser(MarkerToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def _take_call(self, buf: str, final: bool) -> tuple[str, str, int] | None:
        at = buf.find(self.end)
        if at >= 0:
            return buf[:at], self.start + buf[: at + len(self.end)], at + len(self.end)
        if final:  # the model stopped without closing the tag: parse what it wrote
            return buf, self.start + buf, len(buf)
        return None

    def _calls_from(self, inner: str) -> list[tuple[str, str]] | None:
        try:
            obj = json.loads(inner)
        except ValueError:
            return None
        call = self._valid_call(obj)
        return None if call is None else [call]
