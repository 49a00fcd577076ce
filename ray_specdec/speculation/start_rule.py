"""The start rule: whether a request starts its drafter at all, asked once, at admission.

The drafter's prefill is paid once per request, so a per-round reward cannot weigh it. `StartRule.decide` drafts
unless the policy's estimates say that over the tokens left, drafting's best rate would not make up for the prefill
(prefill + remaining / best drafting rate >= remaining / rate without drafting); then the request stays undrafted
(PLAIN), but for one in START_ANYWAY_EVERY (EXPLORE), which drafts in every round to keep the estimates in this
context learning. The rates are Thompson draws from the policy's posteriors, so that uncertain estimates still get
tried. Without estimates of both rates or of the prefill's cost, it drafts.

The same prefill, spread over the tokens a request decodes, is what drafting costs beyond its rounds
(`prefill_s_per_decoded_token`): the speculation guard charges it to the drafted steps it measures.
"""

from __future__ import annotations

from ray_specdec.config import NO_TREE, TreeConfig

# Of the requests that the start rule keeps undrafted, one in this many drafts anyway, so that the drafting arms'
# estimates in that context keep learning and a wrong "no" does not last.
START_ANYWAY_EVERY = 8
# Weight of the newest measurement in the running estimate of the drafter's prefill cost per token.
PREFILL_RATE_EMA = 0.2
# Weight of the newest request in the running means of a drafting request's prefill tokens and decoded tokens.
REQUEST_EMA = 0.1
# The start rule's word on a request: draft as the policy picks; never draft; draft in every round (exploration).
DRAFT, PLAIN, EXPLORE = "draft", "plain", "explore"


class StartRule:
    """The rule's state: the drafter's measured prefill cost per token, the requests it kept undrafted, and what the
    requests it lets draft prefill and decode (running means)."""

    def __init__(self):
        self.prefill_s_per_token: float | None = None  # running estimate (None: nothing measured yet)
        self.kept_plain = 0
        self.prefill_tokens: float | None = None  # a drafting request's drafter prefill, in tokens
        self.decoded: float | None = None  # tokens a drafting request decodes (its max_tokens until one finishes)

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

    def note_request(self, prefill_tokens: int, remaining: int) -> None:
        """A request that may draft was admitted: its drafter prefill would run `prefill_tokens` (0: a kept state),
        and it may decode up to `remaining` tokens."""
        self.prefill_tokens = _ema(self.prefill_tokens, prefill_tokens, REQUEST_EMA)
        if self.decoded is None:
            self.decoded = float(remaining)

    def note_finished(self, decoded: int) -> None:
        """A request that may draft finished, having decoded `decoded` tokens."""
        self.decoded = _ema(self.decoded, decoded, REQUEST_EMA)

    def prefill_s_per_decoded_token(self) -> float:
        """A drafting request's drafter prefill, spread over the tokens it decodes (0 until measured). What drafting
        costs per token beyond its rounds, in the steady state of the traffic seen: the speculation guard charges
        this to each drafted step it measures, rather than the prefills that ran in it. Those depend on when the
        guard switched: a run of a few drafted steps after plain ones builds a drafter session for every request in
        flight, and charged to those steps alone, one request's prefill weighed as if it were paid every few rounds
        (in process at concurrency 1, drafting measured 0.6-0.8x and went unused for most of a run while it decoded
        1.25x faster)."""
        if self.prefill_s_per_token is None or self.prefill_tokens is None or self.decoded is None:
            return 0.0
        return self.prefill_s_per_token * self.prefill_tokens / max(self.decoded, 1.0)

    def note_prefill(self, seconds: float, tokens: int) -> None:
        """A drafter prefill over `tokens` took `seconds`."""
        self.prefill_s_per_token = _ema(self.prefill_s_per_token, seconds / max(tokens, 1), PREFILL_RATE_EMA)


def _ema(old: float | None, new: float, weight: float) -> float:
    return float(new) if old is None else old + weight * (new - old)


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
