"""Finding and reading checkpoints: model sources, safetensors weights, dtypes.

The model classes consume ``iter_safetensors`` through their
``load_weights((hf_name, tensor) ...)``; nothing here knows about
architectures.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from llmkube.serving.engine.errors import ModelLoadError

HF_SCHEME = "hf://"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# What a serving replica needs from a Hub repo: configs, weights, tokenizer, templates.
HF_ALLOW_PATTERNS: tuple[str, ...] = (
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tokenizer.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
)

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


# --------------------------------------------------------------------------- sources


def _truthy_env(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def parse_hf_source(source: str) -> tuple[str, str | None]:
    """``"hf://org/name[@revision]"`` -> ``("org/name", revision or None)``."""
    spec = source[len(HF_SCHEME):] if source.startswith(HF_SCHEME) else source
    repo_id, _, revision = spec.partition("@")
    repo_id = repo_id.strip("/")
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts):
        raise ModelLoadError(f"invalid Hugging Face source {source!r}: expected hf://org/name[@revision]")
    return repo_id, (revision or None)


def _check_checkpoint_dir(path: Path, source: str) -> Path:
    if not path.is_dir():
        raise ModelLoadError(f"model source {source!r}: {path} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model source {source!r}: no config.json in {path}; not a checkpoint directory")
    return path


def resolve_model_path(
    source: str, *, revision: str | None = None, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Turn a model source into a local checkpoint directory.

    ``source`` is a local directory (``file://`` prefix allowed) or
    ``hf://org/name[@revision]``, fetched with ``huggingface_hub.snapshot_download``
    (configs, safetensors, tokenizer files and templates only). A revision in
    the source and the ``revision`` argument must agree. ``HF_HUB_OFFLINE=1``
    (read at call time, unlike huggingface_hub's import-time constant) or an
    unreachable Hub serve the snapshot from the local cache; ``cache_dir``
    defaults to ``$HF_HUB_CACHE``, then huggingface_hub's own default.
    """
    if not source.startswith(HF_SCHEME):
        local = Path(source.removeprefix("file://")).expanduser()
        if not local.exists() and "/" in source and not source.startswith((".", "/", "~")):
            raise ModelLoadError(
                f"model source {source!r} is not a local directory; for a Hugging Face Hub repo "
                f"use hf://{source}"
            )
        return _check_checkpoint_dir(local, source)

    repo_id, source_revision = parse_hf_source(source)
    if revision and source_revision and revision != source_revision:
        raise ModelLoadError(
            f"model source {source!r} names revision {source_revision!r} but revision={revision!r} was given"
        )
    revision = revision or source_revision
    if cache_dir is None and os.environ.get("HF_HUB_CACHE"):
        cache_dir = os.environ["HF_HUB_CACHE"]
    offline = _truthy_env("HF_HUB_OFFLINE") or _truthy_env("TRANSFORMERS_OFFLINE")

    # Imported here: only hf:// sources pay for it.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        local_dir = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=offline,
            allow_patterns=list(HF_ALLOW_PATTERNS),
        )
    except LocalEntryNotFoundError as exc:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub is unreachable"
        raise ModelLoadError(
            f"model {source!r} (revision {revision or 'main'}) is not in the local Hugging Face cache "
            f"{cache_dir or '(default)'} and {why}: {exc}"
        ) from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot download model {source!r} (revision {revision or 'main'}): {exc}") from exc
    return _check_checkpoint_dir(Path(str(local_dir)), source)


# --------------------------------------------------------------------------- weights


