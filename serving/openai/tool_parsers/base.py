"""What every tool-call parser is: a streaming splitter of model text into content and calls.

A parser is fed the model's text delta by delta and answers, each time, the content to
show and the tool-call deltas to send (OpenAI's streaming shape, keyed by ``index``: the
first delta of a call carries ``id`` and ``name``, later ones argument fragments).
Non-streaming responses run the same parser over the whole text in one ``feed`` and
``finish``, so a stream and a non-stream answer of the same text always agree.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


@dataclass
class ParseDelta:
    """What one ``feed``/``finish`` produced."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedMessage:
    content: str | None
    tool_calls: list[ToolCall]
    parse_failures: int


class ToolParser(ABC):
    """Base of the streaming parsers. Subclasses implement ``_feed`` and ``_finish``."""

    name: str = ""
    # Parsers whose markers are special tokens need them kept in the decoded text.
    needs_special_tokens: bool = False

    def __init__(self, tool_names: Iterable[str], *, parallel: bool = True) -> None:
        self.tool_names = frozenset(tool_names)
        self.parallel = parallel
        self.parse_failures = 0
        self._num_calls = 0
        self._finished = False

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str) -> ParseDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        return self._feed(text) if text else ParseDelta()

    def finish(self) -> ParseDelta:
        if self._finished:
            return ParseDelta()
        self._finished = True
        return self._finish()

    @abstractmethod
    def _feed(self, text: str) -> ParseDelta: ...

    @abstractmethod
    def _finish(self) -> ParseDelta: ...

    # -- helpers for subclasses --------------------------------------------------------------

    def _accepts_more_calls(self) -> bool:
        return self.parallel or self._num_calls == 0

    def _emit_call(self, name: str, arguments: str, out: ParseDelta) -> None:
        """A complete call: one delta with id, name and all arguments (dropped past the first
        call when ``parallel_tool_calls`` is false)."""
        if not self._accepts_more_calls():
            return
        out.tool_calls.append(ToolCallDelta(self._num_calls, arguments, new_call_id(), name))
        self._num_calls += 1

    def _valid_call(self, obj: Any, args_key: str = "arguments") -> tuple[str, str] | None:
        """``{"name": <known tool>, <args_key>: {...}}`` -> (name, arguments JSON), else None."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        name = obj["name"]
        if name not in self.tool_names:
            return None
        args = obj.get(args_key, obj.get("arguments", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return name, json.dumps(args, ensure_ascii=False)


def parse_whole(parser: ToolParser, text: str) -> ParsedMessage:
    """Run a parser over a complete text and gather its deltas into a message."""
    deltas = [parser.feed(text), parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        for c in d.tool_calls:
            if c.index not in calls:
                calls[c.index] = ToolCall(c.id or new_call_id(), c.name or "", "")
            calls[c.index].arguments += c.arguments
    tool_calls = [calls[i] for i in sorted(calls)]
    if tool_calls and not content.strip():
        content_out: str | None = None
    else:
        content_out = content
    return ParsedMessage(content_out, tool_calls, parser.parse_failures)


def held_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
