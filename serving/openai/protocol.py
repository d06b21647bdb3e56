"""Request models of the OpenAI API (plus vLLM's documented extensions).

Pydantic checks shapes and types (strictly: ``"1"`` is not a number); each request then
turns itself into the engine's ``SamplingParams`` in one method, which also checks the
semantic rules (ranges, context length) and raises ``InvalidRequestError`` naming the
offending field. Fields that OpenAI defines but this server cannot honour are declared
so that they are *rejected with a reason*, not silently ignored; unknown fields are
rejected like OpenAI does ("Unrecognized request argument supplied").
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmkube.serving.engine.errors import InvalidRequestError
from llmkube.serving.engine.protocol import ModelInfo
from llmkube.serving.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from llmkube.serving.openai.errors import from_validation_errors
from llmkube.serving.openai.structured import StructuredOutput, from_response_format, from_structured_outputs

MAX_N = 128
DEFAULT_COMPLETION_MAX_TOKENS = 16
# top_p == 0 is legal in OpenAI's API (it means "only the most likely token"); the engine's
# nucleus needs a positive mass, and this one keeps exactly the top token.
_TOP_P_EPSILON = 1e-9


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted; chunks are never obfuscated
    continuous_usage_stats: bool | None = None  # vLLM extension: usage on every chunk


class ChatMessage(BaseModel):
    """One message as sent; roles and content parts are checked in ``messages.py``.

    Unknown keys are kept and passed to the chat template (e.g. ``reasoning_content``).
    """

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class _SamplingFields(_Strict):
    """Fields both endpoints share, with OpenAI's defaults."""

    model: str
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int | None = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options and self.stream_options.continuous_usage_stats)

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true.", "stream_options")
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {self.n}.", "n")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be a 64-bit signed integer, got {self.seed}.", "seed")

    def _sampling_params(
        self,
        *,
        max_tokens: int,
        logprobs: int | None,
        structured: StructuredOutput,
        model_info: ModelInfo,
        prompt_logprobs: int | None = None,
        skip_special_tokens: bool | None = None,
    ) -> SamplingParams:
        top_p = 1.0 if self.top_p is None else self.top_p
        if top_p == 0.0:
            top_p = _TOP_P_EPSILON
        params = SamplingParams(
            n=self.n or 1,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens or 0,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=_logit_bias(self.logit_bias),
            seed=self.seed,
            stop=_stop_list(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            ignore_eos=bool(self.ignore_eos),
            skip_special_tokens=(
                skip_special_tokens
                if skip_special_tokens is not None
                else (True if self.skip_special_tokens is None else self.skip_special_tokens)
            ),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            json_schema=structured.json_schema,
            json_object=structured.json_object,
            regex=structured.regex,
            grammar=structured.grammar,
        )
        params.validate(model_info.vocab_size)
        return params


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # OpenAI's default is 16 (see to_sampling_params)
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # extension: structured output for completions

    def check(self) -> None:
        """Request-level rules that need no prompt (raise ``InvalidRequestError``)."""
        self._check_common()
        if self.suffix is not None:
            raise InvalidRequestError(
                "suffix is not supported: this server serves causal models without fill-in-the-middle.",
                "suffix",
            )
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise InvalidRequestError(
                "best_of is not supported (only best_of equal to n, which is the same as leaving it out).",
                "best_of",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}.", "logprobs"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens")

    def to_sampling_params(self, prompt_len: int, model_info: ModelInfo) -> SamplingParams:
        max_tokens = resolve_max_tokens(
            self.max_tokens,
            prompt_len,
            model_info.max_model_len,
            param="max_tokens",
            what="prompt",
            # Left out: OpenAI's 16 (within the context); an explicit null: up to the context.
            default=None if "max_tokens" in self.model_fields_set else DEFAULT_COMPLETION_MAX_TOKENS,
        )
        structured = from_response_format(self.response_format)
        if self.structured_outputs is not None:
            structured = structured.merge(from_structured_outputs(self.structured_outputs))
        return self._sampling_params(
            max_tokens=max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo and self.logprobs is not None else None,
            structured=structured,
            model_info=model_info,
        )


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI, still widely sent
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Accepted and ignored: bookkeeping that changes nothing about the output.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    modalities: list[str] | None = None
    # Declared so they are rejected with a reason (see ``check``).
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    moderation: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM chat extensions
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        self._check_common()
        for name, reason in _UNSUPPORTED_CHAT_FIELDS.items():
            if getattr(self, name) is not None:
                raise InvalidRequestError(f"{name} is not supported: {reason}", name)
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise InvalidRequestError("Only the 'text' output modality is supported.", "modalities")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise InvalidRequestError(
                    "logprobs must be set to true when top_logprobs is used.", "top_logprobs"
                )
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}.",
                    "top_logprobs",
                )
        for name in ("max_completion_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequestError(f"{name} must be at least 1, got {value}.", name)
        if self.continue_final_message and self.add_generation_prompt and (
            "add_generation_prompt" in self.model_fields_set
        ):
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true.", "continue_final_message"
            )

    @property
    def wants_generation_prompt(self) -> bool:
        """``add_generation_prompt`` unless continuing the final message (which implies false)."""
        if self.continue_final_message and "add_generation_prompt" not in self.model_fields_set:
            return False
        return self.add_generation_prompt is not False

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def to_sampling_params(
        self,
        prompt_len: int,
        model_info: ModelInfo,
        *,
        tool_structured: StructuredOutput | None = None,
        skip_special_tokens: bool | None = None,
    ) -> SamplingParams:
        requested = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        max_tokens = resolve_max_tokens(
            requested, prompt_len, model_info.max_model_len, param=self.max_tokens_param, what="messages"
        )
        structured = from_response_format(self.response_format)
        if self.structured_outputs is not None:
            structured = structured.merge(from_structured_outputs(self.structured_outputs))
        if tool_structured is not None:
            if structured.is_set:
                raise InvalidRequestError(
                    "response_format cannot be combined with tool_choice 'required' or a named tool.",
                    "response_format",
                )
            structured = tool_structured
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(
            max_tokens=max_tokens,
            logprobs=logprobs,
            structured=structured,
            model_info=model_info,
            skip_special_tokens=skip_special_tokens,
        )


