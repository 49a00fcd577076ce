"""What-if feedback: the draft tokens each smaller tree would have had accepted in a round, from the round's own
drafted tree and verdict, so that one round teaches the bandit every arm its tree contained (bandit/,
speculation/controller.py)."""

from __future__ import annotations

from typing import Sequence

from ray_specdec.config import TreeConfig
from ray_specdec.speculation.acceptance import Verdict
from ray_specdec.speculation.drafting import Draft


def what_if(
    draft: Draft, verdict: Verdict, arms: Sequence[TreeConfig], lookup: int = 0, sampled: bool = False
) -> dict[TreeConfig, int]:
    """The draft tokens each of `arms` would have had accepted in this round, for every arm whose round the drafted
    tree contains (sub-tree feedback: one round teaches every smaller arm, not just the one pulled).

    Greedy acceptance keeps the longest prefix of the target's own greedy continuation that the tree holds, so a
    smaller arm keeps the prefix of this round's accepted path that its own tree would hold. A node is in the arm's
    tree if its drafter index path fits the arm's branching (the drafter proposes its top-k children in rank order,
    from the same states) or if it lies on the arm's stretch of the lookup chain (the same proposal, cut to the arm's
    size: `lookup` for an arm without its own, as `TreeConfig.with_lookup` adds it). Lookup nodes merged into the
    drafted tree have ranks beyond the drafter's children, so they never pass for drafter nodes of a smaller arm.
    Arms with more children at some depth, more depths or a longer lookup branch than drafted are left out, and so is
    every arm when the drafter cut the tree short (a smaller arm could have been cut elsewhere).

    Sampled rounds (`sampled`): acceptance tries a node's children in rank order (lookup child first), each against
    what the earlier ones left of p, so a smaller arm's round is this round's first steps: with the same random draws
    it keeps the same prefix, and the count is a draw from its acceptance distribution (coupled to this round's, not
    independent of it). That holds only if the smaller arm also has the lookup branch when this round had one (a
    rejected lookup token changes what p the drafter's children meet), so an arm without it is left out then.
    """
    drafted = draft.config.branching
    if drafted != draft.arm.branching:
        return {}
    asked = draft.arm.lookup
    proposal, accepted = draft.lookup_tokens, verdict.accepted_tokens
    match = 0  # leading accepted tokens that are the lookup proposal's
    while match < min(len(proposal), len(accepted)) and accepted[match] == proposal[match]:
        match += 1
    paths = [draft.tree.paths[row - 1] for row in verdict.accepted_rows]
    out: dict[TreeConfig, int] = {}
    for arm in arms:
        branching = arm.branching
        arm_lookup = arm.lookup or (lookup if branching else 0)
        if len(branching) > len(drafted) or any(n > m for n, m in zip(branching, drafted)) or arm_lookup > asked:
            continue
        if sampled and proposal and branching and not arm_lookup:
            continue
        kept = 0
        for depth, path in enumerate(paths, start=1):
            drafter_node = len(path) <= len(branching) and all(r < n for r, n in zip(path, branching))
            if not (drafter_node or depth <= min(match, arm_lookup)):
                break
            kept = depth
        out[arm] = kept
    return out
