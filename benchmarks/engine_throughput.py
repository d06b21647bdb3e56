"""Offline throughput: llmkube's engine against Hugging Face ``transformers`` static-batch generate.

    python benchmarks/engine_throughput.py [--quick] [--only engine|hf] [--json PATH]

Two workloads on a generated random-weight checkpoint (default: llama "small", float32), greedy:

* ``fixed``: 64 requests x 128 prompt tokens -> 64 output tokens each;
* ``mixed``: 64 requests, prompt lengths 32-512 and output lengths 16-256 drawn at random (seeded).

Every request must produce exactly its requested number of tokens, so EOS never ends one: the
engine gets ``ignore_eos``; ``transformers`` gets no EOS id at all (its batches then always run
``max_new_tokens`` steps). That is the same cost as ``min_new_tokens = max_new_tokens`` but, unlike
it, does not mask EOS's logit, so both systems decode the same greedy sequences and the report can
say how many outputs agree token for token.

The engine gets all requests at once (continuous batching decides what runs). ``transformers``
runs static batches of ``--hf-batch`` requests in arrival order, left-padded to the batch's longest
prompt, each batch generating its longest request's output length; only each request's own
requested tokens count as useful output.

Roofline: the fewest FLOPs the workload needs (2 x weights of each linear layer x tokens it
processes: every prompt and output token through the decoder layers, the LM head only for the
positions that yield an output token; plus causal attention, 4 x heads x head_dim x context per
position per layer) divided by the fp32 matmul rate measured on the spot (the best of a few large
``torch.mm``). Its output tokens/s is an upper bound no implementation on this machine can beat:
it ignores memory bandwidth, softmax, norms and everything else that is not a matmul.

Each system runs in a fresh process, so its peak RSS (``getrusage``) is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

SYSTEMS = ("engine", "hf")
SYSTEM_LABELS = {"engine": "llmkube engine", "hf": "transformers"}
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workloads(quick: bool, vocab: int, seed: int) -> list[Workload]:
    """Both workloads with seeded random prompts over the ``vocab`` ordinary (non-added) token ids."""
    rng = random.Random(seed)
    n = 8 if quick else 64
    fixed_prompt, fixed_output = (64, 16) if quick else (128, 64)
    prompt_range, output_range = ((16, 128), (4, 32)) if quick else ((32, 512), (16, 256))

    def prompt(length: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(length)]

    fixed = Workload(
        "fixed",
        f"{n} req, {fixed_prompt} -> {fixed_output}",
        [prompt(fixed_prompt) for _ in range(n)],
        [fixed_output] * n,
    )
    lens = [(rng.randint(*prompt_range), rng.randint(*output_range)) for _ in range(n)]
    mixed = Workload(
        "mixed",
        f"{n} req, {prompt_range[0]}-{prompt_range[1]} -> {output_range[0]}-{output_range[1]}",
        [prompt(p) for p, _ in lens],
        [o for _, o in lens],
    )
    return [fixed, mixed]


# ------------------------------------------------------------------------------------ roofline


def matmul_gflops(n: int, repeats: int) -> float:
    """Best fp32 GFLOP/s of an n x n by n x n ``torch.mm`` over ``repeats`` timed runs (after one warm-up)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        heads = config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab=config["vocab_size"],
        )

    @property
    def layer_matmul_params(self) -> int:
        """Weights of every decoder layer's linear maps (q, k, v, o, gate, up, down), all layers."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (q_o + k_v + mlp)

    @property
    def head_params(self) -> int:
        return self.hidden * self.vocab

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 4  # float32

    def flops(self, prompt_len: int, output_len: int) -> float:
        """Minimum FLOPs of one request (see the module docstring)."""
        tokens = prompt_len + output_len
        linear = 2 * self.layer_matmul_params * tokens + 2 * self.head_params * output_len
        # Position i attends to i + 1 keys: QK^T and PV, 2 FLOPs per multiply-add each.
        attention = 4 * self.layers * self.heads * self.head_dim * tokens * (tokens + 1) / 2
        return linear + attention


# ------------------------------------------------------------------------------------ systems


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _setup_child(threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)


def run_engine(checkpoint: str, workloads: list[Workload], kv_cache_bytes: int, threads: int) -> dict[str, Any]:
    """Child process: load the engine once, warm it up, then time ``generate`` on each workload."""
    _setup_child(threads)
    from llmkube.serving.engine.config import EngineConfig
    from llmkube.serving.engine.llm_engine import LLMEngine
    from llmkube.serving.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=checkpoint,
            dtype="float32",
            device="cpu",
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            block_size=BLOCK_SIZE,
            kv_cache_memory_bytes=kv_cache_bytes,
            # The workloads' longest request: the default (the checkpoint's 2048) would make the
            # engine insist on a KV cache that holds a 2048-token sequence.
            max_model_len=max(len(p) + o for w in workloads for p, o in zip(w.prompts, w.output_lens, strict=True)),
        )
    )
    load_s = time.perf_counter() - start

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    engine.generate([[1, 2, 3, 4] * 8, [5, 6, 7] * 5], [params(4), params(4)])  # warm-up
    results: dict[str, Any] = {}
    for workload in workloads:
        start = time.perf_counter()
        outputs = engine.generate(workload.prompts, [params(n) for n in workload.output_lens])
        seconds = time.perf_counter() - start
        results[workload.name] = {"seconds": seconds, "outputs": outputs}
    stats = engine.stats()
    return {
        "load_s": load_s,
        "peak_rss_bytes": _peak_rss_bytes(),
        "kv_cache_bytes": kv_cache_bytes,
        "num_preemptions": stats.num_preemptions,
        "workloads": results,
    }


def run_hf(checkpoint: str, workloads: list[Workload], batch_size: int, threads: int) -> dict[str, Any]:
    """Child process: static left-padded batches through ``transformers`` ``generate``."""
    _setup_child(threads)
    from transformers import AutoModelForCausalLM, GenerationConfig

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    load_s = time.perf_counter() - start
    pad_id = model.generation_config.pad_token_id
    # generate() fills unset fields from the model's own generation config: clear EOS there too.
    model.generation_config.eos_token_id = None

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        config = GenerationConfig(
            max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id, eos_token_id=None
        )
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        assert out.shape[1] == width + new_tokens, "a batch stopped early"
        return out[:, width:].tolist()

    generate([[1, 2, 3, 4] * 8, [5, 6, 7] * 5], 4)  # warm-up
    results: dict[str, Any] = {}
    for workload in workloads:
        outputs: list[list[int]] = []
        generated = 0
        start = time.perf_counter()
        for first in range(0, len(workload.prompts), batch_size):
            prompts = workload.prompts[first : first + batch_size]
            wanted = workload.output_lens[first : first + batch_size]
            batch_out = generate(prompts, max(wanted))
            generated += len(prompts) * max(wanted)
            outputs += [tokens[:n] for tokens, n in zip(batch_out, wanted, strict=True)]
        seconds = time.perf_counter() - start
        results[workload.name] = {"seconds": seconds, "outputs": outputs, "generated_tokens": generated}
    return {
        "load_s": load_s,
        "peak_rss_bytes": _peak_rss_bytes(),
        "batch_size": batch_size,
        "workloads": results,
    }


def in_fresh_process(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


# ------------------------------------------------------------------------------------ report


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """How many requests match token for token, and the mean share of tokens before they diverge."""
    identical = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = []
    for x, y in zip(a, b, strict=True):
        same = next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y)))
        prefix.append(same / max(len(x), 1))
    return {"identical_requests": identical, "mean_common_prefix": sum(prefix) / len(prefix)}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def build_report(
    shape: ModelShape,
    gflops: float,
    workloads: list[Workload],
    runs: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    report: dict[str, Any] = {"workloads": {}}
    for workload in workloads:
        model_flops = sum(shape.flops(len(p), o) for p, o in zip(workload.prompts, workload.output_lens, strict=True))
        min_seconds = model_flops / (gflops * 1e9)
        entry: dict[str, Any] = {
            "description": workload.description,
            "requests": len(workload.prompts),
            "prompt_tokens": workload.prompt_tokens,
            "output_tokens": workload.output_tokens,
            "model_gflop": model_flops / 1e9,
            "roofline_seconds": min_seconds,
            "roofline_output_tokens_per_s": workload.output_tokens / min_seconds,
            "systems": {},
        }
        for system, run in runs.items():
            result = run["workloads"][workload.name]
            got = [len(o) for o in result["outputs"]]
            if got != workload.output_lens:
                raise RuntimeError(f"{system} returned {sum(got)} tokens on {workload.name}, "
                                   f"expected {workload.output_tokens}")
            seconds = result["seconds"]
            entry["systems"][system] = {
                "seconds": seconds,
                "output_tokens_per_s": workload.output_tokens / seconds,
                "fraction_of_roofline": min_seconds / seconds,
                **({"generated_tokens": result["generated_tokens"]} if "generated_tokens" in result else {}),
            }
        if len(runs) == 2:
            entry["engine_vs_hf"] = entry["systems"]["engine"]["output_tokens_per_s"] / (
                entry["systems"]["hf"]["output_tokens_per_s"]
            )
            entry["agreement"] = agreement(
                runs["engine"]["workloads"][workload.name]["outputs"],
                runs["hf"]["workloads"][workload.name]["outputs"],
            )
        report["workloads"][workload.name] = entry
    report["systems"] = {
        system: {k: v for k, v in run.items() if k != "workloads"} for system, run in runs.items()
    }
    return report


def print_report(report: dict[str, Any]) -> None:
    meta = report["meta"]
    print(
        f"\n{meta['arch']} '{meta['size']}' checkpoint: {meta['matmul_params'] / 1e6:.1f}M parameters in "
        f"matmuls, float32, {meta['threads']} threads on {meta['cpu_count']} CPUs (torch {meta['torch']})"
    )
    print(
        f"fp32 matmul: {report['matmul_gflops']:.1f} GFLOP/s "
        f"(best of {meta['matmul_repeats']} {meta['matmul_n']}x{meta['matmul_n']} torch.mm)\n"
    )
    header = (f"{'workload':<32} {'system':<22} {'time s':>8} {'out tok/s':>10} {'vs HF':>7} "
              f"{'roofline tok/s':>15} {'of roofline':>12}")
    print(header)
    print("-" * len(header))
    hf_label = f"transformers b={report['systems']['hf']['batch_size']}" if "hf" in report["systems"] else ""
    for name, entry in report["workloads"].items():
        label = f"{name}: {entry['description']}"
        for system, result in entry["systems"].items():
            ratio = ""
            if "engine_vs_hf" in entry:
                ratio = f"{entry['engine_vs_hf']:.2f}x" if system == "engine" else "1.00x"
            print(
                f"{label:<32} {SYSTEM_LABELS[system] if system == 'engine' else hf_label:<22} "
                f"{result['seconds']:>8.2f} {result['output_tokens_per_s']:>10.1f} {ratio:>7} "
                f"{entry['roofline_output_tokens_per_s']:>15.1f} {result['fraction_of_roofline']:>11.1%}"
            )
            label = ""
        extra = (f"  {entry['prompt_tokens']} prompt + {entry['output_tokens']} output tokens, "
                 f"{entry['model_gflop']:.4g} GFLOP minimum")
        if "hf" in entry["systems"]:
            extra += f"; transformers generated {entry['systems']['hf']['generated_tokens']} tokens"
        if "agreement" in entry:
            agree = entry["agreement"]
            extra += (f"; identical outputs {agree['identical_requests']}/{entry['requests']} "
                      f"(mean common prefix {agree['mean_common_prefix']:.0%})")
        print(extra)
    print()
    for system, info in report["systems"].items():
        line = f"{SYSTEM_LABELS[system]:<15} peak RSS {_gib(info['peak_rss_bytes'])}, load {info['load_s']:.1f} s"
        if system == "engine":
            line += f", KV cache {_gib(info['kv_cache_bytes'])}, preemptions {info['num_preemptions']}"
        print(line)


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 requests with short lengths (a smoke run)")
    parser.add_argument("--only", choices=SYSTEMS, help="run one system only")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every number as JSON")
    parser.add_argument("--hf-batch", type=int, default=16, help="transformers static batch size (default 16)")
    parser.add_argument("--arch", default="llama", help="checkpoint architecture (default llama)")
    parser.add_argument("--size", default="small", help="checkpoint size (default small; tiny for a smoke run)")
    parser.add_argument("--checkpoint", type=Path, help="reuse this checkpoint directory (written if empty)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from llmkube.serving.testing import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="llmkube-bench-") as tmp:
        checkpoint = args.checkpoint or Path(tmp)
        if not (checkpoint / "config.json").exists():
            print(f"writing {args.arch} '{args.size}' checkpoint to {checkpoint} ...", flush=True)
            write_checkpoint(checkpoint, arch=args.arch, size=args.size, seed=args.seed)
        config = json.loads((checkpoint / "config.json").read_text())
        shape = ModelShape.from_config(config)
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).get_vocab_size(with_added_tokens=False)
        workloads = make_workloads(args.quick, vocab, args.seed)

        matmul_n, repeats = (1024, 3) if args.quick else (2048, 5)
        gflops = matmul_gflops(matmul_n, repeats)
        print(f"fp32 matmul: {gflops:.1f} GFLOP/s", flush=True)

        # Room for every request of the largest workload at full length at once: no preemption.
        kv_cache_bytes = max(
            sum(-(-(len(p) + o) // BLOCK_SIZE) for p, o in zip(w.prompts, w.output_lens, strict=True))
            for w in workloads
        ) * BLOCK_SIZE * shape.kv_bytes_per_token
        runs: dict[str, dict[str, Any]] = {}
        for system in SYSTEMS:
            if args.only and system != args.only:
                continue
            print(f"running {SYSTEM_LABELS[system]} ...", flush=True)
            if system == "engine":
                runs[system] = in_fresh_process(run_engine, str(checkpoint), workloads, kv_cache_bytes, args.threads)
            else:
                runs[system] = in_fresh_process(run_hf, str(checkpoint), workloads, args.hf_batch, args.threads)

    report = build_report(shape, gflops, workloads, runs)
    report["matmul_gflops"] = gflops
    report["meta"] = {
        "arch": args.arch,
        "size": args.size,
        "shape": asdict(shape),
        "matmul_params": shape.layer_matmul_params + shape.head_params,
        "quick": args.quick,
        "seed": args.seed,
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "matmul_n": matmul_n,
        "matmul_repeats": repeats,
    }
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return report


if __name__ == "__main__":
    main()
