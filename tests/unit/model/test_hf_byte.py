"""The HF byte tokenizer gives the byte tokenizer's ids, for any text, and loads offline."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from deltarl.model.hf_byte import save_hf_byte_tokenizer
from deltarl.model.tokenizer import ByteTokenizer, HFTokenizer

TEXTS = ["", "12+30=42", "  leading and  double spaces\n\ttabs", "héllo wörld ✓ 数学 🚀", "<eos> is text here", "\x00\x7f\xff"]


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return HFTokenizer(str(save_hf_byte_tokenizer(tmp_path_factory.mktemp("tok"))))


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_the_byte_tokenizers(hf: HFTokenizer, text: str) -> None:
    ids = ByteTokenizer().encode(text)
    assert hf.encode(text) == ids
    assert hf.decode(ids) == ByteTokenizer().decode(ids)


def test_special_ids_and_vocab(hf: HFTokenizer) -> None:
    byte = ByteTokenizer()
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, hf.vocab_size) == (
        byte.pad_token_id, byte.bos_token_id, byte.eos_token_id, byte.vocab_size)  # fmt: skip
    assert hf.decode([104, 105, byte.eos_token_id, byte.pad_token_id]) == "hi"
