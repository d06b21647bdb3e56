"""The synchronous engine: requests in, one batched model step at a time, deltas out."""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from llmkube.serving.engine.block_manager import BlockManager
from llmkube.serving.engine.config import EngineConfig
from llmkube.serving.engine.detokenizer import IncrementalDetokenizer
from llmkube.serving.engine.errors import InvalidRequestError, ModelLoadError
from llmkube.serving.engine.loader import resolve_dtype, resolve_model_path
from llmkube.serving.engine.model_config import ModelConfig
from llmkube.serving.engine.model_runner import ModelRunner
from llmkube.serving.engine.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob
from llmkube.serving.engine.protocol import EngineStats, ModelInfo
from llmkube.serving.engine.sampling_params import SamplingParams
from llmkube.serving.engine.scheduler import Scheduler
from llmkube.serving.engine.sequence import Request, Sequence
from llmkube.serving.engine.structured import GrammarCompilerCache
from llmkube.serving.engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # xgrammar is imported lazily: it pulls in transformers
    from xgrammar import CompiledGrammar

logger = logging.getLogger(__name__)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_pretrained(model_dir)
        self.tokenizer = Tokenizer.from_pretrained(model_dir)
        device = _resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, self.model_config.torch_dtype, device)
        max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if max_model_len > self.model_config.max_position_embeddings:
            raise ModelLoadError(
                f"max_model_len {max_model_len} exceeds the checkpoint's max_position_embeddings "
                f"({self.model_config.max_position_embeddings})"
            )
        self.eos_token_ids = self.tokenizer.eos_token_ids | self.model_config.eos_token_ids
        self.runner = ModelRunner(
            self.model_config, config, model_dir, dtype, device, max_model_len, self.eos_token_ids
        )
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.model_info = ModelInfo(
            max_model_len=max_model_len,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.eos_token_ids,
            architecture=self.model_config.architecture,
        )
        self._grammars: GrammarCompilerCache | None = None
        self.requests: dict[str, Request] = {}
        logger.info(
            "loaded %s (%s, %s on %s), max_model_len %d",
            config.model,
            self.model_config.architecture,
            dtype,
            device,
            max_model_len,
        )

    # -- requests -------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> CompiledGrammar | None:
        """Check a request without touching engine state; returns its compiled grammar.

        Safe to call from another thread than the one stepping the engine.
        """
        max_len = self.model_info.max_model_len
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty; at least one token is required", "prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        if len(prompt_token_ids) >= max_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {max_len} tokens, but the prompt has "
                f"{len(prompt_token_ids)} tokens; leave room for at least one output token",
                "prompt",
            )
        if params.max_tokens is not None and len(prompt_token_ids) + params.max_tokens > max_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {max_len} tokens; the prompt has "
                f"{len(prompt_token_ids)} tokens and max_tokens is {params.max_tokens} "
                f"({len(prompt_token_ids) + params.max_tokens} in all)",
                "max_tokens",
            )
        params.validate(vocab)
        if not params.has_structured_output:
            return None
        if self._grammars is None:
            self._grammars = GrammarCompilerCache(self.tokenizer, vocab)
        return self._grammars.compile(params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        compiled_grammar: CompiledGrammar | None = None,
    ) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", "request_id")
        if compiled_grammar is None:
            compiled_grammar = self.validate(prompt_token_ids, params)
        request = Request(request_id, list(prompt_token_ids), params, self.model_info.max_model_len)
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator().manual_seed(params.seed + index)
            grammar = None
            if compiled_grammar is not None and self._grammars is not None:
                grammar = self._grammars.new_state(compiled_grammar)
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
            request.seqs.append(Sequence(request, index, detokenizer, generator, grammar))
        # Registered only once every sample was built: a failure above leaves no trace.
        for seq in request.seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once and free its blocks; returns its final output."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort", None)
        return self._output(request, request.seqs)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        result = self.runner.execute(chunks)
        for chunk in chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.cache_full_blocks(chunk.seq)
        touched: dict[str, list[Sequence]] = {}
        for seq, token_id, logprob in zip(result.sampled, result.output.token_ids, result.output.logprobs, strict=True):
            self._append(seq, token_id, logprob)
            touched.setdefault(seq.request.request_id, []).append(seq)
        outputs = []
        for request_id, seqs in touched.items():
            request = self.requests[request_id]
            outputs.append(self._output(request, seqs))
            if request.finished:
                del self.requests[request_id]
        return outputs

    def _append(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> None:
        seq.append_token(token_id, logprob)
        params = seq.params
        if seq.grammar is not None:
            seq.grammar.accept(token_id)
        if token_id in self.eos_token_ids and not params.ignore_eos:
            self._finish(seq, "stop", None)
        elif token_id in params.stop_token_ids:
            self._finish(seq, "stop", token_id)
        elif (stop := seq.detokenizer.push(token_id)) is not None:
            self._finish(seq, "stop", stop)
        elif seq.num_tokens >= seq.request.max_total_tokens:
            self._finish(seq, "length", None)
        elif seq.grammar is not None and seq.grammar.is_terminated():
            self._finish(seq, "stop", None)

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq)

    def _output(self, request: Request, seqs: Seq[Sequence]) -> RequestOutput:
        completions = []
        for seq in seqs:
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.take_delta(finished=seq.is_finished),
                    token_ids=seq.new_token_ids,
                    logprobs=seq.new_logprobs if seq.params.logprobs is not None else None,
                    num_output_tokens=len(seq.output_token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
            seq.new_token_ids, seq.new_logprobs = [], []
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.finished,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    # -- conveniences -----------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion; the output token ids of each (first sample)."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, per_prompt, strict=True):
            self.add_request(request_id, prompt, p)
        tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while self.has_unfinished_requests():
            for output in self.step():
                for completion in output.outputs:
                    if completion.index == 0:
                        tokens[output.request_id].extend(completion.token_ids)
        return [tokens[request_id] for request_id in ids]

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.block_manager.prefix_queries,
            prefix_cache_hits=self.block_manager.prefix_hits,
        )
