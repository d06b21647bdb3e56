"""``response_format`` (and vLLM's ``structured_outputs``) -> the engine's grammar fields.

The engine compiles the constraint (xgrammar) and rejects an invalid one with
``InvalidRequestError(param="response_format")``; here only the request's shape is checked.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from llmkube.serving.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class StructuredOutput:
    """At most one of the engine's four constraints."""

    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    @property
    def is_set(self) -> bool:
        return self.json_schema is not None or self.json_object or self.regex is not None or (
            self.grammar is not None
        )

    def merge(self, other: StructuredOutput) -> StructuredOutput:
        if self.is_set and other.is_set:
            raise InvalidRequestError(
                "response_format and structured_outputs cannot both set a constraint.", "structured_outputs"
            )
        return other if other.is_set else self


NONE = StructuredOutput()


def from_response_format(response_format: dict[str, Any] | None) -> StructuredOutput:
    """OpenAI's ``{"type": "text" | "json_object" | "json_schema", ...}``."""
    if response_format is None:
        return NONE
    kind = response_format.get("type")
    if kind == "text":
        return NONE
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError(
                "response_format.json_schema must be an object with a 'name' and a 'schema'.",
                "response_format.json_schema",
            )
        name = spec.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise InvalidRequestError(
                "response_format.json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-'.",
                "response_format.json_schema.name",
            )
        schema = spec.get("schema")
        if schema is None:
            return StructuredOutput(json_object=True)
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                "response_format.json_schema.schema must be a JSON Schema object.",
                "response_format.json_schema.schema",
            )
        return StructuredOutput(json_schema=schema)
    raise InvalidRequestError(
        f"Invalid value for response_format.type: {kind!r}. Supported values are: 'text', 'json_object' "
        "and 'json_schema'.",
        "response_format.type",
    )


def from_structured_outputs(spec: dict[str, Any]) -> StructuredOutput:
    """vLLM's extension: exactly one of ``json``, ``regex``, ``choice``, ``grammar``."""
    keys = [k for k in ("json", "regex", "choice", "grammar") if spec.get(k) is not None]
    unknown = set(spec) - {"json", "regex", "choice", "grammar"}
    if unknown:
        raise InvalidRequestError(
            f"structured_outputs: unsupported key(s) {sorted(unknown)}; use json, regex, choice or grammar.",
            "structured_outputs",
        )
    if len(keys) != 1:
        raise InvalidRequestError(
            "structured_outputs must set exactly one of json, regex, choice or grammar.", "structured_outputs"
        )
    key = keys[0]
    value = spec[key]
    if key == "json":
        if not isinstance(value, dict | str):
            raise InvalidRequestError("structured_outputs.json must be a JSON Schema.", "structured_outputs")
        return StructuredOutput(json_schema=value if isinstance(value, dict) else _json_loads_schema(value))
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(
                "structured_outputs.choice must be a non-empty list of strings.", "structured_outputs"
            )
        return StructuredOutput(regex="(" + "|".join(_regex_escape(c) for c in value) + ")")
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"structured_outputs.{key} must be a non-empty string.", "structured_outputs")
    return StructuredOutput(regex=value) if key == "regex" else StructuredOutput(grammar=value)


_REGEX_SPECIAL = set("\\.^$*+?()[]{}|/-")


def _regex_escape(text: str) -> str:
    """Escape only the regex metacharacters (the engine's regex dialect knows no ``\\ ``)."""
    return "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in text)


def _json_loads_schema(text: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except ValueError:
        raise InvalidRequestError("structured_outputs.json is not valid JSON.", "structured_outputs") from None
    if not isinstance(schema, dict):
        raise InvalidRequestError("structured_outputs.json must be a JSON Schema object.", "structured_outputs")
    return schema
