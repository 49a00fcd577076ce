"""The engine replica (the app's engine, without Serve) on SSM and hybrid targets loaded from directories: the bandit's
controller prices trees on them (its measured prior runs through the SSM target), and requests served at once give
HF generate's greedy tokens."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deployments.engine import EngineReplica
from ray_specdec.config import SamplingParams
from ray_specdec.engine.outputs import StreamChunk
from ray_specdec.models.target.ssm import SSMTargetModel
from ray_specdec.speculation.bandit import BanditConfig
from tests.helpers.inputs import random_prompt
from tests.helpers.models import SSM_TARGETS, tiny_mamba, tiny_tokenizer
from tests.helpers.reference import greedy_margin

MAX_TOKENS = 16


@pytest.mark.parametrize("kind", sorted(SSM_TARGETS))
def test_requests_served_at_once_give_hf_greedy_tokens(tmp_path, kind):
    model = SSM_TARGETS[kind]()
    model.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    tiny_mamba().model.save_pretrained(tmp_path / "drafter")
    prompts = [random_prompt(n, seed=n) for n in (3, 11, 40)]
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        expected.append(out[0, len(prompt):].tolist())
        assert greedy_margin(model, prompt, expected[-1]) > 1e-4, "pick another seed: a near tie"
    replica = EngineReplica(str(tmp_path / "target"), str(tmp_path / "drafter"), dtype="float64",
                            policy=BanditConfig())  # fmt: skip
    try:
        assert isinstance(replica.backend.target, SSMTargetModel)

        async def one(prompt: list[int]) -> list[int]:
            tokens = []
            async for item in replica.generate(prompt, SamplingParams(max_new_tokens=MAX_TOKENS, ignore_eos=True)):
                assert isinstance(item, StreamChunk), item
                tokens += item.token_ids
            return tokens

        async def all_at_once() -> list[list[int]]:
            return await asyncio.gather(*(one(p) for p in prompts))

        assert asyncio.run(all_at_once()) == expected
        assert replica.loop.scheduler.controller.cost.calibrated
    finally:
        replica.shutdown()
