"""POST /tokenize and /detokenize (vLLM's extensions): the server's own view of the tokens."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from llmkube.serving.engine.errors import InvalidRequestError
from llmkube.serving.openai.context import ServingContext
from llmkube.serving.openai.messages import to_template_messages
from llmkube.serving.openai.protocol import DetokenizeRequest, TokenizeRequest, parse_request
from llmkube.serving.openai.tool_choice import plan_tools


async def tokenize(ctx: ServingContext, raw: Request) -> dict[str, Any]:
    req = parse_request(TokenizeRequest, await raw.body())
    ctx.check_model(req.model)
    ctx.check_ready()
    tokenizer = ctx.engine.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("Provide exactly one of 'prompt' and 'messages'.", "prompt")
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tokenizer.encode(req.prompt, add_special_tokens=add_special)
    else:
        if ctx.chat_template is None:
            raise InvalidRequestError("The served model has no chat template.", "messages")
        assert req.messages is not None
        plan = plan_tools(req.tools, "none" if req.tools else None, None, auto_parser_available=True)
        text = ctx.chat_template.render(
            to_template_messages(req.messages),
            tools=plan.tools or None,
            add_generation_prompt=bool(req.add_generation_prompt) and not req.continue_final_message,
            continue_final_message=bool(req.continue_final_message),
            template_kwargs=req.chat_template_kwargs,
        )
        ids = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
    body: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": ctx.engine.model_info.max_model_len,
        "tokens": ids,
    }
    if req.return_token_strs:
        body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return body


async def detokenize(ctx: ServingContext, raw: Request) -> dict[str, Any]:
    req = parse_request(DetokenizeRequest, await raw.body())
    ctx.check_model(req.model)
    ctx.check_ready()
    vocab_size = ctx.engine.model_info.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size}).", "tokens")
    return {"prompt": ctx.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}
