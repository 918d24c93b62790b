"""Tokenizers the trainer, actors and rescoring share: an offline byte-level one, or a local HF one.

The byte tokenizer needs no files: ids 0-255 are the UTF-8 bytes, then three specials (pad, bos,
eos). A :class:`TokenizerSpec` names which tokenizer a run uses; it is recorded in the run's
``model.json`` so every process rebuilds the same one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from deltarl.errors import ConfigError


@runtime_checkable
class Tokenizer(Protocol):
    """What deltarl needs of a tokenizer: text <-> ids and three special ids."""

    vocab_size: int
    pad_token_id: int
    bos_token_id: int | None
    eos_token_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens dropped."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255, then ``<pad>`` 256, ``<bos>`` 257, ``<eos>`` 258."""

    NUM_BYTES = 256
    pad_token_id = 256
    bos_token_id: int | None = 257
    eos_token_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes below 256 decoded as UTF-8 (invalid sequences replaced); specials dropped."""
        return bytes(int(i) for i in ids if 0 <= int(i) < self.NUM_BYTES).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A local Hugging Face tokenizer (``local_files_only=True``) behind the :class:`Tokenizer` protocol."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except OSError as err:
            raise ConfigError(f"no local tokenizer at {path!r}: {err}") from err
        eos = self._tok.eos_token_id
        if eos is None:
            raise ConfigError(f"tokenizer at {path!r} has no eos token")
        self.eos_token_id = int(eos)
        pad = self._tok.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_id
        bos = self._tok.bos_token_id
        self.bos_token_id = int(bos) if bos is not None else None
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(self, text: str) -> list[int] | None:
        """Ids of ``text`` as one user turn with the generation prompt, or ``None`` without a template."""
        if not getattr(self._tok, "chat_template", None):
            return None
        ids = self._tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]


class TokenizerSpec(BaseModel):
    """Which tokenizer a run uses; stored in ``<run>/model.json``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["byte", "hf"] = Field(default="byte", description="'byte': the built-in byte tokenizer; 'hf': a local HF tokenizer")
    path: str | None = Field(default=None, description="local directory of the HF tokenizer (kind 'hf' only)")
    chat_template: bool = Field(default=False, description="wrap prompts in the tokenizer's chat template (kind 'hf' with a template only)"
    )


def load_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """Build the tokenizer ``spec`` names. Nothing is downloaded."""
    if spec.kind == "byte":
        return ByteTokenizer()
    if not spec.path:
        raise ConfigError("tokenizer kind 'hf' needs a local path")
    return HFTokenizer(spec.path)


def encode_prompt(tokenizer: Tokenizer, text: str, *, chat_template: bool = False) -> list[int]:
    """Prompt ids: bos (when the tokenizer has one and no template is used) then the text's ids."""
    if chat_template and isinstance(tokenizer, HFTokenizer):
        ids = tokenizer.apply_chat_template(text)
        if ids is not None:
            return ids
    prefix = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return prefix + tokenizer.encode(text)
