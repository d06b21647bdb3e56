"""Pythonic tool calls (Llama 3.2 / Llama 4 style): ``[get_weather(city="Paris"), f(x=1)]``.

Only literal keyword arguments are accepted; the expression is parsed with ``ast``, never
evaluated.
"""

from __future__ import annotations

import ast
import json

from llmkube.serving.openai.tool_parsers.whole_message import WholeMessageToolParser

_WRAPPERS = ("<|python_start|>", "<|python_end|>")


class PythonicToolParser(WholeMessageToolParser):
    name = "pythonic"

    def _looks_like_calls(self, text: str) -> bool | None:
        if text.startswith(("[", _WRAPPERS[0])):
            return True
        return None if _WRAPPERS[0].startswith(text) else False

    def _parse_calls(self, text: str) -> list[tuple[str, str]] | None:
        text = text.removeprefix(_WRAPPERS[0]).removesuffix(_WRAPPERS[1]).strip()
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError:
            return None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls: list[tuple[str, str]] = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            name = node.func.id
            if name not in self.tool_names:
                return None
            arguments: dict[str, object] = {}
            for keyword in node.keywords:
                if keyword.arg is None:
                    return None
                try:
                    arguments[keyword.arg] = ast.literal_eval(keyword.value)
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    return None
            try:
                calls.append((name, json.dumps(arguments, ensure_ascii=False)))
            except (TypeError, ValueError):
                return None  # e.g. a set or bytes literal: not JSON
        return calls
