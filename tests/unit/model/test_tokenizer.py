"""The byte tokenizer, tokenizer specs, and a local HF tokenizer built offline."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltarl.errors import ConfigError
from deltarl.model.tokenizer import ByteTokenizer, Tokenizer, TokenizerSpec, encode_prompt, load_tokenizer


def test_byte_roundtrip_and_specials() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    text = "3+4=7 ünïcode ✓"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_token_id, *ids, tok.eos_token_id, tok.pad_token_id]) == text
    assert {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id} == {256, 257, 258}
    assert tok.vocab_size == 259


def test_byte_decode_invalid_utf8_is_replaced() -> None:
    assert ByteTokenizer().decode([0xFF, ord("a")]) == "\ufffda"


def test_encode_prompt_adds_bos() -> None:
    tok = ByteTokenizer()
    assert encode_prompt(tok, "1+2=") == [257, *b"1+2="]


def test_load_tokenizer_kinds(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(TokenizerSpec()), ByteTokenizer)
    with pytest.raises(ConfigError):
        load_tokenizer(TokenizerSpec(kind="hf"))
    with pytest.raises(ConfigError):
        load_tokenizer(TokenizerSpec(kind="hf", path=str(tmp_path / "missing")))


def test_local_hf_tokenizer_offline(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<pad>": 0, "<eos>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(tmp_path)
    tok = load_tokenizer(TokenizerSpec(kind="hf", path=str(tmp_path)))
    assert isinstance(tok, Tokenizer)
    assert tok.encode("hello world") == [2, 3]
    assert tok.eos_token_id == 1
    assert tok.pad_token_id == 0
    assert tok.bos_token_id is None
    assert tok.decode([2, 1, 3]) == "hello world"
    assert encode_prompt(tok, "world hello", chat_template=True) == [3, 2]  # no template: plain ids
