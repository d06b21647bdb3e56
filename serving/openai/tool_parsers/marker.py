"""Parsers for formats where calls follow a start marker inside the message.

Text before the marker streams as content (holding back what could be the start of a
marker); a call region is buffered until it is complete, then either becomes tool calls
(valid JSON naming a known tool) or is handed back verbatim as content and counted as a
parse failure. Whitespace that only separates calls is dropped.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable

from llmkube.serving.openai.tool_parsers.base import ParseDelta, ToolParser, held_prefix_len


class MarkerToolParser(ToolParser):
    start: str = ""

    def __init__(self, tool_names: Iterable[str], *, parallel: bool = True) -> None:
        super().__init__(tool_names, parallel=parallel)
        self._buf = ""
        self._in_call = False
        self._gap = ""  # whitespace between the text and a call: dropped unless the call is malformed

    @abstractmethod
    def _take_call(self, buf: str, final: bool) -> tuple[str, str, int] | None:
        """Once the call region at the start of ``buf`` is complete (or ``final``):
        ``(inner text, raw text to return as content if invalid, characters consumed)``;
        ``None`` to wait for more text."""

    @abstractmethod
    def _calls_from(self, inner: str) -> list[tuple[str, str]] | None:
        """The ``(name, arguments JSON)`` calls of a region, or ``None`` if malformed."""

    def _feed(self, text: str) -> ParseDelta:
        self._buf += text
        out = ParseDelta()
        self._drain(out, final=False)
        return out

    def _finish(self) -> ParseDelta:
        out = ParseDelta()
        self._drain(out, final=True)
        return out

    def _drain(self, out: ParseDelta, final: bool) -> None:
        while True:
            if self._in_call:
                taken = self._take_call(self._buf, final)
                if taken is None:
                    return
                inner, raw, consumed = taken
                self._buf = self._buf[consumed:]
                self._in_call = False
                calls = self._calls_from(inner)
                if calls is None:
                    self.parse_failures += 1
                    out.content += self._gap + raw
                else:
                    for name, arguments in calls:
                        self._emit_call(name, arguments, out)
                continue
            at = self._buf.find(self.start)
            if at >= 0:
                before = self._buf[:at]
                text = before.rstrip()
                out.content += text
                self._gap = before[len(text) :]
                self._buf = self._buf[at + len(self.start) :]
                self._in_call = True
                continue
            if final:
                if not (self.num_calls and not self._buf.strip()):
                    out.content += self._buf
                self._buf = ""
                return
            # Hold back a possible marker start and the whitespace before it (dropped if a call follows).
            cut = len(self._buf) - held_prefix_len(self._buf, self.start)
            cut = len(self._buf[:cut].rstrip())
            out.content += self._buf[:cut]
            self._buf = self._buf[cut:]
            return
