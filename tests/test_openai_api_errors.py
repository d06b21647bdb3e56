"""Bad input gets OpenAI-shaped 4xx answers (never a 500), and the server keeps serving.

Every case checks the status, the error body against the spec's ``ErrorResponse``, the
``param``/``code``, and that a good request right after it succeeds.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai_server import (
    API_KEY,
    MAX_MODEL_LEN,
    MODEL_NAME,
    RunningServer,
    assert_matches_spec,
    async_client,
    auth_headers,
    shared_server,
    sync_client,
)

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, qwen2_tiny: Path) -> RunningServer:
    return shared_server(request, qwen2_tiny)


@pytest.fixture(scope="module")
def http(server: RunningServer) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers=auth_headers(), timeout=60)


def assert_error(resp: httpx.Response, status: int, *, param: Any = ..., code: Any = ...,
                 type_: str = "invalid_request_error", contains: str = "") -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert_matches_spec("ErrorResponse", body)
    error = body["error"]
    assert error["type"] == type_ and isinstance(error["message"], str) and error["message"]
    if param is not ...:
        assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error
    assert contains in error["message"], error["message"]
    return error


def assert_still_serving(http: httpx.Client) -> None:
    resp = http.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] in {"stop", "length"}


BAD_CHAT: list[tuple[str, dict[str, Any], str | None, str]] = [
    ("missing model", {"messages": CHAT["messages"]}, "model", "Missing required parameter"),
    ("empty messages", {"model": MODEL_NAME, "messages": []}, "messages", "empty array"),
    ("unknown role", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "robot"),
    ("null user content", {**CHAT, "messages": [{"role": "user", "content": None}]}, "messages[0].content", ""),
    ("image part", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content[0].type",
     "text only"),
    ("tool message without id", {**CHAT, "messages": [{"role": "tool", "content": "x"}]},
     "messages[0].tool_call_id", ""),
    ("max_tokens 0", {**CHAT, "max_tokens": 0}, "max_tokens", "at least 1"),
    ("max_completion_tokens past context", {**CHAT, "max_tokens": None, "max_completion_tokens": 10**6},
     "max_completion_tokens", f"maximum context length is {MAX_MODEL_LEN} tokens"),
    ("n 0", {**CHAT, "n": 0}, "n", ""),
    ("seed beyond int64", {**CHAT, "seed": 2**70}, "seed", "64-bit"),
    ("temperature 3", {**CHAT, "temperature": 3}, "temperature", "[0, 2]"),
    ("temperature string", {**CHAT, "temperature": "hot"}, "temperature", "expected a number"),
    ("top_logprobs without logprobs", {**CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ("top_logprobs 21", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ("unknown parameter", {**CHAT, "frobnicate": 1}, "frobnicate", "Unrecognized request argument"),
    ("stream_options without stream", {**CHAT, "stream_options": {"include_usage": True}}, "stream_options", ""),
    ("bad response_format", {**CHAT, "response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ("invalid json schema", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}},
     "response_format", ""),
    ("unsupported audio", {**CHAT, "audio": {"voice": "alloy", "format": "mp3"}}, "audio", "not supported"),
    ("stop of wrong type", {**CHAT, "stop": 5}, "stop", ""),
    ("logit_bias key", {**CHAT, "logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ("logit_bias out of vocab", {**CHAT, "logit_bias": {"99999999": 1}}, "logit_bias", "vocabulary"),
]


@pytest.mark.parametrize(("name", "body", "param", "contains"), BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_requests(http: httpx.Client, name: str, body: dict, param: str | None, contains: str) -> None:
    assert_error(http.post("/v1/chat/completions", json=body), 400, param=param, contains=contains)
    assert_still_serving(http)


def test_prompt_longer_than_the_context(http: httpx.Client) -> None:
    long_prompt = "hello " * (MAX_MODEL_LEN * 2)
    error = assert_error(http.post("/v1/completions", json={**COMPLETION, "prompt": long_prompt}), 400,
                         param="prompt", contains=f"maximum context length is {MAX_MODEL_LEN} tokens")
    assert "resulted in" in error["message"]  # the prompt's own token count is in the message
    chat = {**CHAT, "max_tokens": None, "messages": [{"role": "user", "content": long_prompt}]}
    assert_error(http.post("/v1/chat/completions", json=chat), 400, param="messages")
    assert_still_serving(http)


BAD_COMPLETIONS: list[tuple[str, dict[str, Any], str | None]] = [
    ("suffix", {**COMPLETION, "suffix": "end"}, "suffix"),
    ("best_of", {**COMPLETION, "best_of": 3}, "best_of"),
    ("logprobs 21", {**COMPLETION, "logprobs": 21}, "logprobs"),
    ("negative logprobs", {**COMPLETION, "logprobs": -1}, "logprobs"),
    ("empty prompt list", {**COMPLETION, "prompt": []}, "prompt"),
    ("token out of vocab", {**COMPLETION, "prompt": [1, 2, 10**7]}, "prompt"),
    ("prompt of wrong type", {**COMPLETION, "prompt": {"text": "x"}}, "prompt"),
    ("max_tokens past context", {**COMPLETION, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("top_p 2", {**COMPLETION, "top_p": 2}, "top_p"),
    ("presence_penalty 5", {**COMPLETION, "presence_penalty": 5}, "presence_penalty"),
    ("min_tokens > max_tokens", {**COMPLETION, "min_tokens": 5}, "min_tokens"),
]


@pytest.mark.parametrize(("name", "body", "param"), BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_requests(http: httpx.Client, name: str, body: dict, param: str | None) -> None:
    assert_error(http.post("/v1/completions", json=body), 400, param=param)
    assert_still_serving(http)


def test_malformed_bodies(http: httpx.Client) -> None:
    cases = [b"{not json", b"", b"[1, 2]", b'"a string"', b"\xff\xfe"]
    for body in cases:
        resp = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert_error(resp, 400)
    assert_error(http.post("/v1/completions", content=b"{"), 400, code="invalid_json")
    assert_still_serving(http)


def test_unknown_model_is_404(server: RunningServer, http: httpx.Client) -> None:
    client = sync_client(server)
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "x"}])
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    assert_error(http.get("/v1/models/gpt-5"), 404, code="model_not_found")
    assert_error(http.post("/v1/completions", json={**COMPLETION, "model": "nope"}), 404)
    assert_still_serving(http)


def test_api_key(server: RunningServer, http: httpx.Client) -> None:
    no_key = httpx.post(server.v1 + "/chat/completions", json=CHAT)
    assert_error(no_key, 401, code="missing_api_key")
    wrong = sync_client(server, api_key="wrong")
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    for path in ("/v1/models", "/v1/models/" + MODEL_NAME):
        assert_error(httpx.get(server.base_url + path, headers={"Authorization": "Basic abc"}), 401)
    assert_error(httpx.post(server.base_url + "/tokenize", json={"prompt": "x"}), 401)
    assert httpx.get(server.base_url + "/health").status_code == 200  # probes need no key
    assert sync_client(server, api_key=API_KEY).models.list().data[0].id == MODEL_NAME
    assert_still_serving(http)


def test_body_too_large_is_413(server: RunningServer, http: httpx.Client) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (2 * 1024 * 1024)}]}
    assert_error(http.post("/v1/chat/completions", json=big), 413, code="request_too_large")

    def chunked() -> Any:  # no Content-Length: the limit applies while reading
        yield b'{"model": "tiny-qwen2", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}]}'

    resp = httpx.post(server.v1 + "/chat/completions", content=chunked(),
                      headers={**auth_headers(), "content-type": "application/json"})
    assert_error(resp, 413, code="request_too_large")
    assert_still_serving(http)


def test_unknown_routes_and_methods(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing-here"), 404, type_="not_found_error")
    assert_error(http.get("/v1/chat/completions"), 405)
    assert_still_serving(http)


def test_models_health_version(server: RunningServer, http: httpx.Client) -> None:
    models = http.get("/v1/models").json()
    assert_matches_spec("ListModelsResponse", models)
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    model = http.get(f"/v1/models/{MODEL_NAME}").json()
    assert_matches_spec("Model", model)
    assert model["max_model_len"] == MAX_MODEL_LEN
    assert sync_client(server).models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert http.get("/health").status_code == 200
    version = http.get("/version").json()["version"]
    assert isinstance(version, str) and version


def test_tokenize_detokenize_round_trip(server: RunningServer, http: httpx.Client) -> None:
    tokens = http.post("/tokenize", json={"prompt": "Hello, world!", "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    assert tokens["tokens"] == server.engine.tokenizer.encode("Hello, world!")
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "Hello, world!"
    assert_error(http.post("/tokenize", json={}), 400, param="prompt")
    assert_error(http.post("/detokenize", json={"tokens": [-1]}), 400, param="tokens")


def test_overloaded_is_503(server: RunningServer, http: httpx.Client) -> None:
    ctx = server.app.state.ctx
    ctx.max_concurrent_requests = 1
    try:
        # Long enough (8 x 1000 tokens) to still run while we ask again; leaving the block aborts it.
        body = {**COMPLETION, "n": 8, "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.v1 + "/completions", json=body, headers=auth_headers()) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # keep a reference: a collected iterator closes the connection
            next(lines)  # the first request holds the only slot while it streams
            error = assert_error(http.post("/v1/completions", json=COMPLETION), 503,
                                 type_="service_unavailable_error", code="overloaded")
            assert "1 requests in flight" in error["message"]
    finally:
        ctx.max_concurrent_requests = None
    deadline = time.monotonic() + 5
    while ctx.in_flight:  # the server notices the closed stream, aborts it and frees the slot
        assert time.monotonic() < deadline, "the slot of a disconnected stream was never released"
        time.sleep(0.01)
    assert_still_serving(http)


async def test_client_disconnect_aborts_the_engine_request(server: RunningServer) -> None:
    engine = server.engine
    body = {**COMPLETION, "n": 4, "max_tokens": 600, "ignore_eos": True}
    started = time.monotonic()
    full = httpx.post(server.v1 + "/completions", json=body, headers=auth_headers(), timeout=120)
    full_time = time.monotonic() - started
    assert full.status_code == 200 and full.json()["usage"]["completion_tokens"] == 2400
    for stream in (True, False):
        async with httpx.AsyncClient(timeout=60) as client:
            if stream:
                async with client.stream("POST", server.v1 + "/completions", json={**body, "stream": True},
                                         headers=auth_headers()) as resp:
                    lines = resp.aiter_lines()
                    await anext(lines)
                    assert engine.stats().num_running == 4
            else:
                task = asyncio.create_task(client.post(server.v1 + "/completions", json=body,
                                                       headers=auth_headers()))
                while engine.stats().num_running < 4:
                    await asyncio.sleep(0.005)
                task.cancel()
        gone = time.monotonic()
        while engine.stats().num_running or engine.stats().num_waiting:
            await asyncio.sleep(0.01)
            assert time.monotonic() - gone < full_time / 2, "the engine kept generating for a gone client"
    assert server.app.state.ctx.in_flight == 0


async def test_async_client_errors_are_typed(server: RunningServer) -> None:
    aclient = async_client(server)
    with pytest.raises(openai.BadRequestError) as err:
        await aclient.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=2)
    assert err.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        await aclient.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, stream=True, suffix="s")
    ok = await aclient.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    assert ok.choices[0].finish_reason in {"stop", "length"}
    await aclient.close()
