"""/health and the 503s across the engine's life: loading, ready, stopped, failed to load."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
from openai_server import API_KEY, MODEL_NAME, assert_matches_spec, auth_headers, make_engine, serve_in_thread

from llmkube.serving.engine.errors import ModelLoadError
from llmkube.serving.openai.app import build_app
from llmkube.serving.openai.lifespan import loading_lifespan
from llmkube.serving.openai.pending_engine import PendingEngine

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def wait_for(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def assert_503(resp: httpx.Response, code: str) -> None:
    assert resp.status_code == 503, resp.text
    assert_matches_spec("ErrorResponse", resp.json())
    assert resp.json()["error"]["code"] == code
    assert resp.json()["error"]["type"] == "service_unavailable_error"


def test_health_while_loading_ready_and_stopped(qwen2_tiny: Path) -> None:
    gate = threading.Event()
    pending = PendingEngine()

    def load() -> Any:
        assert gate.wait(60)
        return make_engine(qwen2_tiny)

    app = build_app(pending, MODEL_NAME, api_key=API_KEY, lifespan=loading_lifespan(pending, load))
    url, server, thread = serve_in_thread(app)
    http = httpx.Client(base_url=url, headers=auth_headers(), timeout=60)
    try:
        # Listening before the model is loaded: probes and clients get a clear 503.
        assert_503(http.get("/health"), "not_ready")
        assert_503(http.post("/v1/chat/completions", json=CHAT), "not_ready")
        assert_503(http.post("/tokenize", json={"prompt": "x"}), "not_ready")
        models = http.get("/v1/models").json()
        assert_matches_spec("ListModelsResponse", models)
        assert models["data"][0]["id"] == MODEL_NAME
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        try:
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
            raise AssertionError("expected a 503")
        except openai.APIStatusError as err:
            assert err.status_code == 503

        gate.set()
        wait_for(lambda: http.get("/health").status_code == 200)
        done = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
        assert done.choices[0].finish_reason in {"stop", "length"}
        assert http.get(f"/v1/models/{MODEL_NAME}").json()["max_model_len"] > 0

        asyncio.run(pending.engine.shutdown())  # type: ignore[attr-defined]
        assert_503(http.get("/health"), "not_ready")
        assert_503(http.post("/v1/chat/completions", json=CHAT), "not_ready")
    finally:
        gate.set()
        server.should_exit = True
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_failed_load_reports_the_engine_dead(tmp_path: Path) -> None:
    pending = PendingEngine()

    def load() -> Any:
        return make_engine(tmp_path / "no-such-checkpoint")

    app = build_app(pending, MODEL_NAME, lifespan=loading_lifespan(pending, load))
    url, server, thread = serve_in_thread(app)
    try:
        wait_for(lambda: pending.error is not None)
        assert isinstance(pending.error, ModelLoadError)
        assert_503(httpx.get(url + "/health"), "engine_dead")
        assert_503(httpx.post(url + "/v1/chat/completions", json=CHAT), "engine_dead")
    finally:
        server.should_exit = True
        thread.join(timeout=30)
