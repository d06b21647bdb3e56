"""``tools`` + ``tool_choice`` + ``parallel_tool_calls`` -> one plan for the chat handler.

The plan says which tools the template sees, whether output is parsed for calls (and by
which parser), and, for "required" / a named function, the JSON schema the engine's
grammar must enforce.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from llmkube.serving.engine.errors import InvalidRequestError
from llmkube.serving.openai.structured import StructuredOutput
from llmkube.serving.openai.tool_parsers import NamedToolParser, RequiredToolsParser, ToolParser, required_schema
from llmkube.serving.openai.tool_parsers.guided import parameters_schema

Mode = Literal["none", "auto", "required", "named"]
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    tools: list[dict[str, Any]] = field(default_factory=list)  # what the template renders
    callable: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # name -> parameters
    named: str | None = None
    parallel: bool = True

    @property
    def structured(self) -> StructuredOutput | None:
        """The grammar constraint for forced calls, else ``None``."""
        if self.mode == "named":
            assert self.named is not None
            return StructuredOutput(json_schema=parameters_schema(self.callable[self.named]))
        if self.mode == "required":
            return StructuredOutput(json_schema=required_schema(self.callable, parallel=self.parallel))
        return None

    def make_parser(self, auto_parser: type[ToolParser] | None) -> ToolParser | None:
        if self.mode == "named":
            assert self.named is not None
            return NamedToolParser(self.named)
        if self.mode == "required":
            return RequiredToolsParser(self.callable, parallel=self.parallel)
        if self.mode == "auto" and auto_parser is not None:
            return auto_parser(self.callable, parallel=self.parallel)
        return None


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    *,
    auto_parser_available: bool,
) -> ToolPlan:
    functions = _functions(tools or [])
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"Invalid value for 'tool_choice': {tool_choice!r}. Supported values are: 'none', 'auto' "
                "and 'required', or an object naming a function.",
                "tool_choice",
            )
        if tool_choice != "none" and not functions:
            raise InvalidRequestError(
                "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
                "tool_choice",
            )
        mode: Mode = tool_choice  # type: ignore[assignment]
        return _plan(mode, functions, functions, None, parallel, auto_parser_available)
    kind = tool_choice.get("type")
    if kind == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidRequestError("Missing required parameter: 'tool_choice.function.name'.",
                                      "tool_choice.function.name")
        if name not in functions:
            raise InvalidRequestError(
                f"Invalid value for 'tool_choice': function {name!r} is not among the provided tools.",
                "tool_choice.function.name",
            )
        return ToolPlan("named", _as_tools(functions), _params(functions), name, False)
    if kind == "allowed_tools":
        allowed = tool_choice.get("allowed_tools")
        if not isinstance(allowed, dict) or allowed.get("mode") not in ("auto", "required"):
            raise InvalidRequestError(
                "tool_choice.allowed_tools must be an object with mode 'auto' or 'required' and a tools list.",
                "tool_choice.allowed_tools",
            )
        names = []
        for j, ref in enumerate(allowed.get("tools") or []):
            ref_fn = ref.get("function") if isinstance(ref, dict) else None
            name = ref_fn.get("name") if isinstance(ref_fn, dict) else None
            if name not in functions:
                raise InvalidRequestError(
                    f"tool_choice.allowed_tools.tools[{j}] does not name a provided function tool.",
                    f"tool_choice.allowed_tools.tools[{j}]",
                )
            names.append(name)
        if not names:
            raise InvalidRequestError("tool_choice.allowed_tools.tools must not be empty.",
                                      "tool_choice.allowed_tools.tools")
        subset = {n: functions[n] for n in names}
        return _plan(allowed["mode"], functions, subset, None, parallel, auto_parser_available)
    if kind == "custom":
        raise InvalidRequestError("Custom tools are not supported; use function tools.", "tool_choice")
    raise InvalidRequestError(
        f"Invalid value for 'tool_choice.type': {kind!r}. Supported values are: 'function' and 'allowed_tools'.",
        "tool_choice.type",
    )


def _plan(
    mode: Mode,
    rendered: dict[str, dict[str, Any]],
    callable_: dict[str, dict[str, Any]],
    named: str | None,
    parallel: bool,
    auto_parser_available: bool,
) -> ToolPlan:
    if mode == "auto" and not auto_parser_available:
        raise InvalidRequestError(
            "tool_choice 'auto' needs a tool-call parser; start the server with --tool-call-parser.",
            "tool_choice",
        )
    return ToolPlan(mode, _as_tools(rendered), _params(callable_), named, parallel)


def _as_tools(functions: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": f} for f in functions.values()]


def _params(functions: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    return {name: f.get("parameters") for name, f in functions.items()}


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type")
        if kind == "custom":
            raise InvalidRequestError(f"{where}: custom tools are not supported; use function tools.",
                                      f"{where}.type")
        if kind != "function":
            raise InvalidRequestError(
                f"Invalid value for '{where}.type': {kind!r}. Supported values are: 'function'.", f"{where}.type"
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError(f"Missing required parameter: '{where}.function'.", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequestError(
                f"Invalid '{where}.function.name': must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-'.",
                f"{where}.function.name",
            )
        if name in out:
            raise InvalidRequestError(f"Duplicate function name {name!r} in tools.", f"{where}.function.name")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError(
                f"Invalid type for '{where}.function.parameters': expected a JSON Schema object.",
                f"{where}.function.parameters",
            )
        if "description" in function and not isinstance(function["description"], str):
            raise InvalidRequestError(
                f"Invalid type for '{where}.function.description': expected a string.",
                f"{where}.function.description",
            )
        out[name] = {k: v for k, v in function.items() if v is not None}
    return out