_UNSUPPORTED_CHAT_FIELDS: dict[str, str] = {
    "audio": "this server only produces text.",
    "prediction": "predicted outputs (speculative decoding from a given text) are not implemented.",
    "web_search_options": "this server has no web search tool.",
    "reasoning_effort": "the served model is not a reasoning model with adjustable effort.",
    "verbosity": "the served model has no verbosity control.",
    "moderation": "this server runs no moderation models.",
    "functions": "the deprecated functions API is not implemented; use tools.",
    "function_call": "the deprecated functions API is not implemented; use tool_choice.",
}


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM extension): either a completion prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM extension)."""

    model: str | None = None
    tokens: list[int]


# --- helpers ------------------------------------------------------------------------------

RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_request(model: type[RequestT], body: bytes) -> RequestT:
    """Validate a JSON body; any failure is an OpenAI-shaped 400."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors(include_url=False)) from None



def resolve_max_tokens(
    requested: int | None,
    prompt_len: int,
    max_model_len: int,
    *,
    param: str,
    what: str,
    default: int | None = None,
) -> int:
    """How many tokens may be generated; a request that cannot fit is a 400 with the numbers."""
    room = max_model_len - prompt_len
    if room <= 0:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your {what} "
            f"resulted in {prompt_len} tokens, which leaves no room for a completion. "
            f"Please reduce the length of the {what}.",
            "messages" if what == "messages" else "prompt",
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested < 1:
        raise InvalidRequestError(f"{param} must be at least 1, got {requested}.", param)
    if requested > room:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the {what}, {requested} in the completion). "
            f"Please reduce the length of the {what} or completion.",
            param,
        )
    return requested


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids (integers as strings), got {key!r}.", "logit_bias"
            ) from None
        out[token_id] = float(value)
    return out

