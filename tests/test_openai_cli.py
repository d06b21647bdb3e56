"""The ``llmkube`` console script: argument parsing, ``serve --demo`` as a real process, ``generate``."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from llmkube.serving.cli import build_parser, default_served_name, parse_size

LLMKUBE = Path(sys.executable).with_name("llmkube")


def test_parse_size() -> None:
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("1.5G") == 1_500_000_000
    assert parse_size("4096") == 4096
    assert parse_size("64kib") == 65536
    for bad in ("lots", "2XB", "-1GiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_default_served_name(tmp_path: Path) -> None:
    assert default_served_name("hf://Qwen/Qwen2.5-0.5B-Instruct@main") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert default_served_name("hf://org/name") == "org/name"
    assert default_served_name(str(tmp_path / "my-model")) == "my-model"


def test_parser_needs_a_model_and_knows_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve"])
    assert "--model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "x", "--demo"])
    args = parser.parse_args(["serve", "--model", "/m", "--port", "0", "--kv-cache-memory", "1GiB",
                              "--max-num-seqs", "8", "--tool-call-parser", "llama3_json", "--dtype", "float32"])
    assert (args.model, args.port, args.kv_cache_memory, args.max_num_seqs) == ("/m", 0, 1024**3, 8)
    assert args.tool_call_parser == "llama3_json" and args.max_body_size == 32 * 1024**2
    assert args.host == "127.0.0.1" and args.api_key is None


@pytest.mark.skipif(not LLMKUBE.exists(), reason="the llmkube console script is not installed")
def test_serve_demo_end_to_end(tmp_path: Path) -> None:
    env = {**os.environ, "LLMKUBE_CACHE_DIR": str(tmp_path / "cache"), "LLMKUBE_API_KEY": "env-key"}
    proc = subprocess.Popen(
        [str(LLMKUBE), "serve", "--demo", "--port", "0", "--kv-cache-memory", "64MiB", "--max-model-len", "1024"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "ready: serving" in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(120), "".join(lines)
        log = "".join(lines)
        url = re.search(r"listening on (http://127\.0\.0\.1:\d+/v1)", log).group(1)  # type: ignore[union-attr]
        assert "'llmkube-demo'" in log and "API key: required" in log
        client = openai.OpenAI(base_url=url, api_key="env-key", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["llmkube-demo"]
        reply = client.chat.completions.create(model="llmkube-demo", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
        assert reply.choices[0].finish_reason in {"stop", "length"}
        assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    reader.join(timeout=10)
    # uvicorn shuts down gracefully (lifespan: engine stopped), then re-raises the signal it caught.
    assert rc in (0, -signal.SIGTERM), "".join(lines)
    assert "Application shutdown complete" in "".join(lines)
    assert (tmp_path / "cache").is_dir()


@pytest.mark.skipif(not LLMKUBE.exists(), reason="the llmkube console script is not installed")
def test_generate_prints_a_completion(qwen2_tiny: Path) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [str(LLMKUBE), "generate", "--model", str(qwen2_tiny), "--max-tokens", "5", "--kv-cache-memory", "16MiB",
         "The weather in Paris is"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert re.search(r"\[finish_reason=(stop|length)\]", done.stderr)
    assert time.monotonic() - started < 120
