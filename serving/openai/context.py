"""Everything a handler needs about the served model, in one object per app (no globals).

The same handlers run in-process (``AsyncEngine``) and behind Ray Serve (a remote
``EngineClient``): only the engine object differs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmkube.serving.engine.protocol import EngineClient
from llmkube.serving.openai import errors
from llmkube.serving.openai.chat_template import ChatTemplate
from llmkube.serving.openai.logprobs import TokenVocab
from llmkube.serving.openai.observer import NullObserver, RequestObserver
from llmkube.serving.openai.tool_parsers import ToolParser, get_tool_parser


class Admission:
    """A slot in the in-flight budget; ``release`` is idempotent."""

    def __init__(self, ctx: ServingContext) -> None:
        self._ctx = ctx
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._ctx.in_flight -= 1


@dataclass
class ServingContext:
    """Per-app state. Tokenizer-derived parts (chat template, token strings) are built on
    first use, so the app can exist before its engine has loaded (see ``pending_engine``)."""

    engine: EngineClient
    model_names: tuple[str, ...]
    tool_parser: type[ToolParser] | None
    chat_template_override: str | None = None
    observer: RequestObserver = field(default_factory=NullObserver)
    max_concurrent_requests: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    in_flight: int = 0
    _prepared: tuple[ChatTemplate | None, TokenVocab] | None = None

    def prepare(self) -> None:
        """Build the chat template and token tables now (a broken template fails here)."""
        if self._prepared is not None:
            return
        tokenizer = self.engine.tokenizer
        source = self.chat_template_override or tokenizer.chat_template
        template = None
        if source:
            template = ChatTemplate(
                source,
                {
                    "bos_token": tokenizer.bos_token,
                    "eos_token": tokenizer.eos_token,
                    "pad_token": getattr(tokenizer, "pad_token", None),
                    "unk_token": getattr(tokenizer, "unk_token", None),
                },
            )
        self._prepared = (template, TokenVocab(tokenizer))

    @property
    def chat_template(self) -> ChatTemplate | None:
        self.prepare()
        assert self._prepared is not None
        return self._prepared[0]

    @property
    def vocab(self) -> TokenVocab:
        self.prepare()
        assert self._prepared is not None
        return self._prepared[1]

    @classmethod
    def create(
        cls,
        engine: EngineClient,
        served_model_name: str | Sequence[str],
        *,
        tool_call_parser: str | None = "hermes",
        chat_template: str | None = None,
        observer: RequestObserver | None = None,
        max_concurrent_requests: int | None = None,
    ) -> ServingContext:
        names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
        if not names:
            raise ValueError("at least one served model name is needed")
        return cls(
            engine=engine,
            model_names=names,
            tool_parser=get_tool_parser(tool_call_parser) if tool_call_parser else None,
            chat_template_override=chat_template,
            observer=observer or NullObserver(),
            max_concurrent_requests=max_concurrent_requests,
        )

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise errors.model_not_found(model)

    def check_ready(self) -> None:
        if self.engine.is_dead:
            raise errors.engine_dead()
        if not self.engine.is_ready:
            raise errors.not_ready()

    def admit(self) -> Admission:
        """Take an in-flight slot or answer 503 (overloaded)."""
        self.check_ready()
        limit = self.max_concurrent_requests
        if limit is not None and self.in_flight >= limit:
            raise errors.overloaded(limit)
        self.in_flight += 1
        return Admission(self)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
