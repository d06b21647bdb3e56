"""The checkpoint's tokenizer, read without ``transformers``.

``transformers`` costs seconds and hundreds of MB to import; the API ingress
only needs to tokenize, so this wraps the Rust ``tokenizers`` library and reads
the small JSON files that ``transformers`` would (``tokenizer_config.json``,
``special_tokens_map.json``, ``generation_config.json``, ``config.json``,
``chat_template.jinja``) the way it does.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from llmkube.serving.engine.errors import ModelLoadError

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: vocab character -> the byte it stands for.

    Byte-level BPE stores each byte as one printable character: printable
    Latin-1 bytes as themselves, the other 68 bytes as U+0100 onwards.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    byte_values = list(printable)
    for b in range(256):
        if b not in printable:
            byte_values.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(byte_values, chars, strict=True)}


def _read_json(path: Path, *, required: bool = False) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"missing {path.name} in {path.parent}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer configs: a string, ``{"content": ...}`` or null."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool):  # bool is an int subclass; never a token id
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _select_chat_template(value: Any, source: Path) -> str | None:
    """``chat_template`` is a string, or a list of ``{"name", "template"}`` of which we use "default"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, Mapping) and entry.get("name") == "default":
                template = entry.get("template")
                return template if isinstance(template, str) else None
        return None
    raise ModelLoadError(f"{source}: chat_template must be a string or a list, got {type(value).__name__}")


def _decoder_kind(tokenizer_json: Mapping[str, Any]) -> str:
    """How vocab strings map to text bytes: "byte_level", "sentencepiece" or "other"."""

    def types(node: Any) -> list[str]:
        if not isinstance(node, Mapping):
            return []
        found = [str(node.get("type"))]
        for child in node.get("decoders") or []:
            found += types(child)
        return found

    decoder_types = types(tokenizer_json.get("decoder"))
    if "ByteLevel" in decoder_types:
        return "byte_level"
    if {"ByteFallback", "Metaspace", "Replace"} & set(decoder_types):
        return "sentencepiece"
    return "other"


