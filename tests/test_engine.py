"""The engine against Hugging Face transformers on generated checkpoints (CPU, float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmkube.serving.engine.config import EngineConfig
from llmkube.serving.engine.errors import InvalidRequestError
from llmkube.serving.engine.llm_engine import LLMEngine
from llmkube.serving.engine.outputs import RequestOutput
from llmkube.serving.engine.sampling_params import SamplingParams
from llmkube.serving.testing import ARCHITECTURES, write_checkpoint

KV_BYTES = 16 * 2**20


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-checkpoints")
    return {arch: write_checkpoint(root / arch, arch=arch, size="tiny") for arch in ARCHITECTURES}


def make_engine(path: Path, **overrides: object) -> LLMEngine:
    options: dict[str, object] = {
        "dtype": "float32",
        "max_model_len": 256,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 64,  # small, so prompts are prefilled in several chunks
        "block_size": 8,
        "kv_cache_memory_bytes": KV_BYTES,
    }
    options.update(overrides)
    return LLMEngine(EngineConfig(model=str(path), **options))  # type: ignore[arg-type]


def run(engine: LLMEngine, prompts: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    for request_id, (prompt, params) in prompts.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list[RequestOutput]] = {request_id: [] for request_id in prompts}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def tokens_of(outputs: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for out in outputs for c in out.outputs if c.index == index for t in c.token_ids]


def text_of(outputs: list[RequestOutput], index: int = 0) -> str:
    return "".join(c.text for out in outputs for c in out.outputs if c.index == index)


def final(outputs: list[RequestOutput], index: int = 0):
    return next(c for out in reversed(outputs) for c in out.outputs if c.index == index)


def prompts_for(engine: LLMEngine, count: int, seed: int = 0) -> list[list[int]]:
    """Mixed-length prompts of ordinary (non-special) tokens."""
    rng = torch.Generator().manual_seed(seed)
    vocab = engine.tokenizer.vocab_size - 8
    lengths = [3, 17, 40, 9, 64, 1, 25, 33][:count] + [5 + 7 * i for i in range(max(0, count - 8))]
    return [torch.randint(10, vocab, (n,), generator=rng).tolist() for n in lengths[:count]]


def hf_greedy(path: Path, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens from transformers (EOS masked, as min_tokens does) and the logprobs of each."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generated = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
    )[0, len(prompt) :].tolist()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1].float()
    return generated, torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_and_logprobs_match_transformers(checkpoints: dict[str, Path], arch: str) -> None:
    engine = make_engine(checkpoints[arch])
    prompts = prompts_for(engine, 4)
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, logprobs=3)
    outputs = run(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        expected, ref_logprobs = hf_greedy(checkpoints[arch], prompt, 12)
        assert tokens_of(outputs[str(i)]) == expected, f"{arch} prompt {i}"
        logprobs = [lp for out in outputs[str(i)] for c in out.outputs for lp in c.logprobs or []]
        assert len(logprobs) == 12
        for step, lp in enumerate(logprobs):
            assert lp.token_id == expected[step]
            assert abs(lp.logprob - ref_logprobs[step, lp.token_id].item()) < 1e-4
            top_ids = [token for token, _ in lp.top]
            assert top_ids == ref_logprobs[step].topk(3).indices.tolist()
            # Raw-distribution rank: min_tokens masks EOS, so the pick may trail it.
            assert lp.rank == 1 + int((ref_logprobs[step] > ref_logprobs[step, lp.token_id]).sum())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_single_request_equals_its_batched_self(checkpoints: dict[str, Path]) -> None:
    engine = make_engine(checkpoints["qwen2"])
    prompts = prompts_for(engine, 8)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    alone = [engine.generate([p], params)[0] for p in prompts]
    assert engine.generate(prompts, params) == alone


def test_seeded_sampling_ignores_batch_companions(checkpoints: dict[str, Path]) -> None:
    engine = make_engine(checkpoints["llama"])
    prompts = prompts_for(engine, 16, seed=3)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True, seed=1234)
    alone = engine.generate([prompts[5]], seeded)[0]
    companions = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True) for _ in prompts]
    companions[5] = seeded
    assert engine.generate(prompts, companions)[5] == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True, seed=99)
    assert engine.generate([prompts[5]], other_seed)[0] != alone


def test_max_tokens_finishes_with_length(checkpoints: dict[str, Path]) -> None:
    engine = make_engine(checkpoints["qwen2"])
    out = run(engine, {"a": (prompts_for(engine, 1)[0], SamplingParams(max_tokens=5, ignore_eos=True))})["a"]
    assert final(out).finish_reason == "length" and final(out).stop_reason is None
    assert len(tokens_of(out)) == 5 and out[-1].finished


def test_eos_stops_unless_ignored_and_min_tokens_defers_it(checkpoints: dict[str, Path]) -> None:
    engine = make_engine(checkpoints["qwen2"])
    prompt = prompts_for(engine, 1)[0]
    eos = engine.tokenizer.eos_token_id
    assert eos is not None
    forced = {eos: 100.0}  # the bias makes EOS the greedy choice at every step
    out = run(engine, {"e": (prompt, SamplingParams(temperature=0, max_tokens=8, logit_bias=forced))})["e"]
    assert tokens_of(out) == [eos] and final(out).finish_reason == "stop" and final(out).stop_reason is None
    out = run(engine, {"m": (prompt, SamplingParams(temperature=0, max_tokens=8, min_tokens=3, logit_bias=forced))})
    assert len(tokens_of(out["m"])) == 4 and tokens_of(out["m"])[-1] == eos
    params = SamplingParams(temperature=0, max_tokens=6, logit_bias=forced, ignore_eos=True)
    out = run(engine, {"i": (prompt, params)})["i"]
    assert tokens_of(out) == [eos] * 6 and final(out).finish_reason == "length"


def test_stop_token_ids_report_the_token(checkpoints: dict[str, Path]) -> None:
    engine = make_engine(checkpoints["qwen2"])
    prompt = prompts_for(engine, 1)[0]
    free_run = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    stopper = free_run[3]
    out = run(engine, {"s": (prompt, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stopper]))})["s"]
    assert tokens_of(out) == free_run[: free_run.index(stopper) + 1]
    assert final(out).finish_reason == "stop" and final(out).stop_reason == stopper


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(checkpoints: dict[str, Path]) -> None:
    engine = make_engine(checkpoints["llama"])
    prompt = prompts_for(engine, 2)[1]
    free_run = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    text = engine.tokenizer.decode(free_run)
    # A stop string that starts inside one token and ends inside a later one.
    start = len(engine.tokenizer.decode(free_run[:4])) - 1
    stop = text[start : start + 4]
    assert len(stop) == 4 and stop.strip()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    out = run(engine, {"s": (prompt, params)})["s"]
    assert text_of(out) == text[: text.index(stop)]
    assert final(out).finish_reason == "stop" and final(out).stop_reason == stop
    assert all(stop not in c.text for o in out for c in o.outputs)
    params.include_stop_str_in_output = True
    out = run(engine, {"t": (prompt, params)})["t"]
    assert text_of(out) == text[: text.index(stop) + len(stop)]


def test_n_samples_share_the_prompt_and_differ(checkpoints: dict[str, Path]) -> None:
    engine = make_engine(checkpoints["qwen2"])
    prompt = prompts_for(engine, 5)[4]  # 64 tokens: eight full blocks to share
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, ignore_eos=True, seed=7)
    out = run(engine, {"n": (prompt, params)})["n"]
    samples = [tokens_of(out, i) for i in range(3)]
    assert all(len(s) == 8 for s in samples) and len({tuple(s) for s in samples}) == 3
    assert all(final(out, i).finish_reason == "length" for i in range(3))
    # Followers found the leader's prompt blocks in the prefix cache.
    assert engine.block_manager.prefix_hits == 2 * ((len(prompt) - 1) // 8 * 8)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_mid_generation_frees_every_block(checkpoints: dict[str, Path]) -> None:
    engine = make_engine(checkpoints["qwen2"])
    prompts = prompts_for(engine, 3)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    final_output = engine.abort_request("1")
    assert final_output is not None and final_output.finished
    assert {c.finish_reason for c in final_output.outputs} == {"abort"}
    engine.abort_request("0")
    engine.abort_request("2")
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.stats().kv_cache_usage == 0.0


def test_preemption_under_a_tiny_kv_budget_keeps_greedy_outputs(checkpoints: dict[str, Path]) -> None:
    roomy = make_engine(checkpoints["mistral"])
    prompts = prompts_for(roomy, 8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = roomy.generate(prompts, params)
    block_bytes = roomy.runner.bytes_per_block
    # Room for 1.5 sequences at full length, far less than 8 running ones need.
    tight = make_engine(checkpoints["mistral"], max_model_len=128, kv_cache_memory_bytes=block_bytes * 24)
    assert tight.generate(prompts, params) == expected
    assert tight.stats().num_preemptions > 0
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks


def test_prefix_cache_reuses_blocks_of_a_repeated_prefix(checkpoints: dict[str, Path]) -> None:
    engine = make_engine(checkpoints["qwen3"])
    shared = prompts_for(engine, 5)[4]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = run(engine, {"a": ([*shared, 11, 12], params)})["a"]
    second = run(engine, {"b": ([*shared, 11, 12], params)})["b"]
    assert second[-1].num_cached_tokens == len(shared) // 8 * 8 and first[-1].num_cached_tokens == 0
    assert tokens_of(first) == tokens_of(second)
    uncached = make_engine(checkpoints["qwen3"], enable_prefix_caching=False)
    assert uncached.generate([[*shared, 11, 12]], params)[0] == tokens_of(second)


def test_prompt_logprobs_match_transformers(checkpoints: dict[str, Path]) -> None:
    engine = make_engine(checkpoints["qwen2"])
    prompt = prompts_for(engine, 3)[2]
    out = run(engine, {"p": (prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))})["p"]
    prompt_logprobs = out[0].prompt_logprobs
    assert prompt_logprobs is not None and prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt)
    model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen2"], dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for position in range(1, len(prompt)):
        lp = prompt_logprobs[position]
        assert lp is not None and lp.token_id == prompt[position]
        assert abs(lp.logprob - ref[position - 1, prompt[position]].item()) < 1e-4
        assert len(lp.top) == 2


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([], SamplingParams(), "prompt"),
        ([5] * 300, SamplingParams(), "prompt"),
        ([5] * 10, SamplingParams(max_tokens=0), "max_tokens"),
        ([5] * 10, SamplingParams(max_tokens=250), "max_tokens"),
        ([5] * 10, SamplingParams(top_k=-5), "top_k"),
        ([5] * 10, SamplingParams(top_p=1.5), "top_p"),
        ([5] * 10, SamplingParams(top_p=0.0), "top_p"),
        ([5] * 10, SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        ([5] * 10, SamplingParams(logprobs=21), "logprobs"),
        ([10**6], SamplingParams(), "prompt"),
    ],
)
def test_bad_requests_raise_typed_errors_and_the_engine_keeps_serving(
    checkpoints: dict[str, Path], prompt: list[int], params: SamplingParams, param: str
) -> None:
    engine = make_engine(checkpoints["qwen2"])
    engine.add_request("busy", [7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("bad", prompt, params)
    assert error.value.param == param and str(error.value)
    outputs = run(engine, {"after": ([7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))})
    assert len(tokens_of(outputs["after"])) == 3 and not engine.has_unfinished_requests()
