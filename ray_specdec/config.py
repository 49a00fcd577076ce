"""Algorithm settings: tree shapes and sampling parameters (frozen dataclasses, validated on creation)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Literal

DraftSampling = Literal["iid", "without_replacement"]


MAX_LOOKUP_TOKENS = 32
MAX_LOGPROBS = 20  # top alternatives a request may ask for (OpenAI's limit)


@dataclass(frozen=True)
class TreeConfig:
    """T = (N_1, ..., N_gamma): at depth i every node gets N_i children. () means no drafting.

    lookup = L > 0 adds up to L tokens proposed by prompt lookup (speculation/prompt_lookup.py: what followed the latest
    earlier occurrence of the context's last n-gram) as one more branch: merged into the drafter's tree where prefixes
    agree in greedy rounds, a branch of its own tried first in sampled ones (speculation/drafting.py). Written
    "1,1,1,1+L4". It needs a drafted tree (the drafter's session holds the history).
    """

    branching: tuple[int, ...]
    lookup: int = 0

    def __post_init__(self) -> None:
        if any((not isinstance(n, int)) or n < 1 for n in self.branching):
            raise ValueError(f"tree branching factors must be integers >= 1, got {self.branching}")
        if len(self.branching) > 32:
            raise ValueError(f"tree depth {len(self.branching)} is too deep (max 32)")
        if self.num_nodes > 1024:
            raise ValueError(f"tree {self.branching} has {self.num_nodes} nodes (max 1024)")
        if not isinstance(self.lookup, int) or not 0 <= self.lookup <= MAX_LOOKUP_TOKENS:
            raise ValueError(f"lookup tokens must be an integer in [0, {MAX_LOOKUP_TOKENS}], got {self.lookup!r}")
        if self.lookup and not self.branching:
            raise ValueError("lookup tokens ride on a drafted tree; 'none' cannot have them")

    @classmethod
    def parse(cls, text: str) -> "TreeConfig":
        """'3,2,2,1,1' -> (3, 2, 2, 1, 1); '1,1,1,1+L4' -> a chain plus 4 lookup tokens; '' or 'none' -> no drafting."""
        text, _, extra = text.strip().partition("+")
        text = text.strip().strip("()[]")
        lookup = 0
        if extra:
            word = extra.strip().lower()
            digits = word.removeprefix("lookup").removeprefix("l").strip(" :=")
            if not digits.isdigit():
                raise ValueError(f"lookup must be written like 1,1,1,1+L4, got {extra!r} after '+'")
            lookup = int(digits)
        if text.lower() in ("", "none"):
            return cls((), lookup)
        try:
            branching = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
        except ValueError:
            raise ValueError(f"tree must be comma-separated integers like 3,2,2,1,1, got {text!r}") from None
        return cls(branching, lookup)

    @classmethod
    def chain(cls, depth: int) -> "TreeConfig":
        return cls((1,) * depth)

    @property
    def depth(self) -> int:
        """Depth of the drafter's tree (lookup tokens excluded)."""
        return len(self.branching)

    @property
    def max_depth(self) -> int:
        """The deepest a round of this config can accept: the drafter's depth or the lookup branch's."""
        return max(self.depth, self.lookup)

    @functools.cached_property
    def rows_per_depth(self) -> tuple[int, ...]:
        """B_i = N_1 * ... * N_i for i = 1..gamma."""
        rows, b = [], 1
        for n in self.branching:
            b *= n
            rows.append(b)
        return tuple(rows)

    @functools.cached_property
    def num_nodes(self) -> int:
        """Draft nodes in the tree, root excluded."""
        return sum(self.rows_per_depth)

    def truncated(self, max_depth: int) -> "TreeConfig":
        if max_depth >= len(self.branching) and max_depth >= self.lookup:
            return self
        branching = self.branching[: max(0, max_depth)]
        return TreeConfig(branching, min(self.lookup, max(0, max_depth)) if branching else 0)

    def without_lookup(self) -> "TreeConfig":
        return TreeConfig(self.branching) if self.lookup else self

    def with_lookup(self, lookup: int) -> "TreeConfig":
        """This tree plus a lookup branch of up to `lookup` tokens, unless it drafts nothing or has its own."""
        return TreeConfig(self.branching, lookup) if lookup > 0 and self.branching and not self.lookup else self

    def index_paths(self) -> list[tuple[int, ...]]:
        """The tree as child-rank paths from the root, in BFS order: [(0,), (1,), (0, 0), ...]."""
        paths: list[tuple[int, ...]] = []
        level: list[tuple[int, ...]] = [()]
        for n in self.branching:
            level = [parent + (rank,) for parent in level for rank in range(n)]
            paths.extend(level)
        return paths

    def __str__(self) -> str:
        tree = ",".join(map(str, self.branching)) if self.branching else "none"
        return f"{tree}+L{self.lookup}" if self.lookup else tree


# A round without a draft (the target's step alone).
NO_TREE = TreeConfig(())

# The paper's trees plus the chain; the bandit's default arms extend this.
PAPER_TREES = (
    TreeConfig((1, 1, 1, 1)),
    TreeConfig((3, 3, 2, 1)),
    TreeConfig((3, 2, 2, 1, 1)),
    TreeConfig((2, 2, 2, 1, 1, 1)),
)


# The tree of an engine given none (the library, the CLI; the app when it has no drafter or bandit): on an
# accelerator verifying a few more rows is nearly free, so a small tree; on CPU every verified row costs, and a
# short chain is the fastest shape (1,1,1 beat 1,1,1,1 with lookup branches, docs/BENCHMARKS.md).
DEFAULT_TREE = TreeConfig((2, 2, 1, 1))
CPU_DEFAULT_TREE = TreeConfig((1, 1, 1))


def default_tree(device) -> TreeConfig:
    """The default tree for a device ("cpu", "cuda", "cuda:1", a torch.device)."""
    return CPU_DEFAULT_TREE if str(device).split(":")[0] == "cpu" else DEFAULT_TREE


@dataclass(frozen=True)
class SamplingParams:
    """Target-only sampling settings; speculation reproduces exactly this distribution.

    temperature == 0 means greedy. top_k == 0 and top_p == 1.0 disable those filters. The target-side options below
    (speculation/logits_processing.py) default to doing nothing; they act on the target's logits before greedy argmax
    and before temperature / top-k / top-p, row by row as target-only decoding would.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 64
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # How sampled rounds pick children: i.i.d. from q (multi-draft rejection sampling)
    # or without replacement (Gumbel-top-k; recursive rejection sampling).
    draft_sampling: DraftSampling = "without_replacement"
    # OpenAI penalties over the tokens generated so far: logit -= frequency * count + presence * (count > 0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF / vLLM: over prompt + generated tokens, a positive logit is divided by it, a negative one multiplied
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (token id, bias added to its logit)
    # EOS and stop_token_ids cannot be generated before this many tokens, nor can a stop string end generation
    # before a token after them completes it (speculation/stopping.py)
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # generation stops after emitting one ("stop")
    logprobs: int | None = None  # k: the emitted tokens' log-probabilities and the top-k alternatives; None: off
    # which of n samples of one prompt this is: its random streams come from (seed, choice), so that the n differ
    choice: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (isinstance(self.choice, int) and self.choice >= 0):
            raise ValueError(f"choice must be an integer >= 0, got {self.choice!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.draft_sampling not in ("iid", "without_replacement"):
            raise ValueError(f"draft_sampling must be 'iid' or 'without_replacement', got {self.draft_sampling!r}")
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))
        self._check_target_options()

    def _check_target_options(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0):  # fmt: skip
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        items = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        bias = tuple((_token_id(t, "logit_bias"), b) for t, b in items)
        if len({t for t, _ in bias}) != len(bias):
            raise ValueError("logit_bias names a token id twice")
        for t, b in bias:
            if not (isinstance(b, (int, float)) and -100.0 <= b <= 100.0):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b!r} for token {t}")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in bias)))
        object.__setattr__(self, "stop_token_ids", tuple(_token_id(t, "stop_token_ids") for t in self.stop_token_ids))
        if not (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_new_tokens):
            raise ValueError(f"min_tokens must be in [0, max_new_tokens = {self.max_new_tokens}], "
                             f"got {self.min_tokens!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the processed logits depend on the tokens so far (then every verify row needs its own path)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Whether any target-side option changes the target's logits (speculation/logits_processing.py)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def argmax_only(self) -> bool:
        """Whether a round needs only the target's row argmaxes (`target_backend.SegmentSpec.argmax_only`): greedy,
        no logit processing, no logprobs."""
        return self.greedy and not self.processes_logits and self.logprobs is None

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError when logit_bias names a token outside the target's vocabulary."""
        outside = [t for t, _ in self.logit_bias if t >= vocab_size]
        if outside:
            raise ValueError(f"logit_bias token ids must be in the vocabulary [0, {vocab_size}), got {outside}")


def _token_id(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} token ids must be integers >= 0, got {value!r}")
    return value
