"""The async interface: streaming, cancellation, structured output, errors, engine death."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from llmkube.serving.engine.async_engine import AsyncEngine
from llmkube.serving.engine.config import EngineConfig
from llmkube.serving.engine.errors import EngineDeadError, InvalidRequestError, RequestAbortedError
from llmkube.serving.engine.sampling_params import SamplingParams
from llmkube.serving.testing import write_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}


@pytest.fixture
async def engine(tmp_path_factory: pytest.TempPathFactory):
    path = write_checkpoint(tmp_path_factory.mktemp("async") / "qwen2", arch="qwen2", size="tiny")
    config = EngineConfig(model=str(path), dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 * 2**20)
    engine = AsyncEngine(config)
    await engine.start()
    yield engine
    await engine.shutdown()


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str):
    text, tokens, last = "", [], None
    async for output in engine.generate(prompt, params, request_id):
        for completion in output.outputs:
            text += completion.text
            tokens += completion.token_ids
            last = completion
    return text, tokens, last


async def test_streamed_deltas_concatenate_to_the_decoded_text(engine: AsyncEngine) -> None:
    prompt = engine.tokenizer.encode("The weather in Paris is")
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True)
    text, tokens, last = await collect(engine, prompt, params, "stream")
    assert last is not None and last.finish_reason == "length" and last.num_output_tokens == 30
    assert text == engine.tokenizer.decode(tokens)


async def test_concurrent_requests_each_finish(engine: AsyncEngine) -> None:
    prompt = engine.tokenizer.encode("hello there")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    results = await asyncio.gather(*(collect(engine, prompt, params, f"c{i}") for i in range(6)))
    assert all(len(tokens) == 8 for _, tokens, _ in results)


async def test_closing_the_stream_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    prompt = engine.tokenizer.encode("a long story about a dragon")
    stream = engine.generate(prompt, SamplingParams(max_tokens=400, ignore_eos=True), "gone")
    async for _ in stream:
        break  # the client went away after its first chunk
    await stream.aclose()
    for _ in range(100):
        if engine.stats().kv_cache_usage == 0.0 and engine.stats().num_running == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.stats().kv_cache_usage == 0.0 and engine.stats().num_running == 0
    assert not engine.engine.has_unfinished_requests()


async def test_json_schema_output_validates_even_from_random_weights(engine: AsyncEngine) -> None:
    prompt = engine.tokenizer.encode("Answer in JSON:")
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=120, json_schema=SCHEMA)
        text, _, last = await collect(engine, prompt, params, f"json{seed}")
        assert last is not None and last.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


async def test_invalid_schema_and_params_are_rejected_before_streaming(engine: AsyncEngine) -> None:
    with pytest.raises(InvalidRequestError) as error:
        await collect(engine, [5, 6], SamplingParams(json_schema={"type": "no-such-type"}), "bad-schema")
    assert error.value.param == "response_format"
    with pytest.raises(InvalidRequestError):
        await collect(engine, [5, 6], SamplingParams(temperature=3.0), "bad-temperature")
    _, tokens, _ = await collect(engine, [5, 6], SamplingParams(max_tokens=2, ignore_eos=True), "after")
    assert len(tokens) == 2


async def test_a_dead_loop_fails_requests_instead_of_hanging(engine: AsyncEngine) -> None:
    def explode() -> list:
        raise RuntimeError("device lost")

    engine.engine.step = explode  # type: ignore[method-assign]
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(collect(engine, [5, 6, 7], SamplingParams(max_tokens=3), "doomed"), timeout=10)
    assert engine.is_dead and not engine.is_ready
    with pytest.raises(EngineDeadError):
        await collect(engine, [5, 6, 7], SamplingParams(max_tokens=3), "after-death")


async def test_a_duplicate_id_is_refused_while_the_first_compiles_its_grammar(engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=40, json_object=True, seed=1)
    first = asyncio.create_task(collect(engine, [5, 6, 7], params, "same-id"))
    await asyncio.sleep(0)  # the first is now compiling its grammar in a worker thread
    with pytest.raises(InvalidRequestError) as error:
        await collect(engine, [5, 6, 7], params, "same-id")
    assert error.value.param == "request_id"
    _, tokens, last = await asyncio.wait_for(first, timeout=30)
    assert last is not None and last.finish_reason is not None and tokens


async def test_a_request_caught_by_shutdown_fails_instead_of_hanging(engine: AsyncEngine) -> None:
    pending = asyncio.create_task(collect(engine, [5, 6, 7], SamplingParams(json_object=True), "late"))
    await asyncio.sleep(0)  # validating in a worker thread when the shutdown comes
    await engine.shutdown()
    with pytest.raises((EngineDeadError, RequestAbortedError)):
        await asyncio.wait_for(pending, timeout=30)
