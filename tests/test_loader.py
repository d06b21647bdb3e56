"""Checkpoint resolution (local and hf:// from an offline cache), safetensors reading, dtypes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmkube.serving.engine.errors import ModelLoadError
from llmkube.serving.engine.loader import (
    config_dtype_name,
    iter_safetensors,
    parse_hf_source,
    resolve_dtype,
    resolve_model_path,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"


# --------------------------------------------------------------------------- sources


def test_resolve_local(qwen2_tiny: Path, tmp_path: Path) -> None:
    assert resolve_model_path(str(qwen2_tiny)) == qwen2_tiny
    assert resolve_model_path(f"file://{qwen2_tiny}") == qwen2_tiny
    with pytest.raises(ModelLoadError, match="not a directory"):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ModelLoadError, match="hf://org/model"):
        resolve_model_path("org/model")


def test_parse_hf_source() -> None:
    assert parse_hf_source("hf://Qwen/Qwen2.5-0.5B") == ("Qwen/Qwen2.5-0.5B", None)
    assert parse_hf_source("hf://org/name@v1.0") == ("org/name", "v1.0")
    for bad in ("hf://justname", "hf://a/b/c", "hf:///name"):
        with pytest.raises(ModelLoadError, match="expected hf://org/name"):
            parse_hf_source(bad)


@pytest.fixture
def offline_hub(qwen2_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An HF hub cache holding org/tiny at COMMIT (refs/main -> COMMIT), in the standard layout."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in sorted(qwen2_tiny.iterdir()):
        blob = repo / "blobs" / f"blob-{f.name}"  # real blobs are named by etag; any name resolves
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return snapshot


def test_resolve_hf_offline(offline_hub: Path) -> None:
    assert resolve_model_path("hf://org/tiny") == offline_hub
    assert resolve_model_path(f"hf://org/tiny@{COMMIT}") == offline_hub
    assert resolve_model_path("hf://org/tiny", revision="main") == offline_hub
    assert (resolve_model_path("hf://org/tiny") / "model.safetensors").is_file()


def test_resolve_hf_offline_errors(offline_hub: Path) -> None:
    with pytest.raises(ModelLoadError, match="org/missing"):
        resolve_model_path("hf://org/missing")
    with pytest.raises(ModelLoadError, match="deadbeef"):
        resolve_model_path("hf://org/tiny@deadbeef")
    with pytest.raises(ModelLoadError, match="revision"):
        resolve_model_path(f"hf://org/tiny@{COMMIT}", revision="other")


def test_resolve_hf_snapshot_without_config(offline_hub: Path) -> None:
    (offline_hub / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        resolve_model_path("hf://org/tiny")


# --------------------------------------------------------------------------- weights


def test_iter_single_file(qwen2_tiny: Path) -> None:
    expected = load_file(qwen2_tiny / "model.safetensors")
    got = dict(iter_safetensors(qwen2_tiny, torch.float32))
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    as_bf16 = dict(iter_safetensors(qwen2_tiny / "model.safetensors", torch.bfloat16, torch.device("cpu")))
    assert {t.dtype for t in as_bf16.values()} == {torch.bfloat16}
    assert torch.equal(as_bf16["model.norm.weight"], expected["model.norm.weight"].to(torch.bfloat16))


def test_iter_sharded_matches_single(tiny_checkpoint: Callable[..., Path]) -> None:
    sharded = tiny_checkpoint("qwen3", sharded=True, num_shards=3)
    single = dict(iter_safetensors(tiny_checkpoint("qwen3"), torch.float32))
    names = [n for n, _ in iter_safetensors(sharded, torch.float32)]
    assert sorted(names) == sorted(single) and len(names) == len(set(names))
    upcast = dict(iter_safetensors(tiny_checkpoint("qwen3", sharded=True, dtype="bfloat16"), torch.float32))
    assert upcast["model.embed_tokens.weight"].dtype == torch.float32
    assert torch.equal(upcast["model.norm.weight"], single["model.norm.weight"].to(torch.bfloat16).float())


def test_iter_errors_name_the_file(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    src = tiny_checkpoint("llama", sharded=True)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    shard2 = "model-00002-of-00002.safetensors"

    (ckpt / shard2).rename(tmp_path / shard2)
    with pytest.raises(ModelLoadError, match=shard2):
        list(iter_safetensors(ckpt, torch.float32))
    (tmp_path / shard2).rename(ckpt / shard2)

    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = shard2
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=rf"{shard2} lacks tensor.*layers\.9"):
        list(iter_safetensors(ckpt, torch.float32))

    index_path.write_text("{broken")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors\.index\.json"):
        list(iter_safetensors(ckpt, torch.float32))
    index_path.write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(ModelLoadError, match="no weight_map"):
        list(iter_safetensors(ckpt, torch.float32))


def test_iter_corrupt_and_missing(qwen2_tiny: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "trunc"
    truncated.mkdir()
    data = (qwen2_tiny / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"trunc/model\.safetensors"):
        list(iter_safetensors(truncated, torch.float32))

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=r"garbage/model\.safetensors"):
        list(iter_safetensors(garbage, torch.float32))

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors"):
        list(iter_safetensors(empty, torch.float32))
    (empty / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin"):
        list(iter_safetensors(empty, torch.float32))
    with pytest.raises(ModelLoadError, match="does not exist"):
        list(iter_safetensors(tmp_path / "nowhere", torch.float32))


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize(
    ("name", "config", "device", "expected"),
    [
        ("auto", "bfloat16", "cuda", torch.bfloat16),
        ("auto", "bfloat16", "cpu", torch.bfloat16),
        ("auto", "float16", "cuda", torch.float16),
        ("auto", "float16", "cpu", torch.float32),
        ("auto", "torch.float16", "cuda:0", torch.float16),
        ("auto", None, "cuda", torch.float32),
        ("auto", "float32", "cpu", torch.float32),
        ("float16", "bfloat16", "cpu", torch.float16),
        ("bf16", None, "cpu", torch.bfloat16),
        ("FP32", "bfloat16", "cuda", torch.float32),
        ("half", None, "cuda", torch.float16),
    ],
)
def test_resolve_dtype(name: str, config: str | None, device: str, expected: torch.dtype) -> None:
    assert resolve_dtype(name, config, device) == expected


def test_resolve_dtype_errors() -> None:
    with pytest.raises(ModelLoadError, match="int8"):
        resolve_dtype("int8", None, "cpu")
    with pytest.raises(ModelLoadError, match="float8_e4m3fn"):
        resolve_dtype("auto", "float8_e4m3fn", "cpu")


def test_config_dtype_name() -> None:
    assert config_dtype_name({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert config_dtype_name({"dtype": "float16"}) == "float16"
    assert config_dtype_name({}) is None
