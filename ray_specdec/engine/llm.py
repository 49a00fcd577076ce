"""The in-process engine: the step scheduler (engine/scheduler.py) over a target and a drafter loaded in this process.

`generate` / `stream` run one request; `generate_many` runs a list of prompts as one continuously batched workload
(like vLLM's `LLM.generate(list)`). All of them step the same `Scheduler` the Serve app runs, so what the CLI and the
benchmark measure is the served loop. Without a drafter every round has an empty tree: plain target decoding through
the same code path.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Iterator, Sequence

from ray_specdec.config import DEFAULT_LOOKUP, DEFAULT_PLAIN_LOOKUP, SamplingParams, TreeConfig
from ray_specdec.engine.outputs import Generation, StreamChunk
from ray_specdec.engine.request import RequestTooLarge
from ray_specdec.engine.scheduler import Scheduler
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.engine.target_backend import LocalTarget
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.drafter.mamba_state import StateSlots
from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.logits_processing import TokenLogprob

# Default cut of drafts by the drafter's own path probabilities (DrafterSession.draft); see docs/BENCHMARKS.md.
DEFAULT_MIN_PATH_PROB = 0.0
# What the CLI and the bench run with unless told otherwise, as the app does (whose KV budget is in GiB);
# SpeculativeEngine's own default is the plain SchedulerConfig(): no lookup tokens, in drafted rounds or plain ones.
DEFAULT_SCHEDULER = SchedulerConfig(min_path_prob=DEFAULT_MIN_PATH_PROB, lookup=DEFAULT_LOOKUP,
                                    plain_lookup=DEFAULT_PLAIN_LOOKUP)


class SpeculativeEngine:
    def __init__(
        self,
        target: TargetModel,
        drafter: MambaDrafter | None,
        tree_policy=TreeConfig((3, 2, 2, 1, 1)),
        tokenizer=None,
        min_path_prob: float | None = None,
        lookup: int | None = None,
        config: SchedulerConfig | None = None,
        plain_lookup: int | None = None,
    ):
        """tree_policy: a TreeConfig or a tree policy (the bandit). config: the scheduler's settings (KV budget, batch
        and step sizes, draft cut, lookup; default SchedulerConfig()). min_path_prob (drafts stop at depths whose
        nodes the drafter rates below this) and lookup (every drafted tree of a greedy request also verifies up to
        this many prompt-lookup tokens, speculation/prompt_lookup.py) and plain_lookup (greedy rounds that run undrafted
        verify up to this many lookup tokens instead), when given, override config's."""
        overrides = {"min_path_prob": min_path_prob, "lookup": lookup, "plain_lookup": plain_lookup}
        config = replace(config or SchedulerConfig(), **{k: v for k, v in overrides.items() if v is not None})
        self.target = target
        self.tokenizer = tokenizer if tokenizer is not None else target.tokenizer
        self.scheduler = Scheduler(LocalTarget(target), drafter, self.tokenizer, tree_policy, config)

    @property
    def policy(self):
        return self.scheduler.policy

    @property
    def lookup(self) -> int:
        return self.scheduler.config.lookup

    @property
    def min_path_prob(self) -> float:
        return self.scheduler.config.min_path_prob

    @property
    def controller(self):
        """The speculation controller (speculation/controller.py): every round's tree."""
        return self.scheduler.controller

    @property
    def drafter(self) -> MambaDrafter | None:
        return self.scheduler.drafter

    @drafter.setter
    def drafter(self, drafter: MambaDrafter | None) -> None:
        """Another drafter for the requests added from now on (tests swap one in)."""
        self.scheduler.drafter = drafter
        self.scheduler.drafter_slots = StateSlots(drafter, self.scheduler.config.max_running)  # of its shapes

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    def check_length(self, prompt_len: int, params: SamplingParams) -> None:
        """RequestTooLarge (a ValueError) when the request can never run."""
        self.scheduler.check(prompt_len, params)

    def generate(self, prompt: str | Sequence[int], params: SamplingParams,
                 tree: TreeConfig | None = None) -> Generation:
        return self.generate_many([prompt], params, tree)[0]

    def generate_many(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        tree: TreeConfig | Sequence[TreeConfig | None] | None = None,
    ) -> list[Generation]:
        """Every prompt as one continuously batched workload; -> generations in the prompts' order. params and tree:
        one for every prompt, or one per prompt (a tree None: the policy decides)."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        trees = [tree] * len(prompts) if tree is None or isinstance(tree, TreeConfig) else list(tree)
        if not len(params_list) == len(trees) == len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params and {len(trees)} trees")
        ids = [self.encode(p) for p in prompts]
        for prompt_ids, p, t in zip(ids, params_list, trees):
            self.scheduler.check(len(prompt_ids), p, t)
        keys = [uuid.uuid4().hex for _ in ids]
        unsent = list(zip(keys, ids, params_list, trees))[::-1]  # added as the scheduler's queue has room
        parts: dict[str, tuple[list[int], list[str]]] = {key: ([], []) for key in keys}
        logprobs: dict[str, list[TokenLogprob] | None] = {
            key: None if p.logprobs is None else [] for key, p in zip(keys, params_list)
        }
        last: dict[str, StreamChunk] = {}
        try:
            while any(key not in last or last[key].finish_reason is None for key in keys):
                while unsent and self.scheduler.num_waiting < max(self.scheduler.config.max_waiting, 1):
                    key, prompt_ids, p, t = unsent.pop()
                    self.scheduler.add(key, prompt_ids, p, t)
                for out in self.scheduler.step():
                    if out.request_id in parts:
                        token_ids, text = parts[out.request_id]
                        token_ids += out.chunk.token_ids
                        text.append(out.chunk.text)
                        if out.chunk.logprobs is not None:
                            logprobs[out.request_id] += out.chunk.logprobs
                        last[out.request_id] = out.chunk
        finally:
            for key in keys:
                self.scheduler.abort(key)
        return [
            Generation(parts[k][0], "".join(parts[k][1]), last[k].finish_reason, last[k].stats, len(i), logprobs[k])
            for k, i in zip(keys, ids)
        ]

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams, tree: TreeConfig | None = None
    ) -> Iterator[StreamChunk]:
        """One chunk per round of this request (tokens kept, text delta); the last has finish_reason set."""
        prompt_ids = self.encode(prompt)
        self.check_length(len(prompt_ids), params)
        key = self._add(prompt_ids, params, tree)
        try:
            while True:
                for out in self.scheduler.step():
                    if out.request_id == key:
                        yield out.chunk
                        if out.chunk.finish_reason is not None:
                            return
        finally:
            self.scheduler.abort(key)

    def _add(self, prompt_ids: list[int], params: SamplingParams, tree: TreeConfig | None) -> str:
        key = uuid.uuid4().hex
        self.scheduler.add(key, prompt_ids, params, tree)
        return key


__all__ = ["DEFAULT_MIN_PATH_PROB", "DEFAULT_SCHEDULER", "Generation", "RequestTooLarge", "SpeculativeEngine",
           "StreamChunk"]
