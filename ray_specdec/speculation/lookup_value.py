"""What an undrafted round's prompt-lookup proposal is worth: the tokens of it the target will confirm.

The proposal is known before the controller chooses (it costs the host a few dictionary reads,
speculation/prompt_lookup.py), so its verify rows are exact, and only its acceptance is estimated. Acceptance is
position by position: p_k is the chance that the proposal's k-th token is confirmed given the k-1 before it were.
Lookup copies spans, so a confirmed first token makes the next likelier (p_1 < p_2 < ...), and a proposal of L tokens
is expected to give

    E[confirmed] = sum over k <= L of p_1 x ... x p_k.

How often the context repeats itself differs by request far more than by anything the engine can see (one request
edits code it was given, the next writes new code), so each request keeps its own counts, and they are pooled over
all requests (forgetting old rounds) as the prior a request starts from:

    p_k(request) = (hits_k + m x P_k) / (tries_k + m),   P_k = the pooled rate, m = `lookup_request_prior`.

Every round of a request that may verify a proposal teaches it, whether or not the proposal was verified: the round's
new tokens (what the target emitted) say how far the proposal matched, up to as many positions as the round
emitted tokens. An undrafted round without its proposal still emits one token, which tells p_1: a request whose
lookup is declined keeps learning whether it should be.
"""

from __future__ import annotations

from typing import Sequence

PRIOR_RATE = 0.5  # the pooled rate before any round: an even chance per token
PRIOR_WEIGHT = 2.0  # pseudo-observations of PRIOR_RATE in the pooled rate


class LookupCounts:
    """One request's own counts: per position, proposals that reached it (tries) and were confirmed there (hits)."""

    __slots__ = ("tries", "hits")

    def __init__(self) -> None:
        self.tries: list[float] = []
        self.hits: list[float] = []


class LookupAcceptance:
    """The position-wise acceptance of lookup proposals, pooled over requests and per request."""

    def __init__(self, forget: float = 0.999, request_prior: float = 4.0):
        self.forget = forget
        self.request_prior = request_prior
        self.tries: list[float] = []
        self.hits: list[float] = []

    def pooled_rate(self, k: int) -> float:
        """P_k: the pooled chance that position k (0-based) is confirmed once those before it were."""
        tries, hits = (self.tries[k], self.hits[k]) if k < len(self.tries) else (0.0, 0.0)
        return (hits + PRIOR_WEIGHT * PRIOR_RATE) / (tries + PRIOR_WEIGHT)

    def expected(self, size: int, counts: LookupCounts | None = None) -> float:
        """Expected confirmed tokens of a proposal of `size` tokens for a request with these counts (None: the
        pooled estimate)."""
        m = self.request_prior
        reach, total = 1.0, 0.0
        for k in range(size):
            pooled = self.pooled_rate(k)
            if counts is not None and k < len(counts.tries):
                p = (counts.hits[k] + m * pooled) / (counts.tries[k] + m)
            else:
                p = pooled
            reach *= p
            total += reach
        return total

    def observe(self, counts: LookupCounts | None, proposal: Sequence[int], emitted: Sequence[int]) -> int:
        """A round of a request whose proposal was `proposal` emitted `emitted` (its new tokens, in order): count the
        positions it tells (those up to the first mismatch, within what was emitted) -> tokens confirmed."""
        known = min(len(proposal), len(emitted))
        matched = 0
        while matched < known and proposal[matched] == emitted[matched]:
            matched += 1
        told = min(matched + 1, known)  # the confirmed positions, and the first mismatch if it was seen
        _count(self.tries, self.hits, told, matched, self.forget)
        if counts is not None:
            _count(counts.tries, counts.hits, told, matched, 1.0)
        return matched

    def summary(self) -> list[float]:
        """The pooled rates P_1, P_2, ... for the positions seen."""
        return [round(self.pooled_rate(k), 4) for k in range(len(self.tries))]


def _count(tries: list[float], hits: list[float], told: int, matched: int, decay: float) -> None:
    """Positions 0..told-1 tried once more (the older tries and hits weighed by `decay`), the first `matched` hit."""
    while len(tries) < told:
        tries.append(0.0)
        hits.append(0.0)
    for k in range(told):
        tries[k] = decay * tries[k] + 1.0
        hits[k] = decay * hits[k] + (k < matched)
