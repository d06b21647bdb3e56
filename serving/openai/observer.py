"""Hooks the API layer calls as requests finish, for metrics (the metrics module implements them)."""

from __future__ import annotations

from typing import Protocol


class RequestObserver(Protocol):
    def choice_finished(self, model: str, endpoint: str, finish_reason: str) -> None:
        """One choice ended with ``finish_reason`` (stop | length | tool_calls)."""

    def tool_calls_parsed(self, model: str, parser: str, num_calls: int) -> None:
        """A choice's output held ``num_calls`` well-formed tool calls."""

    def tool_parse_failed(self, model: str, parser: str) -> None:
        """Tool-call markup in a choice's output was malformed and returned as content."""


class NullObserver:
    def choice_finished(self, model: str, endpoint: str, finish_reason: str) -> None:
        pass

    def tool_calls_parsed(self, model: str, parser: str, num_calls: int) -> None:
        pass

    def tool_parse_failed(self, model: str, parser: str) -> None:
        pass
