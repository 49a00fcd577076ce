"""Refuse a drafter whose tokenizer gives ids other meanings than the target's.

The drafter proposes token ids and the target verifies them as its own ids, so the pair must agree on what every id
they share means. A mismatched pair stays lossless (the target still decides every token) but drafts garbage: nothing
is accepted and every round is wasted, silently. This module makes that a startup error.

Shared ids: those below both tokenizers' lengths and both models' vocabulary sizes. Real pairs pad their embedding
tables past the tokenizer (GPT-NeoX's tokenizer has 50,277 tokens; state-spaces/mamba-130m-hf has 50,280 embeddings,
EleutherAI/pythia-6.9b 50,432): ids beyond a tokenizer's own vocabulary are padding and are not compared.
"""

from __future__ import annotations

import os

SHOWN_IDS = 5  # differing ids named in the error message


class TokenizerMismatch(ValueError):
    """The drafter's and the target's tokenizers disagree on shared ids; the message is one line for the user."""


def shared_ids(target_tokenizer, drafter_tokenizer, *, target_vocab_size: int, drafter_vocab_size: int) -> int:
    """How many ids (0 .. n-1) both tokenizers define and both models can emit."""
    return min(len(target_tokenizer), len(drafter_tokenizer), target_vocab_size, drafter_vocab_size)


def check_tokenizers(target_tokenizer, drafter_tokenizer, *, target_vocab_size: int, drafter_vocab_size: int) -> None:
    """Raise TokenizerMismatch unless both tokenizers map every shared id to the same token string."""
    n = shared_ids(target_tokenizer, drafter_tokenizer, target_vocab_size=target_vocab_size,
                   drafter_vocab_size=drafter_vocab_size)  # fmt: skip
    if n <= 0:
        raise TokenizerMismatch(
            f"the drafter and the target share no token ids (tokenizers: {len(target_tokenizer)} and "
            f"{len(drafter_tokenizer)} tokens; vocabularies: {target_vocab_size} and {drafter_vocab_size})"
        )
    ids = list(range(n))
    target_tokens = target_tokenizer.convert_ids_to_tokens(ids)
    drafter_tokens = drafter_tokenizer.convert_ids_to_tokens(ids)
    differ = [(i, t, d) for i, t, d in zip(ids, target_tokens, drafter_tokens) if t != d]
    if not differ:
        return
    # repr keeps tokens such as "\n" on the message's one line
    shown = "; ".join(f"id {i}: target {t!r}, drafter {d!r}" for i, t, d in differ[:SHOWN_IDS])
    more = f" (and {len(differ) - SHOWN_IDS} more)" if len(differ) > SHOWN_IDS else ""
    raise TokenizerMismatch(
        f"the drafter's tokenizer does not match the target's: {len(differ)} of {n} shared token ids differ: "
        f"{shown}{more}; use a drafter trained with the target's tokenizer"
    )


def check_model_pair(target: str | os.PathLike, drafter: str | os.PathLike) -> None:
    """check_tokenizers on two model directories or hub ids: their tokenizers and configs only, no weights.

    A model that ships no tokenizer leaves nothing to compare (a drafter exported with weights only): the check passes.
    Errors reading a tokenizer or config propagate as they are.
    """
    from ray_specdec.models.loading import load_tokenizer

    target_tokenizer, drafter_tokenizer = load_tokenizer(target), load_tokenizer(drafter)
    if target_tokenizer is None or drafter_tokenizer is None:
        return
    check_tokenizers(target_tokenizer, drafter_tokenizer, target_vocab_size=_vocab_size(target),
                     drafter_vocab_size=_vocab_size(drafter))  # fmt: skip


def _vocab_size(name: str | os.PathLike) -> int:
    from transformers import AutoConfig

    from ray_specdec.models.loading import resolve_model_path

    return int(AutoConfig.from_pretrained(resolve_model_path(name)).get_text_config(decoder=True).vocab_size)
