"""Parsers for formats where the whole message is either text or a list of calls.

The first non-blank characters decide; a message that looks like calls is buffered to the
end and parsed once (falling back to content, counted as a parse failure, if malformed).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable

from llmkube.serving.openai.tool_parsers.base import ParseDelta, ToolParser


class WholeMessageToolParser(ToolParser):
    def __init__(self, tool_names: Iterable[str], *, parallel: bool = True) -> None:
        super().__init__(tool_names, parallel=parallel)
        self._buf = ""
        self._mode: str | None = None  # None (undecided), "content" or "calls"

    @abstractmethod
    def _looks_like_calls(self, text: str) -> bool | None:
        """Decide from the (left-stripped, non-empty) start: True, False, or None to wait."""

    @abstractmethod
    def _parse_calls(self, text: str) -> list[tuple[str, str]] | None: ...

    def _feed(self, text: str) -> ParseDelta:
        if self._mode == "content":
            return ParseDelta(content=text)
        self._buf += text
        stripped = self._buf.lstrip()
        if self._mode is None and stripped:
            decided = self._looks_like_calls(stripped)
            if decided is False:
                self._mode = "content"
                out, self._buf = ParseDelta(content=self._buf), ""
                return out
            if decided:
                self._mode = "calls"
        return ParseDelta()

    def _finish(self) -> ParseDelta:
        out = ParseDelta()
        if self._mode == "calls":
            calls = self._parse_calls(self._buf.strip())
            if calls is not None:
                for name, arguments in calls:
                    self._emit_call(name, arguments, out)
                return out
            self.parse_failures += 1
        out.content = self._buf
        self._buf = ""
        return out
