"""Prompt lookup: draft tokens copied from earlier in the request's own context, at no model cost.

Code, documents under question and chat histories repeat themselves: when the context's last n tokens occurred
before, what followed them then is a good guess for what follows now (prompt lookup decoding, Saxena 2023; vLLM's
n-gram proposer). `LookupIndex` keeps, for every n-gram of length min_ngram..max_ngram, the latest position where it
was followed by another token, updated in O(max_ngram) per appended token, so a proposal is O(max_ngram + tokens)
whatever the context length. Longer n-grams are tried first (a longer match is a more specific guess).

The drafter session adds a proposal to its tree as one more branch (speculation/drafting.py): merged where prefixes
agree in greedy rounds; in sampled rounds a chain of deterministic drafts (q one-hot) that acceptance tries first, with
probability p(x), removing x from p on rejection (speculation/acceptance.py), which keeps the target's distribution
exactly.
"""

from __future__ import annotations

from typing import Iterable

DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 1


class LookupIndex:
    def __init__(
        self, tokens: Iterable[int] = (), max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM
    ):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        # n -> {n-gram: start of its latest occurrence that has a following token}
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        seq = self.tokens
        for token in tokens:
            end = len(seq)  # the n-grams ending just before the new token now have a follower
            for n, latest in self._latest.items():
                if end >= n:
                    latest[tuple(seq[end - n : end])] = end - n
            seq.append(int(token))

    def propose(self, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that followed the latest earlier occurrence of the longest matching suffix."""
        seq = self.tokens
        if max_tokens <= 0:
            return []
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            start = self._latest[n].get(tuple(seq[len(seq) - n :]))
            if start is not None:
                return seq[start + n : start + n + max_tokens]
        return []
