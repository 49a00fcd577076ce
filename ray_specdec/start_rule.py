"""The start rule: whether a request starts its drafter at all, asked once, at admission.

The drafter's prefill is paid once per request, so a per-round reward cannot weigh it. `StartRule.decide` drafts
unless the policy's estimates say that over the tokens left, drafting's best rate would not make up for the prefill
(prefill + remaining / best drafting rate >= remaining / rate without drafting); then the request stays undrafted
(PLAIN), but for one in START_ANYWAY_EVERY (EXPLORE), which drafts in every round to keep the estimates in this
context learning. The rates are Thompson draws from the policy's posteriors, so that uncertain estimates still get
tried. Without estimates of both rates or of the prefill's cost, it drafts.
"""

from __future__ import annotations

from ray_specdec.config import TreeConfig
from ray_specdec.rounds import NO_TREE

# Of the requests that the start rule keeps undrafted, one in this many drafts anyway, so that the drafting arms'
# estimates in that context keep learning and a wrong "no" does not last.
START_ANYWAY_EVERY = 8
# Weight of the newest measurement in the running estimate of the drafter's prefill cost per token.
PREFILL_RATE_EMA = 0.2
# The start rule's word on a request: draft as the policy picks; never draft; draft in every round (exploration).
DRAFT, PLAIN, EXPLORE = "draft", "plain", "explore"


class StartRule:
    """The rule's state: the drafter's measured prefill cost per token and the requests it kept undrafted."""

    def __init__(self):
        self.prefill_s_per_token: float | None = None  # running estimate (None: nothing measured yet)
        self.kept_plain = 0

    def decide(self, policy, prefill_tokens: int, context_len: int, remaining: int, sampled: bool,
               load: int) -> str:  # fmt: skip
        """DRAFT, PLAIN or EXPLORE for a request of `context_len` tokens with `remaining` to generate, whose drafter
        prefill would run `prefill_tokens`, joining a step of `load` decoding requests (itself included)."""
        if self.prefill_s_per_token is None:
            return DRAFT
        estimates = policy.throughput(context_len, sampled, draw=True, load=load)
        plain, (drafting, _) = estimates.get(NO_TREE), best_drafting(estimates)
        if plain is None or drafting is None:
            return DRAFT
        if self.prefill_s_per_token * prefill_tokens + remaining / drafting < remaining / plain:
            return DRAFT
        self.kept_plain += 1
        return EXPLORE if self.kept_plain % START_ANYWAY_EVERY == 0 else PLAIN

    def note_prefill(self, seconds: float, tokens: int) -> None:
        """A drafter prefill over `tokens` took `seconds`."""
        rate = seconds / max(tokens, 1)
        old = self.prefill_s_per_token
        self.prefill_s_per_token = rate if old is None else old + PREFILL_RATE_EMA * (rate - old)


def drafting_arm(policy, context_len: int, sampled: bool, load: int) -> TreeConfig:
    """The drafting arm with the best Thompson draw (a round of an EXPLORE request the policy left undrafted)."""
    _, arm = best_drafting(policy.throughput(context_len, sampled, draw=True, load=load))
    return arm if arm.depth else max(policy.arms, key=lambda a: (a.depth > 0, -a.num_nodes))


def prefill_tokens(drafter, context_len: int) -> int:
    """Tokens a drafter prefill over this context runs (its prefill window, if it has one)."""
    window = drafter.prefill_window if drafter is not None else None
    return min(context_len, window) if window else context_len


def best_drafting(estimates: dict[TreeConfig, float]) -> tuple[float | None, TreeConfig]:
    """(rate, arm) of the drafting arm with the highest estimate; (None, NO_TREE) when no drafting arm has one."""
    return max(((rate, arm) for arm, rate in estimates.items() if arm.depth), key=lambda pair: pair[0],
               default=(None, NO_TREE))
