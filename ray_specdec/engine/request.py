"""A request as the scheduler holds it (`Request`: its tokens, sampling, stop checks, random streams, drafter and this
step's round), what a step gives back for it (`StepOutput`), and the two refusals of `Scheduler.add`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.outputs import StreamChunk
from ray_specdec.engine.prefix_cache import ROOT
from ray_specdec.engine.stats import GenerationStats
from ray_specdec.speculation.coupled import KeyedGumbel
from ray_specdec.speculation.drafter_sessions import LazyDrafter
from ray_specdec.speculation.lookup_value import LookupCounts
from ray_specdec.speculation.prompt_lookup import LookupIndex
from ray_specdec.speculation.stopping import StopChecker

if TYPE_CHECKING:
    from ray_specdec.speculation.drafters import RemoteDrafter


class RequestTooLarge(ValueError):
    """The prompt plus max_new_tokens can never fit the target's context or the KV budget (HTTP 400)."""


class QueueFull(RuntimeError):
    """More requests are waiting than the queue bound allows (HTTP 503, retry later)."""


@dataclass
class Request:
    request_id: str
    tokens: list[int]  # prompt + generated: the KV holds tokens[:prefilled], tokens[-1] is the next root
    prompt_len: int
    params: SamplingParams
    tree: TreeConfig | None  # a tree the client asked for (honoured as given), else the policy decides
    stop: StopChecker
    draft_gen: torch.Generator
    target_gen: torch.Generator
    reserved: int  # KV rows it can ever need (prompt + max_new_tokens + its largest verify)
    noise: KeyedGumbel | None = None  # a coupled sampled request's keyed noise (speculation/coupled.py)
    granted: int = 0  # KV rows its cache holds (SchedulerConfig.kv_grow: from its prompt's toward `reserved`)
    stats: GenerationStats = field(default_factory=GenerationStats)
    drafter: LazyDrafter | RemoteDrafter | None = None  # its drafter here, or on a worker (speculation/drafters.py)
    drafter_state_kept: bool = False  # the drafter's prefix cache held its prompt's state at admission
    lookup_index: LookupIndex | None = None  # undrafted rounds' lookup (plain_lookup), built at the first such round
    lookup_counts: LookupCounts | None = None  # how its lookup proposals fared, position by position (lookup_value.py)
    prefilled: int = 0
    prefix_key: int = ROOT  # prefix_cache's key of tokens[:prefilled] (of the last chunk planned, during a step)
    admitted: bool = False
    last_rows: int = 1  # verify rows of its last round (the next step's prefill leaves room for as many)
    # this step's prefill chunk (the KV manager's plan)
    chunk_end: int = 0  # it ends here
    chunk_rows: int = 0

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.tokens) - 1

    @property
    def sampled(self) -> bool:
        return not self.params.greedy

    @property
    def rejection_sampled(self) -> bool:
        """Sampled and verified by rejection sampling (not coupled): its rounds draw from its random streams."""
        return self.sampled and self.noise is None


@dataclass
class StepOutput:
    request_id: str
    chunk: StreamChunk
