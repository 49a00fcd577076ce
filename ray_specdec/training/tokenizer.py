"""Byte-level BPE tokenizer (HF `tokenizers`) trained on the corpus train split.

Saved as tokenizer.json plus the transformers config files, so `AutoTokenizer.from_pretrained(dir)` returns a
PreTrainedTokenizerFast whose bos, eos and pad token are all END_OF_TEXT (files are joined with it).

    python -m ray_specdec.training.tokenizer --out runs/tokenizer
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
VOCAB_SIZE = 4096


def train_bpe(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE: every byte is in the base alphabet, so any text round-trips exactly."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers view of a trained tokenizer, with bos/eos/pad set."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT,
        unk_token=None, clean_up_tokenization_spaces=False, model_max_length=8192,
    )


def main() -> None:
    from ray_specdec.training.corpus import read_split

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/tokenizer"))
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()
    hf_tok = wrap(train_bpe(read_split("train"), args.vocab_size))
    hf_tok.save_pretrained(args.out)
    print(f"vocab {len(hf_tok)} -> {args.out}")


if __name__ == "__main__":
    main()
