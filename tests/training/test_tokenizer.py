"""The trained byte-level BPE round-trips any text and loads standalone with AutoTokenizer."""

from __future__ import annotations

import pytest

from ray_specdec.training.tokenizer import END_OF_TEXT


@pytest.mark.parametrize("text", [
    "def f(x):\n    return x + 1\n",
    "\ttabs\r\nand CRLF  \n\n   trailing   ",
    "unicode: é ü 中文 🐍 \x00\x7f",
    "",
])
def test_round_trip(small_tokenizer, text):
    ids = small_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert small_tokenizer.decode(ids) == text


def test_special_tokens(small_tokenizer):
    eos = small_tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    assert eos == 0
    assert small_tokenizer.eos_token_id == small_tokenizer.bos_token_id == small_tokenizer.pad_token_id == eos
    assert len(small_tokenizer) == 512
    ids = small_tokenizer(f"a{END_OF_TEXT}b", add_special_tokens=False)["input_ids"]
    assert eos in ids