class Tokenizer:
    """A Hugging Face fast tokenizer plus the special-token and chat-template settings around it.

    Ids the model can produce but the tokenizer does not know (embedding rows
    padded to a multiple of 64, say) decode to nothing: ``convert_ids_to_tokens``
    gives ``""`` and ``token_bytes`` gives ``b""`` for them.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        tokenizer_config: Mapping[str, Any] | None = None,
        special_tokens_map: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        model_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        decoder_kind: str = "other",
    ) -> None:
        tc = dict(tokenizer_config or {})
        stm = dict(special_tokens_map or {})
        gen = dict(generation_config or {})
        cfg = dict(model_config or {})

        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template: str | None = chat_template
        self.add_bos_token: bool = bool(tc.get("add_bos_token", False))
        self.add_eos_token: bool = bool(tc.get("add_eos_token", False))
        self._decoder_kind = decoder_kind

        # As in transformers, special_tokens_map.json overrides tokenizer_config.json.
        specials: dict[str, str | None] = {k: _token_content(tc.get(k)) for k in _SPECIAL_KEYS}
        for key in _SPECIAL_KEYS:
            if _token_content(stm.get(key)) is not None:
                specials[key] = _token_content(stm.get(key))
        self.bos_token: str | None = specials["bos_token"]
        self.eos_token: str | None = specials["eos_token"]
        self.pad_token: str | None = specials["pad_token"]
        self.unk_token: str | None = specials["unk_token"]
        self.bos_token_id: int | None = self.token_to_id(self.bos_token)
        self.eos_token_id: int | None = self.token_to_id(self.eos_token)
        self.pad_token_id: int | None = self.token_to_id(self.pad_token)

        eos_ids = {self.eos_token_id} if self.eos_token_id is not None else set()
        eos_ids.update(_as_id_list(gen.get("eos_token_id")))
        eos_ids.update(_as_id_list(cfg.get("eos_token_id")))
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)

        special_ids = {tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special}
        additional = stm.get("additional_special_tokens") or tc.get("additional_special_tokens") or []
        for content in [*specials.values(), *(_token_content(t) for t in additional)]:
            tid = self.token_to_id(content)
            if tid is not None:
                special_ids.add(tid)
        self.all_special_ids: frozenset[int] = frozenset(special_ids)

        max_len = tc.get("model_max_length")
        # transformers writes int(1e30) for "no limit".
        self.model_max_length: int | None = (
            int(max_len) if isinstance(max_len, int | float) and 0 < max_len < 1e29 else None
        )
        self._token_bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load from a checkpoint directory; only ``tokenizer.json`` is required."""
        root = Path(path)
        if not root.is_dir():
            raise ModelLoadError(f"tokenizer directory {root} does not exist")
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"missing tokenizer.json in {root} (only fast tokenizers are supported)")
        try:
            text = tok_file.read_text(encoding="utf-8")
            backend = tokenizers.Tokenizer.from_str(text)
            decoder_kind = _decoder_kind(json.loads(text))
        except Exception as exc:  # the Rust library raises plain Exception subclasses
            raise ModelLoadError(f"cannot load {tok_file}: {exc}") from exc

        tokenizer_config = _read_json(root / "tokenizer_config.json")
        chat_template = _select_chat_template(
            tokenizer_config.get("chat_template"), root / "tokenizer_config.json"
        )
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():  # transformers >= 4.43 saves it here, and prefers it when present
            try:
                chat_template = jinja_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ModelLoadError(f"cannot read {jinja_file}: {exc}") from exc

        return cls(
            backend,
            tokenizer_config=tokenizer_config,
            special_tokens_map=_read_json(root / "special_tokens_map.json"),
            generation_config=_read_json(root / "generation_config.json"),
            model_config=_read_json(root / "config.json"),
            chat_template=chat_template,
            decoder_kind=decoder_kind,
        )

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        With ``add_special_tokens`` the tokenizer.json post-processor runs and
        ``add_bos_token``/``add_eos_token`` from tokenizer_config.json are
        honoured (without doubling a BOS the post-processor already added).
        Prompts rendered from a chat template already hold their special
        tokens: encode those with ``add_special_tokens=False``.
        """
        ids = list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token and self.eos_token_id is not None and (not ids or ids[-1] != self.eos_token_id):
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Raw vocabulary strings (byte-level BPE: ``'Ġhello'``); ``""`` for unknown ids."""
        return [self.backend.id_to_token(int(i)) or "" for i in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes this token adds to the decoded text.

        Concatenating ``token_bytes`` over a sequence gives the UTF-8 of its
        decoded text even where one character spans several tokens (which
        per-token ``decode`` cannot show). Added/special tokens contribute their
        content. SentencePiece vocabularies map ``▁`` to a space; the leading
        space their decoder strips from the first token is kept here.
        """
        cached = self._token_bytes_cache.get(token_id)
        if cached is None:
            cached = self._compute_token_bytes(token_id)
            self._token_bytes_cache[token_id] = cached
        return cached

    def _compute_token_bytes(self, token_id: int) -> bytes:
        token = self.backend.id_to_token(int(token_id))
        if token is None:
            return b""
        added = self._added_token_contents.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        if self._decoder_kind == "byte_level":
            table = _gpt2_unicode_to_byte()
            if all(c in table for c in token):
                return bytes(table[c] for c in token)
            return token.encode("utf-8")
        if self._decoder_kind == "sentencepiece":
            match = _SP_BYTE.match(token)
            if match:
                return bytes([int(match.group(1), 16)])
            return token.replace("▁", " ").encode("utf-8")
        return self.backend.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")

    @functools.cached_property
    def _added_token_contents(self) -> dict[int, str]:
        return {tid: tok.content for tid, tok in self.backend.get_added_tokens_decoder().items()}

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, eos_token={self.eos_token!r}, "
            f"eos_token_ids={sorted(self.eos_token_ids)}, chat_template={self.chat_template is not None})"
        )
