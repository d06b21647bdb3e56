"""POST /v1/completions: prompts in, text completions out (stream and non-stream).

Choice ``index`` is ``prompt_index * n + sample_index``, as OpenAI orders them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
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
from llmkube.serving.openai.logprobs import CompletionLogprobs, TokenTextSplitter
from llmkube.serving.openai.protocol import CompletionRequest, parse_request
from llmkube.serving.openai.usage import UsageCounter

ENDPOINT = "completions"


@dataclass
class Prompt:
    ids: list[int]
    text: str | None  # as sent; None when sent as token ids


def completion_prompts(ctx: ServingContext, prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    tokenizer = ctx.engine.tokenizer
    vocab_size = ctx.engine.model_info.vocab_size
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]  # type: ignore[list-item]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items:
        raise InvalidRequestError("prompt must not be empty.", "prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(Prompt(tokenizer.encode(item, add_special_tokens=True), item))
            continue
        bad = [t for t in item if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt contains token id {bad[0]}, outside the vocabulary [0, {vocab_size}).", "prompt"
            )
        prompts.append(Prompt(list(item), None))
    for p in prompts:
        if not p.ids:
            raise InvalidRequestError("prompt must contain at least one token.", "prompt")
    return prompts


class _Choice:
    """One returned choice: echo, accumulated text and logprobs."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, prompt: Prompt, index: int) -> None:
        self.index = index
        self._ctx = ctx
        self._req = req
        self._prompt = prompt
        self._started = False
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: CompletionLogprobs | None = None

    def _echo_text(self) -> str:
        if self._prompt.text is not None:
            return self._prompt.text
        return self._ctx.engine.tokenizer.decode(self._prompt.ids, skip_special_tokens=False)

    def _start(self, prompt_logprobs: list[Any] | None) -> tuple[str, dict[str, list[Any]] | None]:
        """The first delta's prefix: the echoed prompt (and its logprobs); sets up the builder."""
        text = self._echo_text() if self._req.echo else ""
        if self._req.logprobs is None:
            return text, None
        tokenizer = self._ctx.engine.tokenizer
        skip = self._req.skip_special_tokens is not False
        if not self._req.echo:
            splitter = TokenTextSplitter(tokenizer, skip_special_tokens=skip, context=self._prompt.ids)
            self.logprobs = CompletionLogprobs(self._ctx.vocab, splitter)
            return text, None
        # Prompt pieces keep special tokens, so that they spell the echoed prompt.
        self.logprobs = CompletionLogprobs(self._ctx.vocab, TokenTextSplitter(tokenizer, skip_special_tokens=False))
        plps = list(prompt_logprobs) if prompt_logprobs else [None] * len(self._prompt.ids)
        lp_delta = self.logprobs.add(self._prompt.ids, plps)
        spelled = "".join(lp_delta["tokens"])
        if spelled != text:  # e.g. a BOS token the text as sent does not show: echo what the model saw
            text = spelled
        self.logprobs.switch_splitter(
            TokenTextSplitter(tokenizer, skip_special_tokens=skip, context=self._prompt.ids), offset=len(text)
        )
        return text, lp_delta

    def advance(self, sample: CompletionOutput, prompt_logprobs: list[Any] | None) -> tuple[str, dict | None]:
        """This delta's text and logprobs (echo prepended on the first delta)."""
        text = ""
        lp_delta: dict[str, list[Any]] | None = None
        want_logprobs = self._req.logprobs is not None
        if not self._started:
            self._started = True
            text, lp_delta = self._start(prompt_logprobs)
        text += sample.text
        if want_logprobs and self.logprobs is not None and sample.token_ids:
            gen = self.logprobs.add(sample.token_ids, sample.logprobs or [None] * len(sample.token_ids))
            lp_delta = gen if lp_delta is None else {k: lp_delta[k] + gen[k] for k in lp_delta}
        elif want_logprobs and lp_delta is None:
            lp_delta = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.text += text
        if sample.finish_reason is not None:
            if sample.finish_reason == "abort":
                raise RequestAbortedError(f"request aborted while generating choice {self.index}")
            self.finish_reason = sample.finish_reason
            self.stop_reason = sample.stop_reason
            self._ctx.observer.choice_finished(self._ctx.model_name, ENDPOINT, self.finish_reason)
        return text, lp_delta

    def to_dict(self, text: str, logprobs: dict | None) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }


class _CompletionResponse:
    """Turns engine outputs into completion chunks or one response body."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, prompts: list[Prompt]) -> None:
        self.ctx = ctx
        self.req = req
        self.id = new_id("cmpl")
        self.created = int(time.time())
        n = req.n or 1
        self.choices = {
            (i, s): _Choice(ctx, req, prompt, i * n + s) for i, prompt in enumerate(prompts) for s in range(n)
        }
        self.usage = UsageCounter.for_prompts(p.ids for p in prompts)
        self._prompt_logprobs: dict[int, list[Any]] = {}

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.ctx.model_name,
            "choices": choices,
        }

    def deltas(self, run: int, output: RequestOutput) -> list[tuple[_Choice, str, dict | None]]:
        self.usage.observe(run, output)
        if output.prompt_logprobs is not None:
            self._prompt_logprobs[run] = output.prompt_logprobs
        out = []
        for sample in output.outputs:
            choice = self.choices[(run, sample.index)]
            text, logprobs = choice.advance(sample, self._prompt_logprobs.get(run))
            out.append((choice, text, logprobs))
        return out

    async def collect(self, runs: list[EngineRun]) -> dict[str, Any]:
        async for run, output in merge_runs(runs):
            self.deltas(run, output)
        choices = sorted(self.choices.values(), key=lambda c: c.index)
        body = self._envelope(
            [c.to_dict(c.text, c.logprobs.total if c.logprobs else None) for c in choices]
        )
        body["usage"] = self.usage.to_dict()
        return body

    async def stream(self, runs: list[EngineRun]) -> AsyncIterator[str]:
        async for run, output in merge_runs(runs):
            for choice, text, logprobs in self.deltas(run, output):
                if not text and not (logprobs and logprobs["tokens"]) and choice.finish_reason is None:
                    continue
                chunk = self._envelope([choice.to_dict(text, logprobs)])
                if self.req.include_usage:
                    chunk["usage"] = self.usage.to_dict() if self.req.continuous_usage else None
                yield sse.event(chunk)

    def usage_chunk(self) -> dict[str, Any] | None:
        if not self.req.include_usage:
            return None
        final = self._envelope([])
        final["usage"] = self.usage.to_dict()
        return final


async def create_completion(ctx: ServingContext, raw: Request) -> Response:
    req = parse_request(CompletionRequest, await raw.body())
    ctx.check_model(req.model)
    ctx.check_ready()
    req.check()
    prompts = completion_prompts(ctx, req.prompt)
    info = ctx.engine.model_info
    params = [req.to_sampling_params(len(p.ids), info) for p in prompts]
    admission = ctx.admit()
    response = _CompletionResponse(ctx, req, prompts)
    runs = [
        EngineRun(ctx.engine, p.ids, params[i], f"{response.id}-{i}") for i, p in enumerate(prompts)
    ]
    try:
        await start_runs(runs)
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
