"""The in-process engine: the step scheduler (engine/scheduler.py) over a target and a drafter loaded in this process.

`generate` / `stream` run one request; `generate_many` runs a list of prompts as one continuously batched workload
(like vLLM's `LLM.generate(list)`). All of them step the same `Scheduler` the Serve app runs, so what the CLI and the
benchmark measure is the served loop. Without a drafter every round has an empty tree: plain target decoding through
the same code path.
"""

from __future__ import annotations

import uuid
from typing import Iterator, Sequence

from ray_specdec.config import SamplingParams, TreeConfig, default_tree
from ray_specdec.engine.config import EngineConfig
from ray_specdec.engine.outputs import Generation, StreamChunk
from ray_specdec.engine.request import RequestTooLarge
from ray_specdec.engine.scheduler import Scheduler
from ray_specdec.engine.target_backend import LocalTarget
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.drafter.mamba_state import StateSlots
from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.logits_processing import TokenLogprob


class SpeculativeEngine:
    def __init__(
        self,
        target: TargetModel,
        drafter: MambaDrafter | None,
        tree_policy=None,
        tokenizer=None,
        config: EngineConfig = EngineConfig(),
    ):
        """tree_policy: a TreeConfig or a tree policy (the bandit); None: the target's device's default tree
        (config.default_tree). config: the engine's settings (engine/config.py), the same defaults as the CLI's and
        the app's; the scheduler runs its scheduler and speculation parts."""
        self.target = target
        self.tokenizer = tokenizer if tokenizer is not None else target.tokenizer
        self.config = config
        policy = tree_policy if tree_policy is not None else default_tree(target.device)
        self.scheduler = Scheduler(LocalTarget(target), drafter, self.tokenizer, policy, config.scheduler,
                                   speculation=config.speculation)

    @property
    def policy(self):
        return self.scheduler.policy

    @property
    def lookup(self) -> int:
        return self.config.speculation.lookup

    @property
    def min_path_prob(self) -> float:
        return self.config.speculation.min_path_prob

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


__all__ = ["Generation", "RequestTooLarge", "SpeculativeEngine", "StreamChunk"]
