"""Test helpers for the OpenAI API: a real uvicorn server on 127.0.0.1, and the spec's schemas.

``start_server`` builds a real ``AsyncEngine`` on a checkpoint, wraps it in the real app
and serves it with uvicorn from a background thread on a free port (the socket is bound
before uvicorn starts, so there is no port race). ``shared_server`` keeps one per process
and argument set, so every test module reuses the same engine.

``spec_validator(name)`` validates a body against a schema of the official OpenAI OpenAPI
document (``../shared/spec/openai-openapi.yaml``), ``$ref``s resolved.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from llmkube.serving.engine.async_engine import AsyncEngine
from llmkube.serving.engine.config import EngineConfig
from llmkube.serving.openai.app import build_app
from llmkube.serving.openai.lifespan import engine_lifespan

MODEL_NAME = "tiny-qwen2"
API_KEY = "test-key-123"
MAX_MODEL_LEN = 1024
SPEC_PATH = Path(__file__).resolve().parents[2] / "shared" / "spec" / "openai-openapi.yaml"


@dataclass
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    engine: AsyncEngine
    app: Any
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.should_exit = True
            self.thread.join(timeout=30)


def make_engine(model_path: Path, max_model_len: int = MAX_MODEL_LEN) -> AsyncEngine:
    return AsyncEngine(
        EngineConfig(
            model=str(model_path),
            dtype="float32",
            max_model_len=max_model_len,
            kv_cache_memory_bytes=32 * 2**20,
            max_num_seqs=32,
        )
    )


def serve_in_thread(app: Any) -> tuple[str, uvicorn.Server, threading.Thread]:
    """Run ``app`` with uvicorn on 127.0.0.1 (a free port, bound first) in a daemon thread."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn")
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server, thread


def start_server(
    model_path: Path,
    *,
    api_key: str | None = API_KEY,
    served_model_name: str = MODEL_NAME,
    tool_call_parser: str | None = "hermes",
    max_body_bytes: int = 1024 * 1024,
    max_concurrent_requests: int | None = None,
    max_model_len: int = MAX_MODEL_LEN,
) -> RunningServer:
    engine = make_engine(model_path, max_model_len)
    app = build_app(
        engine,
        served_model_name,
        api_key=api_key,
        tool_call_parser=tool_call_parser,
        max_body_bytes=max_body_bytes,
        max_concurrent_requests=max_concurrent_requests,
        lifespan=engine_lifespan(engine),
    )
    url, server, thread = serve_in_thread(app)
    return RunningServer(url, engine, app, server, thread)


_SHARED: dict[tuple[Any, ...], RunningServer] = {}


def shared_server(request: pytest.FixtureRequest, model_path: Path, **kwargs: Any) -> RunningServer:
    """One server per (checkpoint, options) for the whole pytest run, stopped when it ends."""
    key = (str(model_path), tuple(sorted(kwargs.items())))
    if key not in _SHARED:
        running = start_server(model_path, **kwargs)
        _SHARED[key] = running
        request.config.add_cleanup(running.stop)
    return _SHARED[key]


# --- the OpenAI spec ----------------------------------------------------------------------------


def _nullable_to_anyof(node: Any) -> Any:
    """Rewrite OpenAPI 3.0's ``nullable: true`` (which the 3.1 document still uses in places,
    and which JSON Schema ignores) into ``anyOf: [<schema>, {type: null}]``: that is what it
    means, and OpenAI sends null there (e.g. ``finish_reason`` and ``logprobs`` of stream chunks)."""
    if isinstance(node, list):
        return [_nullable_to_anyof(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable_to_anyof(v) for k, v in node.items()}
    if out.pop("nullable", False):
        return {"anyOf": [out, {"type": "null"}]}
    return out


# The documented null-vs-required quirks, relaxed here and nowhere else (see ../shared/spec/README.md):
# (schema name, JSON path inside it, why).
RELAXATIONS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (
        "CreateCompletionResponse",
        ("properties", "choices", "items", "properties", "finish_reason"),
        "completion stream chunks share this schema and carry finish_reason null until the last chunk",
    ),
    (
        "CreateCompletionResponse",
        ("properties", "usage"),
        "stream chunks share this schema; with stream_options.include_usage every chunk but the last "
        "carries usage null (as the stream options document)",
    ),
    (
        "CreateCompletionResponse",
        ("properties", "choices", "items", "properties", "logprobs", "anyOf", 0, "properties",
         "token_logprobs", "items"),
        "with echo, OpenAI returns null for the first prompt token's logprob (nothing precedes it)",
    ),
    (
        "CreateCompletionResponse",
        ("properties", "choices", "items", "properties", "logprobs", "anyOf", 0, "properties",
         "top_logprobs", "items"),
        "with echo, OpenAI returns null top_logprobs for the first prompt token",
    ),
)


def _make_nullable(schema: dict[str, Any], path: tuple[Any, ...]) -> None:
    parent: Any = schema
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = {"anyOf": [parent[path[-1]], {"type": "null"}]}


@functools.cache
def _spec() -> dict[str, Any]:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C loader reads the 3 MB spec in ~2 s
    with SPEC_PATH.open(encoding="utf-8") as f:
        doc = yaml.load(f, Loader=loader)
    doc = _nullable_to_anyof(doc)
    schemas = doc["components"]["schemas"]
    for name, path, _why in RELAXATIONS:
        _make_nullable(schemas[name], path)
    return doc


def spec_validator(name: str) -> Any:
    """A jsonschema validator for ``components.schemas[name]`` (skips the test if no spec)."""
    if not SPEC_PATH.is_file():
        pytest.skip(f"OpenAI spec not found at {SPEC_PATH}")
    return _validator(name)


@functools.cache
def _validator(name: str) -> Any:
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    doc = _spec()
    registry = Registry().with_resource("urn:openai-spec", Resource(contents=doc, specification=DRAFT202012))
    schema = {"$ref": f"urn:openai-spec#/components/schemas/{name}"}
    return jsonschema.Draft202012Validator(schema, registry=registry)


def assert_matches_spec(name: str, body: Any) -> None:
    validator = spec_validator(name)
    problems = sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path))
    assert not problems, f"{name}: " + "; ".join(
        f"{'/'.join(map(str, p.absolute_path))}: {p.message}" for p in problems[:5]
    )


def sync_client(server: RunningServer, api_key: str = API_KEY) -> Any:
    import openai

    return openai.OpenAI(base_url=server.v1, api_key=api_key, max_retries=0, timeout=60)


def async_client(server: RunningServer, api_key: str = API_KEY) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=server.v1, api_key=api_key, max_retries=0, timeout=60)


def auth_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def sse_events(raw: str) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent-events body."""
    for block in raw.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                yield line[len("data: ") :]
