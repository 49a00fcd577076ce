"""Per-generation statistics: rounds, accepted lengths, acceptance per depth, time split."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    rounds: int = 0
    drafts: int = 0  # rounds that verified a drafted tree
    draft_tokens: int = 0  # drafted nodes the target verified (lookup nodes included)
    accepted_lengths: list[int] = field(default_factory=list)  # accepted + 1 per round
    reached_depth: list[int] = field(default_factory=list)  # rounds whose walk got to depth d (index d - 1)
    offered_depth: list[int] = field(default_factory=list)  # rounds whose tree had depth >= d
    trees: Counter = field(default_factory=Counter)  # tree config string -> rounds
    new_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not prefilled)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    last_round_s: float = 0.0  # for the tree policy's reward

    def record_round(self, tree_name: str, tree_depth: int, num_accepted: int, num_draft_tokens: int) -> None:
        self.rounds += 1
        self.drafts += num_draft_tokens > 0
        self.draft_tokens += num_draft_tokens
        self.accepted_lengths.append(num_accepted + 1)
        self.trees[tree_name] += 1
        _bump(self.offered_depth, tree_depth)
        _bump(self.reached_depth, num_accepted)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.draft_s + self.verify_s + self.other_s

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accepted_lengths) / max(1, len(self.accepted_lengths))

    @property
    def acceptance_per_depth(self) -> list[float]:
        """Fraction of rounds that accepted a token at depth d, among rounds whose tree reached depth d."""
        return [r / o for r, o in zip(self.reached_depth + [0] * len(self.offered_depth), self.offered_depth)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "new_tokens": self.new_tokens,
            "cached_tokens": self.cached_tokens,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "accepted_lengths": self.accepted_lengths,
            "acceptance_per_depth": [round(a, 4) for a in self.acceptance_per_depth],
            "trees": dict(self.trees),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "prefill_s": round(self.prefill_s, 6),
            "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6),
            "other_s": round(self.other_s, 6),
            "total_s": round(self.total_s, 6),
        }


def _bump(counts: list[int], depth: int) -> None:
    """Add one to counts[0 .. depth-1], growing the list as needed."""
    if len(counts) < depth:
        counts.extend([0] * (depth - len(counts)))
    for d in range(depth):
        counts[d] += 1
