"""The byte tokenizer as a Hugging Face tokenizer, for frameworks that want one (TRL, vLLM).

:func:`save_hf_byte_tokenizer` writes a ``tokenizers``-built fast tokenizer whose ids equal
:class:`~deltarl.model.tokenizer.ByteTokenizer`'s: UTF-8 bytes 0-255, ``<pad>`` 256, ``<bos>`` 257,
``<eos>`` 258. It is built offline (nothing downloaded) and loads with
``AutoTokenizer.from_pretrained(path, local_files_only=True)``.
"""

from __future__ import annotations

import os
from pathlib import Path

from deltarl.model.tokenizer import ByteTokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet (GPT-2's): every byte as one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def save_hf_byte_tokenizer(path: str | os.PathLike[str]) -> Path:
    """Write the byte tokenizer as a HF fast tokenizer into directory ``path``; returns it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte = ByteTokenizer()
    alphabet = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = {"<pad>": byte.pad_token_id, "<bos>": byte.bos_token_id, "<eos>": byte.eos_token_id}
    tok.add_special_tokens([AddedToken(text, special=True) for text in specials])  # ids 256, 257, 258 in order
    for text, want in specials.items():
        if tok.token_to_id(text) != want:  # pragma: no cover - would mean tokenizers changed its id assignment
            raise RuntimeError(f"special token {text} got id {tok.token_to_id(text)}, expected {want}")
    # split_special_tokens: the text "<eos>" is five bytes, as for the byte tokenizer, never id 258
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                 split_special_tokens=True)
    out = Path(path)
    hf.save_pretrained(str(out))
    return out