def _shard_plan(path: Path) -> list[tuple[Path, list[str] | None]]:
    """Files to read and, for sharded checkpoints, the tensor names each must provide."""
    if path.is_file():
        return [(path, None)]
    if not path.is_dir():
        raise ModelLoadError(f"checkpoint directory {path} does not exist")
    index_path = path / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot read {index_path}: {exc}") from exc
        weight_map = index.get("weight_map") if isinstance(index, Mapping) else None
        if not isinstance(weight_map, Mapping) or not weight_map:
            raise ModelLoadError(f"{index_path} has no weight_map")
        by_file: dict[str, list[str]] = {}
        for name, filename in weight_map.items():
            if not isinstance(filename, str) or Path(filename).name != filename:
                raise ModelLoadError(f"{index_path}: bad shard file name {filename!r} for {name}")
            by_file.setdefault(filename, []).append(name)
        missing = sorted(f for f in by_file if not (path / f).is_file())
        if missing:
            raise ModelLoadError(f"{index_path} lists shard(s) missing from {path}: {', '.join(missing)}")
        return [(path / f, names) for f, names in sorted(by_file.items())]
    single = path / SINGLE_FILE
    if single.is_file():
        return [(single, None)]
    found = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
    hint = f" (found only {', '.join(found)}; only Hugging Face safetensors are supported)" if found else ""
    raise ModelLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}{hint}")


def iter_safetensors(
    path: Path, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight of a checkpoint, converted to ``dtype`` on ``device``.

    ``path`` is a checkpoint directory (``model.safetensors`` or a sharded
    ``model.safetensors.index.json``) or one ``.safetensors`` file. Tensors are
    read one at a time, so peak memory is the model plus one tensor. Every
    problem (missing shard, a tensor the index promises but the shard lacks,
    corrupt file, no weights at all) raises ``ModelLoadError`` naming the file.
    """
    plan = _shard_plan(Path(path))
    device_str = str(device)
    total = 0
    for file, expected in plan:
        try:
            with safe_open(str(file), framework="pt", device=device_str) as handle:
                available = set(handle.keys())
                names = sorted(available) if expected is None else expected
                absent = [n for n in names if n not in available]
                if absent:
                    raise ModelLoadError(
                        f"{file} lacks tensor(s) listed in {INDEX_FILE}: {', '.join(absent[:5])}"
                        + (f" (+{len(absent) - 5} more)" if len(absent) > 5 else "")
                    )
                for name in names:
                    tensor = handle.get_tensor(name)
                    yield name, tensor.to(dtype) if tensor.dtype != dtype else tensor
                    total += 1
        except ModelLoadError:
            raise
        except Exception as exc:  # SafetensorError, OSError, torch errors on a corrupt/truncated file
            raise ModelLoadError(f"cannot read weights from {file}: {exc}") from exc
    if total == 0:
        raise ModelLoadError(f"no tensors in {', '.join(str(f) for f, _ in plan)}")


# --------------------------------------------------------------------------- dtypes


def config_dtype_name(config: Mapping[str, Any]) -> str | None:
    """The checkpoint's declared dtype: ``torch_dtype`` (classic) or ``dtype`` (transformers 5)."""
    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if isinstance(value, str):
            return value
    return None


def _parse_dtype(name: str) -> torch.dtype | None:
    return _DTYPE_NAMES.get(name.strip().lower().removeprefix("torch."))


def resolve_dtype(name: str, config_torch_dtype: str | None, device: torch.device | str) -> torch.dtype:
    """The compute dtype for a model.

    ``name`` is "auto" or an explicit float32/bfloat16/float16 (aliases fp32,
    bf16, fp16, half, float). "auto" takes the checkpoint's ``torch_dtype``,
    float32 when it has none; on CPU an "auto" float16 becomes float32, since
    CPU half-precision matmuls are slow or missing (bfloat16 is kept). An
    explicit choice is always honoured. Unknown names raise ``ModelLoadError``.
    """
    requested = name.strip().lower()
    if requested != "auto":
        dtype = _parse_dtype(requested)
        if dtype is None:
            raise ModelLoadError(
                f"unsupported dtype {name!r}; expected auto, float32, bfloat16 or float16"
            )
        return dtype
    if not config_torch_dtype:
        return torch.float32
    dtype = _parse_dtype(config_torch_dtype)
    if dtype is None:
        raise ModelLoadError(
            f"checkpoint torch_dtype {config_torch_dtype!r} is not supported with dtype=auto; "
            "pass an explicit dtype (float32, bfloat16 or float16)"
        )
    if dtype == torch.float16 and torch.device(device).type == "cpu":
        return torch.float32
    return dtype
