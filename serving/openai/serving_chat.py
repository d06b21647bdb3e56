"""POST /v1/chat/completions: messages in, assistant messages (text and tool calls) out.

Stream and non-stream share one path: each choice's text goes through its tool parser
delta by delta, and the non-stream body is the sum of the deltas, so both agree.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from llmkube.serving.engine.errors import InvalidRequestError, RequestAbortedError
from llmkube.serving.engine.outputs import CompletionOutput, RequestOutput
from llmkube.serving.openai import sse
from llmkube.serving.openai.context import ServingContext, new_id
from llmkube.serving.openai.generation import (
    EngineRun,
    cancel_on_disconnect,
    close_runs,
    framed_stream,
    merge_runs,
    start_runs,
)
from llmkube.serving.openai.logprobs import chat_logprob_entries, chat_logprobs
from llmkube.serving.openai.messages import to_template_messages
from llmkube.serving.openai.protocol import ChatCompletionRequest, parse_request
from llmkube.serving.openai.tool_choice import ToolPlan, plan_tools
from llmkube.serving.openai.tool_parsers import ToolCall, ToolCallDelta, ToolParser
from llmkube.serving.openai.usage import UsageCounter

ENDPOINT = "chat.completions"


def render_chat_prompt(ctx: ServingContext, req: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
    if ctx.chat_template is None:
        raise InvalidRequestError(
            "The served model has no chat template; use /v1/completions or start the server with one.",
            "messages",
        )
    text = ctx.chat_template.render(
        to_template_messages(req.messages),
        tools=plan.tools or None,
        add_generation_prompt=req.wants_generation_prompt,
        continue_final_message=bool(req.continue_final_message),
        template_kwargs=req.chat_template_kwargs,
    )
    return ctx.engine.tokenizer.encode(text, add_special_tokens=False)


def finish_reason_for(engine_reason: str, plan: ToolPlan, num_calls: int) -> str:
    """``length`` wins (even mid tool call); a forced named call ends with ``stop`` as in OpenAI."""
    if engine_reason == "length":
        return "length"
    if plan.mode == "named":
        return "stop"
    return "tool_calls" if num_calls else "stop"


@dataclass
class _Delta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


class _ChatChoice:
    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, plan: ToolPlan, index: int) -> None:
        self.index = index
        self._ctx = ctx
        self._plan = plan
        self._want_logprobs = bool(req.logprobs)
        self.parser: ToolParser | None = plan.make_parser(ctx.tool_parser)
        self.content = ""
        self.calls: dict[int, ToolCall] = {}
        self.logprobs: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    def advance(self, sample: CompletionOutput) -> _Delta:
        delta = _Delta()
        if self.parser is None:
            delta.content = sample.text
        else:
            parsed = self.parser.feed(sample.text)
            if sample.finish_reason is not None:
                tail = self.parser.finish()
                parsed.content += tail.content
                parsed.tool_calls += tail.tool_calls
            delta.content, delta.tool_calls = parsed.content, parsed.tool_calls
        if self._want_logprobs:
            ids, lps = sample.token_ids, sample.logprobs or []
            if sample.finish_reason == "stop" and ids and ids[-1] in self._ctx.engine.model_info.eos_token_ids:
                ids, lps = ids[:-1], lps[:-1]  # the end-of-turn token is not part of the message
            delta.logprobs = chat_logprob_entries(self._ctx.vocab, ids, lps)
            self.logprobs += delta.logprobs
        self.content += delta.content
        for call in delta.tool_calls:
            if call.index not in self.calls:
                self.calls[call.index] = ToolCall(call.id or "", call.name or "", "")
            self.calls[call.index].arguments += call.arguments
        if sample.finish_reason is not None:
            self._finish(sample)
        return delta

    def _finish(self, sample: CompletionOutput) -> None:
        if sample.finish_reason == "abort":
            raise RequestAbortedError(f"request aborted while generating choice {self.index}")
        assert sample.finish_reason is not None
        self.finish_reason = finish_reason_for(sample.finish_reason, self._plan, len(self.calls))
        self.stop_reason = sample.stop_reason
        model, observer = self._ctx.model_name, self._ctx.observer
        observer.choice_finished(model, ENDPOINT, self.finish_reason)
        if self.parser is not None:
            if self.calls:
                observer.tool_calls_parsed(model, self.parser.name, len(self.calls))
            for _ in range(self.parser.parse_failures):
                observer.tool_parse_failed(model, self.parser.name)

    def message(self) -> dict[str, Any]:
        calls = [self.calls[i].to_dict() for i in sorted(self.calls)]
        content: str | None = self.content
        if calls and not self.content.strip():
            content = None
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None, "annotations": []}
        if calls:
            message["tool_calls"] = calls
        return message

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "message": self.message(),
            "logprobs": chat_logprobs(self.logprobs) if self._want_logprobs else None,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }

    def chunk_choice(self, delta: _Delta) -> dict[str, Any] | None:
        body: dict[str, Any] = {}
        if delta.content:
            body["content"] = delta.content
        if delta.tool_calls:
            body["tool_calls"] = [c.to_dict() for c in delta.tool_calls]
        if not body and not delta.logprobs and self.finish_reason is None:
            return None
        return {
            "index": self.index,
            "delta": body,
            "logprobs": chat_logprobs(delta.logprobs) if delta.logprobs else None,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }


class _ChatResponse:
    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, plan: ToolPlan, prompt_ids: list[int]):
        self.ctx = ctx
        self.req = req
        self.id = new_id("chatcmpl")
        self.created = int(time.time())
        self.choices = [_ChatChoice(ctx, req, plan, s) for s in range(req.n or 1)]
        self.usage = UsageCounter.for_prompts([prompt_ids])

    def _envelope(self, choices: list[dict[str, Any]], obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.ctx.model_name,
                "choices": choices}

    def _advance(self, output: RequestOutput) -> list[tuple[_ChatChoice, _Delta]]:
        self.usage.observe(0, output)
        return [(self.choices[s.index], self.choices[s.index].advance(s)) for s in output.outputs]

    async def collect(self, runs: list[EngineRun]) -> dict[str, Any]:
        async for _, output in merge_runs(runs):
            self._advance(output)
        body = self._envelope([c.to_dict() for c in self.choices], "chat.completion")
        body["usage"] = self.usage.to_dict()
        return body

    def _chunk(self, choices: list[dict[str, Any]]) -> str:
        chunk = self._envelope(choices, "chat.completion.chunk")
        if self.req.include_usage:
            chunk["usage"] = self.usage.to_dict() if self.req.continuous_usage else None
        return sse.event(chunk)

    async def stream(self, runs: list[EngineRun]) -> AsyncIterator[str]:
        for choice in self.choices:
            role = {"role": "assistant", "content": ""}
            yield self._chunk([{"index": choice.index, "delta": role, "logprobs": None, "finish_reason": None}])
        async for _, output in merge_runs(runs):
            for choice, delta in self._advance(output):
                body = choice.chunk_choice(delta)
                if body is not None:
                    yield self._chunk([body])

    def usage_chunk(self) -> dict[str, Any] | None:
        if not self.req.include_usage:
            return None
        final = self._envelope([], "chat.completion.chunk")
        final["usage"] = self.usage.to_dict()
        return final


async def create_chat_completion(ctx: ServingContext, raw: Request) -> Response:
    req = parse_request(ChatCompletionRequest, await raw.body())
    ctx.check_model(req.model)
    ctx.check_ready()
    req.check()
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                      auto_parser_available=ctx.tool_parser is not None)
    prompt_ids = render_chat_prompt(ctx, req, plan)
    parser = plan.make_parser(ctx.tool_parser)
    params = req.to_sampling_params(
        len(prompt_ids),
        ctx.engine.model_info,
        tool_structured=plan.structured,
        skip_special_tokens=False if parser is not None and parser.needs_special_tokens else None,
    )
    admission = ctx.admit()
    response = _ChatResponse(ctx, req, plan, prompt_ids)
    runs = [EngineRun(ctx.engine, prompt_ids, params, response.id)]
    try:
        await start_runs(runs)
    except InvalidRequestError as exc:
        admission.release()
        if plan.structured is not None and exc.param == "response_format":
            # The grammar the engine rejected is the one built from the tools' parameters.
            raise InvalidRequestError(f"Invalid parameters schema in tools: {exc.message}", "tools") from None
        raise
    except BaseException:
        admission.release()
        raise
    if req.stream:
        stream = framed_stream(response.stream(runs), response.usage_chunk, runs, admission)
        return StreamingResponse(stream, media_type="text/event-stream")
    try:
        body = await cancel_on_disconnect(raw, response.collect(runs))
    finally:
        await close_runs(runs)
        admission.release()
    return JSONResponse(body)
