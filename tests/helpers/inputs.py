"""Inputs several tests decode: seeded random prompts, a history prompt lookup matches, and the trees every greedy
exactness test runs."""

from __future__ import annotations

import torch

TREES = [(1,), (1, 1, 1, 1), (1,) * 8, (4,), (3, 2), (2, 2, 1, 1), (3, 2, 2, 1, 1), (2, 2, 2, 1, 1, 1)]


def random_prompt(length: int, seed: int, vocab=128) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (length,), generator=g).tolist()  # avoid EOS ids in prompts


def repetitive_history() -> list[int]:
    return [7, 8, 9, 10, 11, 12, 13, 3, 4, 7, 8, 9]  # ends with (7, 8, 9): lookup proposes 10, 11, 12, ...
