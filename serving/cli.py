"""The ``llmkube`` command line.

Subcommands register themselves on one argparse parser, so others (``operator``,
``bench``) plug in with a ``register_*`` function beside the ones here:

* ``llmkube serve --model PATH|hf://org/name[@rev] | --demo``: engine + OpenAI API in one
  process (uvicorn);
* ``llmkube generate --model PATH | --demo "prompt"``: a smoke test that prints a completion.

Heavy imports (torch, the engine) happen inside the commands: ``llmkube --help`` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("llmkube.serve")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}


def parse_size(text: str) -> int:
    """``"2GiB"`` -> 2147483648; ``"512M"`` -> 512000000; a plain number is bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 1000000)")
    unit = (match.group(2) or "").upper().removesuffix("B")
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"unknown unit in {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def default_served_name(model: str) -> str:
    """``hf://org/name@rev`` -> ``org/name``; a directory -> its name."""
    if model.startswith("hf://"):
        return model.removeprefix("hf://").split("@", 1)[0]
    return Path(model).resolve().name or model


# --- engine options shared by serve and generate ---------------------------------------------


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="checkpoint directory or hf://org/name[@revision]")
    source.add_argument("--demo", action="store_true",
                        help="generate (once, cached) and use a tiny random-weight demo model")
    parser.add_argument("--max-model-len", type=_positive_int, default=None,
                        help="context length (default: the checkpoint's)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max-num-seqs", type=_positive_int, default=None,
                        help="most sequences decoded in one batch")
    parser.add_argument("--kv-cache-memory", type=parse_size, default=None,
                        help="KV cache size, e.g. 2GiB (default: a share of free GPU memory, 2GiB on CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)


def _model_path(args: argparse.Namespace) -> str:
    if args.demo:
        from llmkube.serving.testing import demo_checkpoint

        return str(demo_checkpoint())
    return str(args.model)


def _build_engine(args: argparse.Namespace, model: str) -> Any:
    from llmkube.serving.engine.async_engine import AsyncEngine
    from llmkube.serving.engine.config import EngineConfig

    options: dict[str, Any] = {"model": model, "dtype": args.dtype, "device": args.device,
                               "max_model_len": args.max_model_len}
    if args.max_num_seqs is not None:
        options["max_num_seqs"] = args.max_num_seqs
    if args.kv_cache_memory is not None:
        options["kv_cache_memory_bytes"] = args.kv_cache_memory
    if args.gpu_memory_utilization is not None:
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    return AsyncEngine(EngineConfig(**options))


# --- llmkube serve ------------------------------------------------------------------------------


def register_serve(subparsers: Any) -> None:
    parser = subparsers.add_parser("serve", help="serve a model over the OpenAI API (one process)",
                                   description="Run the engine and the OpenAI-compatible API in uvicorn.")
    _add_model_args(parser)
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients send as `model` (default: the model directory's name, "
                             "or org/name for hf://; 'llmkube-demo' with --demo)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` (default: $LLMKUBE_API_KEY, else none)")
    parser.add_argument("--tool-call-parser", default="hermes",
                        help="hermes|qwen|llama3_json|mistral|pythonic, or 'none' to disable tool_choice=auto")
    parser.add_argument("--chat-template", default=None, help="a jinja file overriding the checkpoint's template")
    parser.add_argument("--max-concurrent-requests", type=_positive_int, default=None,
                        help="answer 503 beyond this many requests in flight (default: no limit)")
    parser.add_argument("--max-body-size", type=parse_size, default="32MiB", help="413 for larger bodies")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from llmkube.serving.openai.app import build_app
    from llmkube.serving.openai.lifespan import loading_lifespan
    from llmkube.serving.openai.pending_engine import PendingEngine
    from llmkube.serving.openai.tool_parsers import TOOL_PARSERS

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser_name = None if args.tool_call_parser == "none" else args.tool_call_parser
    if parser_name is not None and parser_name not in TOOL_PARSERS:
        print(f"llmkube serve: unknown --tool-call-parser {parser_name!r}; choose one of "
              f"{', '.join(sorted(TOOL_PARSERS))} or none", file=sys.stderr)
        return 2
    api_key = args.api_key if args.api_key is not None else os.environ.get("LLMKUBE_API_KEY") or None
    chat_template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    model = _model_path(args)
    name = args.served_model_name or ("llmkube-demo" if args.demo else default_served_name(model))

    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"llmkube serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]

    url = f"http://{args.host}:{port}/v1"
    pending = PendingEngine()

    def load() -> Any:
        return _build_engine(args, model)

    def ready(engine: Any) -> None:
        app.state.ctx.prepare()
        info = engine.model_info
        logger.info(
            "ready: serving model %r (%s, max_model_len=%d) at %s (tool parser: %s, API key: %s)",
            name, info.architecture, info.max_model_len, url, parser_name or "none",
            "required" if api_key else "none",
        )

    app = build_app(pending, name, api_key=api_key, tool_call_parser=parser_name,
                    max_body_bytes=args.max_body_size, chat_template=chat_template,
                    max_concurrent_requests=args.max_concurrent_requests,
                    lifespan=loading_lifespan(pending, load, on_ready=ready))
    logger.info("listening on %s; loading %s as %r (/health answers 503 until it is ready)", url, model, name)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


# --- llmkube generate ---------------------------------------------------------------------------


def register_generate(subparsers: Any) -> None:
    parser = subparsers.add_parser("generate", help="print a completion of a prompt (smoke test)")
    _add_model_args(parser)
    parser.add_argument("prompt")
    parser.add_argument("--max-tokens", type=_positive_int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from llmkube.serving.engine.errors import EngineError
    from llmkube.serving.engine.sampling_params import SamplingParams

    engine = _build_engine(args, _model_path(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)

    async def main() -> str | None:
        await engine.start()
        finish = None
        try:
            ids = engine.tokenizer.encode(args.prompt)
            async for output in engine.generate(ids, params, "generate-0"):
                for sample in output.outputs:
                    sys.stdout.write(sample.text)
                    sys.stdout.flush()
                    finish = sample.finish_reason or finish
        finally:
            await engine.shutdown()
        return finish

    try:
        finish = asyncio.run(main())
    except EngineError as exc:
        print(f"\nllmkube generate: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    print(f"[finish_reason={finish}]", file=sys.stderr)
    return 0


# --- entry point --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmkube", description="Kubernetes-native LLM serving.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    register_serve(subparsers)
    register_generate(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
