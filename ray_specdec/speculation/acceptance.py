"""Verification of a drafted token tree: pure functions on tensors, randomness passed in.

Terms (docs/DESIGN.md): rows index the verify input ``[root, *tree nodes]`` in BFS order (see speculation/tree.py). A
draft node is **accepted** when the walk from the root moves into it; the walk stops at a node none of whose children
is accepted (or at a leaf). The **bonus token** is then emitted from the target's distribution at the stop node: its
argmax (greedy), or a draw from the residual distribution left after the rejected children (sampling). The **accepted
length** of a round is ``len(accepted_rows) + 1``.

Sampling follows multi-draft speculative sampling. At a node with target distribution p and draft distribution q,
children x_1..x_k are tried in order; x_j is accepted with probability min(1, p(x_j) / q(x_j)); on rejection
p <- normalize(max(p - q, 0)). With i.i.d. children q stays fixed (SpecInfer); with children drawn without
replacement x_j is also removed from q, which is renormalized (recursive rejection sampling). Either way the emitted
token is distributed exactly as p.

A deterministic child d (a prompt-lookup token: its "draft distribution" is one-hot) is tried before the drafter's
children: accepted with probability p(d) (= min(1, p(d) / 1)); on rejection p <- normalize(p with p(d) = 0), the
residual of p against the one-hot. The drafter's children were drawn independently of that coin, so the scheme above
run against the residual emits every x != d with probability (1 - p(d)) p(x) / (1 - p(d)) = p(x) overall, and d
with p(d): still exactly p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ray_specdec.speculation.sampling import sample
from ray_specdec.speculation.tree import TreeTensors


@dataclass(frozen=True)
class Verdict:
    accepted_rows: tuple[int, ...]  # tree rows of the accepted nodes, root excluded, in root-to-leaf order
    accepted_tokens: tuple[int, ...]  # their tokens
    bonus_token: int

    @property
    def keep_rows(self) -> tuple[int, ...]:
        """Rows of the verify input that stay in the target's KV cache: the root and the accepted path."""
        return (0, *self.accepted_rows)

    @property
    def new_tokens(self) -> tuple[int, ...]:
        return (*self.accepted_tokens, self.bonus_token)


def accept_greedy(
    target_logits: torch.Tensor,  # [1 + n, V], or [1 + n] their row argmaxes
    tree: TreeTensors,
    draft_tokens: torch.Tensor,  # [n]
) -> Verdict:
    """Walk from the root while the target's argmax equals a child's token. Equals target-only greedy decoding."""
    argmax = (target_logits if target_logits.dim() == 1 else target_logits.argmax(dim=-1)).tolist()
    tokens = [-1, *draft_tokens.tolist()]
    row, rows = 0, []
    while True:
        nxt = next((c for c in tree.children[row] if tokens[c] == argmax[row]), None)
        if nxt is None:
            break
        rows.append(nxt)
        row = nxt
    return Verdict(tuple(rows), tuple(tokens[r] for r in rows), argmax[row])


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)); p itself if nothing is left (p <= q everywhere only when p == q up to rounding)."""
    r = torch.clamp(p - q, min=0)
    total = r.sum()
    return r / total if total > 0 else p


def accept_sampled(
    target_probs: torch.Tensor,  # [1 + n, V] processed (temperature / top-k / top-p) target distributions
    draft_probs: torch.Tensor,  # [m, V] processed draft distribution q at rows 0..m-1 (every row with children)
    tree: TreeTensors,
    draft_tokens: torch.Tensor,  # [n]
    without_replacement: bool,
    generator: torch.Generator | None,
    deterministic: frozenset[int] = frozenset(),  # rows whose token is a deterministic draft (q one-hot)
    q_rows: tuple[int, ...] | None = None,  # row of draft_probs for each tree row (-1: none); None: the same row
) -> Verdict:
    """Multi-draft rejection sampling down the tree; the emitted tokens have exactly the target's distribution."""
    tokens = [-1, *draft_tokens.tolist()]
    row, rows = 0, []
    while True:
        children = tree.children[row]
        p = target_probs[row]
        if not children:
            break
        accepted = None
        for child in (c for c in children if c in deterministic):
            x = tokens[child]
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u < float(p[x]):
                accepted = child
                break
            p = p.clone()
            p[x] = 0.0
            p = p / p.sum()  # p(x) < 1 here: u < 1 = p(x) would have accepted
        sampled = [c for c in children if c not in deterministic]
        if accepted is None and sampled:
            accepted, p = _try_sampled(p, draft_probs[row if q_rows is None else q_rows[row]], sampled, tokens,
                                       without_replacement, generator)  # fmt: skip
        if accepted is None:
            break
        rows.append(accepted)
        row = accepted
    bonus = int(sample(p, generator))
    return Verdict(tuple(rows), tuple(tokens[r] for r in rows), bonus)


def _try_sampled(
    p: torch.Tensor,  # [V] target distribution left at this node
    q: torch.Tensor,  # [V] draft distribution the children were drawn from
    children: list[int],
    tokens: list[int],
    without_replacement: bool,
    generator: torch.Generator | None,
) -> tuple[int | None, torch.Tensor]:
    """Try the drafter's children in order -> (accepted child or None, the distribution left for the bonus)."""
    q = q.clone()
    for child in children:
        x = tokens[child]
        qx = float(q[x])
        if qx <= 0.0:
            # only reachable without replacement once q's support is used up: no more valid children
            break
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * qx < float(p[x]):  # u < p(x) / q(x) without dividing
            return child, p
        p = _residual(p, q)
        if without_replacement:
            q[x] = 0.0
            mass = q.sum()
            if mass <= 0:
                break
            q = q / mass
    return None, p
