"""Tree drafting by batch generation with a state-space drafter, and the drafter's commit after verification.

From the root state (all committed tokens consumed) the drafter's logits give the root distribution; N_1 children are
picked; the state is copied into B_1 rows (state-copy kernel) and all rows step once on their tokens; N_2 children are
picked per row; and so on. The leaves are never stepped. The states of every depth are kept until the commit, which
reuses the state of the last accepted node instead of re-running tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from ray_specdec.acceptance import Verdict
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.models.mamba_drafter import MambaDrafter, MambaState
from ray_specdec.sampling import gumbel_top_k, logits_to_probs, sample
from ray_specdec.tree import TreeTensors, build_tree


@functools.lru_cache(maxsize=64)
def tree_for(config: TreeConfig) -> TreeTensors:
    return build_tree(config.index_paths())


@dataclass
class Draft:
    config: TreeConfig
    tokens: torch.Tensor  # [n] draft tokens of tree rows 1..n
    probs: torch.Tensor | None  # [m, V] draft distribution q at rows 0..m-1 (rows with children); None when greedy
    requested: TreeConfig | None = None  # the tree asked for, when min_path_prob cut this draft short

    @property
    def arm(self) -> TreeConfig:
        """The tree the policy chose for this round (what a bandit learns about)."""
        return self.requested if self.requested is not None else self.config

    @property
    def tree(self) -> TreeTensors:
        return tree_for(self.config)


def pick_children(
    logits: torch.Tensor,  # [rows, V]
    k: int,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (children [rows, k], q [rows, V] or None). Greedy: top-k distinct tokens; sampled: i.i.d. or Gumbel-top-k."""
    if params.greedy:
        return torch.topk(logits, k, dim=-1).indices, None
    q = logits_to_probs(logits.float(), params)
    if params.draft_sampling == "iid":
        children = sample(q.unsqueeze(1).expand(-1, k, -1), generator)
    else:
        children = gumbel_top_k(q, k, generator)
    return children, q


def _draft_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The drafter's distribution that path probabilities use: q when sampling, the plain softmax when greedy."""
    if params.greedy:
        return torch.softmax(logits.double(), dim=-1)
    return logits_to_probs(logits.float(), params).double()


def _align_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Drafter logits [rows, V_d] -> [rows, vocab_size]: extra drafter tokens are impossible, missing ones too."""
    v = logits.shape[-1]
    if v == vocab_size:
        return logits
    if v > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - v), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


class DrafterSession:
    """One request's drafter state: the root state, its logits, and the per-depth states of the open round."""

    def __init__(self, drafter: MambaDrafter, token_ids: Sequence[int], vocab_size: int):
        self.drafter = drafter
        self.vocab_size = vocab_size  # the target's: draft distributions live in its vocabulary
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=drafter.device)
        self.root_state, logits = drafter.prefill(ids)
        self.root_logits = _align_vocab(logits.unsqueeze(0), vocab_size)  # [1, V]
        self._depth_states: list[MambaState] = []
        self._draft: Draft | None = None

    def draft(
        self,
        config: TreeConfig,
        params: SamplingParams,
        generator: torch.Generator | None,
        min_path_prob: float = 0.0,
    ) -> Draft:
        """Draft the tree `config`, or its first depths only when min_path_prob > 0 says the rest is unlikely.

        A node's path probability is the drafter's probability of the tokens from the root to it. Drafting stops
        after depth d when no depth-d node reaches min_path_prob (no drafter step is spent on depth d + 1), or
        before picking depth d + 1 when no depth-d node times its best child's probability does (no verify rows
        are spent on it). Both decisions depend only on nodes already drafted and their distributions, never on
        the children they would drop, so every drafted child is still a sample of q given its ancestors: sampled
        output keeps the target's distribution exactly, and greedy output is the target's whatever the draft.
        """
        tree, requested = tree_for(config), config
        logits, state = self.root_logits, self.root_state
        states, tokens, probs = [state], [], []
        path_prob = torch.ones(1, dtype=torch.float64)  # [rows of the last drafted depth]
        for depth, n in enumerate(config.branching, start=1):
            if min_path_prob > 0:
                dist = _draft_distribution(logits, params)  # [rows, V] at the last drafted depth's rows
                if depth > 1 and float((path_prob * dist.max(dim=-1).values).max()) < min_path_prob:
                    config = config.truncated(depth - 1)
                    break
            children, q = pick_children(logits, n, params, generator)
            tokens.append(children.reshape(-1))
            if q is not None:
                probs.append(q)
            if depth == config.depth:
                break
            if min_path_prob > 0:
                path_prob = (path_prob[:, None] * dist.gather(-1, children)).reshape(-1)
                if float(path_prob.max()) < min_path_prob:
                    config = config.truncated(depth)  # depth's nodes stay, as leaves (never stepped)
                    break
            state = self.drafter.copy_rows(state, tree.parents_at_depth(depth).to(self.drafter.device))
            logits = _align_vocab(self.drafter.step(state, tokens[-1]), self.vocab_size)
            states.append(state)
        self._depth_states = states
        draft_tokens = torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.long)
        self._draft = Draft(config, draft_tokens, torch.cat(probs) if probs else None,
                            requested if config != requested else None)  # fmt: skip
        return self._draft

    def commit(self, verdict: Verdict) -> None:
        """Move the root to the last accepted node (a row copy), then step the bonus token."""
        draft = self._draft
        depth = len(verdict.accepted_rows)
        pending = [verdict.bonus_token]
        device = self.drafter.device
        if depth == 0:
            state = self.root_state  # stepped in place: the round's other states are dropped below
        else:
            tree = draft.tree
            row = verdict.accepted_rows[-1]
            if depth >= len(self._depth_states):
                # leaves were never stepped: start from the parent's state and step the leaf token too (a draft
                # cut short by min_path_prob has stepped its last depth, and uses that state)
                depth, row = depth - 1, int(tree.parents[row])
                pending.insert(0, verdict.accepted_tokens[-1])
            local = row - tree.depth_starts[depth]
            index = torch.tensor([local], dtype=torch.long, device=device)
            state = self.drafter.copy_rows(self._depth_states[depth], index)
        for token in pending:
            logits = self.drafter.step(state, torch.tensor([token], dtype=torch.long, device=device))
        self.root_state, self.root_logits = state, _align_vocab(logits, self.vocab_size)
        self._depth_states, self._draft = [], None
