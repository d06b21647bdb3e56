"""Render a checkpoint's jinja chat template the way Hugging Face ``apply_chat_template`` does.

Same environment (``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks``,
loop controls and a no-op ``{% generation %}`` tag), same globals (``raise_exception``,
``strftime_now``, ``namespace``, ``dict``), same ``tojson`` (no HTML escaping,
``ensure_ascii=False``) and the tokenizer's special tokens as variables: templates render
byte-for-byte as in ``transformers``, without importing it (the ingress stays torch-free).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmkube.serving.engine.errors import InvalidRequestError

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_RESERVED = {"messages", "tools", "documents", "add_generation_prompt"}


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (HF uses it for masks only)."""

    tags = {"generation"}  # noqa: RUF012 - jinja's API

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attributes may not start with '_': {name!r}")


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


class ChatTemplate:
    """A checkpoint's chat template plus the special tokens it may reference."""

    def __init__(self, source: str | Mapping[str, str], special_tokens: Mapping[str, str | None]) -> None:
        self._sources = {"default": source} if isinstance(source, str) else dict(source)
        if "default" not in self._sources:
            raise ValueError("a chat template set must contain a 'default' template")
        self._special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        # Compile now: a broken template fails at startup, not on the first request.
        for text in self._sources.values():
            compile_template(text)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text; template errors (``raise_exception``, bad input) -> ``InvalidRequestError``."""
        source = self._sources.get("tool_use") if tools and "tool_use" in self._sources else None
        template = compile_template(source or self._sources["default"])
        messages = [dict(m) for m in messages]
        final_text: str | None = None
        if continue_final_message:
            final_text = messages[-1].get("content") if messages else None
            if not isinstance(final_text, str):
                raise InvalidRequestError(
                    "continue_final_message needs a final message with text content.", "messages"
                )
            messages[-1]["content"] = final_text + _CONTINUE_TAG
            add_generation_prompt = False
        kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED}
        try:
            rendered = template.render(
                messages=messages,
                tools=tools or None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self._special_tokens, **kwargs},
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequestError(f"The chat template rejected the messages: {exc}", "messages") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise InvalidRequestError(
                f"The chat template could not render the messages: {exc}", "messages"
            ) from None
        if final_text is not None:
            rendered = _cut_at_continue_tag(rendered)
        return rendered


def _cut_at_continue_tag(rendered: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if tag not in rendered:
        raise InvalidRequestError(
            "continue_final_message: the chat template dropped the final message's text.", "messages"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()
