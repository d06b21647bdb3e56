"""Tool-call parsers, chosen per model with ``--tool-call-parser``."""

from __future__ import annotations

from llmkube.serving.openai.tool_parsers.base import (
    ParseDelta,
    ParsedMessage,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    parse_whole,
)
from llmkube.serving.openai.tool_parsers.guided import NamedToolParser, RequiredToolsParser, required_schema
from llmkube.serving.openai.tool_parsers.hermes import HermesToolParser
from llmkube.serving.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from llmkube.serving.openai.tool_parsers.mistral import MistralToolParser
from llmkube.serving.openai.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None


__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedToolParser",
    "ParseDelta",
    "ParsedMessage",
    "PythonicToolParser",
    "RequiredToolsParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
    "parse_whole",
    "required_schema",
]
