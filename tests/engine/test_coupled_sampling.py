"""Coupled sampling through the engine: a seeded sampled request gets the same token ids whatever the drafter, the
tree, the batch, the prefill chunks or the prefix cache (as greedy requests do), and its emitted distribution is the
target's (chi-square against the enumerated distribution, the seed varied)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ray_specdec.config import NO_TREE, SamplingParams, TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.models.target.model import TargetModel
from tests.helpers.bigram import agreeing_pair
from tests.helpers.configs import lookup_off
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_gpt_neox, tiny_mamba
from tests.helpers.reference import ENUMERATED_VOCAB, assert_emitted_distribution, enumerate_target, sample_counts

# Trees a request may ask for (None: the engine's policy decides), cycled over a batch.
TREES = [None, NO_TREE, TreeConfig((1,)), TreeConfig((3, 2, 1)), TreeConfig((1, 1, 1, 1)), TreeConfig((2, 2, 1, 1)),
         TreeConfig((2,), lookup=3), TreeConfig((1, 1, 1), lookup=2)]  # fmt: skip
SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=1.3, top_p=0.9),
            dict(temperature=0.8, presence_penalty=0.7, frequency_penalty=0.3, logit_bias=((3, 2.0),))]  # fmt: skip


@pytest.fixture(scope="module")
def pair():
    """A batch-invariant float32 target and a drafter that often agrees with it (deep rounds)."""
    target, drafter = agreeing_pair(torch.float32, max_positions=1024)
    assert target.batch_invariant, target.batch_invariant_why
    return target, drafter


def params_of(i: int, n: int = 24, **more) -> SamplingParams:
    return SamplingParams(**SETTINGS[i % len(SETTINGS)], seed=1000 + i, max_new_tokens=n, ignore_eos=True, **more)


def test_a_seeded_request_gets_its_tokens_whatever_the_drafting(pair):
    """Target alone, every tree (lookup branches and drafts cut by path probability too), no tree: the same ids, the
    same logprobs; and drafting does take several tokens a round."""
    target, drafter = pair
    deep = 0
    for i, prompt_len in enumerate((5, 40)):
        prompt = random_prompt(prompt_len, seed=i, vocab=target.vocab_size)
        for s in range(len(SETTINGS)):
            params = params_of(s, logprobs=2)
            alone = SpeculativeEngine(target, None, config=lookup_off()).generate(prompt, params)
            assert len(alone.token_ids) == params.max_new_tokens
            for tree in ("none", "1,1,1", "3,2,1", "2,2,1,1", "2,1+L4"):
                for min_path_prob in (0.0, 0.3):
                    engine = SpeculativeEngine(target, drafter, TreeConfig.parse(tree),
                                               config=lookup_off(min_path_prob=min_path_prob))
                    got = engine.generate(prompt, params)
                    assert got.token_ids == alone.token_ids, (prompt_len, s, tree, min_path_prob)
                    assert [lp.logprob for lp in got.logprobs] == pytest.approx(
                        [lp.logprob for lp in alone.logprobs], abs=1e-5)
                    deep += sum(a > 2 for a in got.stats.accepted_lengths)
    assert deep > 0


def test_a_seeded_request_gets_its_tokens_in_any_batch(pair):
    """32 seeded sampled requests (and greedy ones) of mixed lengths, settings and trees in one continuous batch, with
    the engine's own prompt lookup on: each gets exactly its tokens alone, and its tokens alone without a drafter."""
    target, drafter = pair
    prompts = [random_prompt(3 + (37 * i) % 150, seed=50 + i, vocab=target.vocab_size) for i in range(32)]
    params = [params_of(i, n=8 + (5 * i) % 25) if i % 8 else SamplingParams(max_new_tokens=20, ignore_eos=True)
              for i in range(32)]  # fmt: skip
    trees = [TREES[i % len(TREES)] for i in range(32)]
    engine = SpeculativeEngine(target, drafter, TreeConfig((2, 1, 1)))
    together = engine.generate_many(prompts, params, trees)
    labels = {label for g in together for label in g.stats.trees}
    assert {"none", "3,2,1", "1,1,1,1"} <= labels
    plain = SpeculativeEngine(target, None)
    for i in range(32):
        alone = engine.generate(prompts[i], params[i], trees[i]).token_ids
        assert together[i].token_ids == alone == plain.generate(prompts[i], params[i]).token_ids, i


@pytest.mark.parametrize("config", [SchedulerConfig(prefill_chunk=16, step_tokens=48),
                                    SchedulerConfig(prefill_chunk=64, prefix_cache=False)], ids=["16", "64-no-cache"])
