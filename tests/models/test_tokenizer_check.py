"""The drafter / target tokenizer check: equal tokenizers pass whatever the models' padded vocabulary sizes, differing
ids are refused with a message that names them, and the shipped pairs pass."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ray_specdec.defaults import DRAFTER_MAMBA, DRAFTER_NEOX_SMALL, TARGET_LLAMA, TARGET_NEOX, default_model_path
from ray_specdec.models.tokenizer_check import TokenizerMismatch, check_model_pair, check_tokenizers

WORDS = ["<eos>", "<unk>", "the", "quick", "brown", "fox"]


def word_tokenizer(words: list[str], added: list[str] = ()) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose id i is words[i], then `added` tokens after them."""
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    wrapped.add_tokens(list(added))
    return wrapped


def swapped(words: list[str], i: int, j: int) -> list[str]:
    out = list(words)
    out[i], out[j] = out[j], out[i]
    return out


@pytest.mark.parametrize(
    "target_vocab, drafter_vocab",
    [(50304, 50280), (50432, 50280), (50280, 50304), (len(WORDS), len(WORDS))],
)  # pythia-1.4b / pythia-6.9b against mamba-130m-hf, the other way round, and no padding at all
def test_equal_tokenizers_pass_with_padded_vocabularies(target_vocab, drafter_vocab):
    check_tokenizers(word_tokenizer(WORDS), word_tokenizer(WORDS), target_vocab_size=target_vocab,
                     drafter_vocab_size=drafter_vocab)  # fmt: skip


def test_tokens_beyond_the_other_tokenizer_are_not_compared():
    target, drafter = word_tokenizer(WORDS), word_tokenizer(WORDS, added=["<|user|>", "<|assistant|>"])
    assert len(drafter) == len(target) + 2
    check_tokenizers(target, drafter, target_vocab_size=50304, drafter_vocab_size=50280)


def test_swapped_ids_are_refused_naming_them():
    with pytest.raises(TokenizerMismatch) as info:
        check_tokenizers(word_tokenizer(WORDS), word_tokenizer(swapped(WORDS, 2, 5)), target_vocab_size=50304,
                         drafter_vocab_size=50280)  # fmt: skip
    message = str(info.value)
    assert message == (
        "the drafter's tokenizer does not match the target's: 2 of 6 shared token ids differ: "
        "id 2: target 'the', drafter 'fox'; id 5: target 'fox', drafter 'the'; "
        "use a drafter trained with the target's tokenizer"
    )
    assert isinstance(info.value, ValueError)


def test_many_differences_name_a_few_and_count_the_rest():
    words = [f"w{i}" for i in range(40)]
    with pytest.raises(TokenizerMismatch) as info:
        check_tokenizers(word_tokenizer(words), word_tokenizer(words[::-1]), target_vocab_size=40,
                         drafter_vocab_size=40)  # fmt: skip
    message = str(info.value)
    assert "40 of 40 shared token ids differ: id 0: target 'w0', drafter 'w39'; id 1: target 'w1', drafter 'w38';" in (
        message
    )
    assert message.count("id ") == 5 and "(and 35 more)" in message and "\n" not in message


def test_ids_a_model_cannot_emit_are_not_compared():
    target, drafter = word_tokenizer(WORDS), word_tokenizer(swapped(WORDS, 4, 5))
    check_tokenizers(target, drafter, target_vocab_size=50304, drafter_vocab_size=4)  # ids 4, 5: beyond the drafter
    with pytest.raises(TokenizerMismatch, match="1 of 5 shared token ids differ: id 4: target 'brown', drafter 'fox';"):
        check_tokenizers(target, drafter, target_vocab_size=5, drafter_vocab_size=50280)  # id 4 is shared again


def test_no_shared_ids_is_refused():
    with pytest.raises(TokenizerMismatch, match="share no token ids"):
        check_tokenizers(word_tokenizer(WORDS), word_tokenizer(WORDS), target_vocab_size=0, drafter_vocab_size=50280)


@pytest.mark.parametrize(
    "target, drafter",
    [(TARGET_NEOX, DRAFTER_MAMBA), (TARGET_LLAMA, DRAFTER_MAMBA), (TARGET_NEOX, DRAFTER_NEOX_SMALL)],
)
def test_shipped_pairs_pass(target, drafter):
    check_model_pair(default_model_path(target), default_model_path(drafter))


def test_a_model_without_a_tokenizer_leaves_nothing_to_compare(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mamba", "vocab_size": 4}')
    check_model_pair(default_model_path(TARGET_NEOX), tmp_path)