def test_a_seeded_request_gets_its_tokens_whatever_the_prefill_chunks(pair, config):
    """Prompts across chunk boundaries, prefilled in other chunks (and with the prefix cache off, or serving a second
    request of the same prompt): the same ids as the default engine's."""
    target, drafter = pair
    prompts = [random_prompt(n, seed=n, vocab=target.vocab_size) for n in (15, 16, 17, 100, 300)]
    params = [params_of(i) for i in range(len(prompts))]
    expected = SpeculativeEngine(target, drafter, TreeConfig((2, 1, 1))).generate_many(prompts, params)
    engine = SpeculativeEngine(target, drafter, TreeConfig((3, 1)), config=lookup_off(scheduler=config))
    for _ in range(2):  # the second time: prompt chunks from the prefix cache where it is on
        got = engine.generate_many(prompts, params)
        assert [g.token_ids for g in got] == [e.token_ids for e in expected]


def test_modes_and_keys(pair):
    """auto: seeded requests coupled, unseeded ones rejection-sampled; coupled: unseeded requests too (a random key
    each); rejection: seeded requests draw from their streams. Choices of one seed differ from each other and from
    the neighbouring seed's (the key is (seed, choice), not seed + choice)."""
    target, drafter = pair
    prompt = random_prompt(12, seed=3, vocab=target.vocab_size)
    seeded, unseeded = params_of(0, n=16), dataclasses.replace(params_of(0, n=16), seed=None)

    def noise_of(coupling: str, params: SamplingParams):
        engine = SpeculativeEngine(target, drafter, TreeConfig((2, 1)), config=lookup_off(sampling_coupling=coupling))
        engine.scheduler.add("r", prompt, params)
        return engine.scheduler.waiting[0].noise if engine.scheduler.waiting else engine.scheduler.running["r"].noise

    assert noise_of("auto", seeded).seed == seeded.seed and noise_of("auto", unseeded) is None
    assert noise_of("coupled", unseeded) is not None and noise_of("rejection", seeded) is None
    assert noise_of("auto", SamplingParams(seed=5)) is None  # greedy
    engine = SpeculativeEngine(target, drafter, TreeConfig((2, 1)), config=lookup_off(sampling_coupling="coupled"))
    free = {tuple(engine.generate(prompt, unseeded).token_ids) for _ in range(4)}
    assert len(free) > 1
    choices = [engine.generate(prompt, dataclasses.replace(seeded, choice=j)).token_ids for j in range(4)]
    assert len({tuple(c) for c in choices}) == 4
    assert engine.generate(prompt, dataclasses.replace(seeded, choice=2)).token_ids == choices[2]
    neighbour = engine.generate(prompt, dataclasses.replace(seeded, seed=seeded.seed + 1)).token_ids
    assert neighbour not in choices


@pytest.mark.parametrize(
    "tree, params, min_path_prob",
    [
        ("2,2", dict(temperature=1.0), 0.0),
        ("3,2", dict(temperature=0.6), 0.0),
        ("2,2", dict(temperature=2.0, top_k=4, top_p=0.9), 0.0),
        ("2,1", dict(temperature=2.0), 0.15),  # drafts cut short by the drafter's path probabilities
        ("none", dict(temperature=1.3, top_p=0.8), 0.0),
        ("1,1+L2", dict(temperature=1.0), 0.0),  # the prompt ends with a bigram seen before: a lookup branch
    ],
)
def test_coupled_generation_has_the_target_distribution(tree, params, min_path_prob):
    """2000 seeds, one generation each: the 3-token sequences follow the enumerated target distribution."""
    target = TargetModel(tiny_gpt_neox(torch.float64, vocab=ENUMERATED_VOCAB, seed=5))
    target.eos_token_ids = frozenset()
    prompt, n_samples = [1, 4, 2, 3, 5, 1, 4], 2000
    base = SamplingParams(**params, max_new_tokens=3)
    exact = enumerate_target(target, prompt, base, 3)
    engine = SpeculativeEngine(target, tiny_mamba(vocab=ENUMERATED_VOCAB, seed=6), TreeConfig.parse(tree),
                               config=lookup_off(sampling_coupling="coupled", min_path_prob=min_path_prob))
    counts, multi = sample_counts(engine, prompt, base, exact, n_samples)
    assert multi > 0 or tree == "none"
    assert_emitted_distribution(counts, exact, n_samples, ENUMERATED_VOCAB)
