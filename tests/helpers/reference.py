"""What speculative output is checked against: HF generate's greedy tokens, the target's exact distribution over
short continuations (and a test that sampled output follows it), and a loop-by-token reference of logits processing."""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
from scipy.stats import chisquare

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.target.model import TargetModel
from tests.helpers.models import tiny_mamba

ENUMERATED_VOCAB = 6  # the vocabulary of targets whose continuations are enumerated: 6^n sequences of n tokens


def hf_greedy(target: TargetModel, prompt: list[int], n: int) -> list[int]:
    out = target.model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=sorted(target.eos_token_ids),
        pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt):].tolist()


def hf_greedy_ignore_eos(target, prompt, n):
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def enumerate_target(target: TargetModel, prompt: list[int], params: SamplingParams, n: int) -> dict:
    """Exact target-only distribution over the next n tokens (processed by temperature / top-k / top-p)."""
    from ray_specdec.speculation.sampling import logits_to_probs

    dist = {}
    for seq in itertools.product(range(ENUMERATED_VOCAB), repeat=n):
        with torch.no_grad():
            logits = target.model(torch.tensor([prompt + list(seq)])).logits[0].double()
        probs = logits_to_probs(logits, params)
        dist[seq] = float(np.prod([probs[len(prompt) - 1 + i, t] for i, t in enumerate(seq)]))
    return dist



def seeded_generations(engine, prompt, base: SamplingParams, n_samples: int) -> list:
    """`base` generated with seeds 0..n_samples-1 as one continuously batched workload. Each generation draws from
    its own seed, so the samples are independent whatever the batch they share a step with."""
    params = [SamplingParams(**{**base.__dict__, "seed": seed}) for seed in range(n_samples)]
    return engine.generate_many([prompt] * n_samples, params)


def sample_counts(engine, prompt, base: SamplingParams, outcomes, n_samples: int) -> tuple[dict, int]:
    """Generate with seeds 0..n_samples-1 (`seeded_generations`) -> (times each of `outcomes` was emitted,
    generations that took several tokens in some round)."""
    counts, multi = dict.fromkeys(outcomes, 0), 0
    for result in seeded_generations(engine, prompt, base, n_samples):
        counts[tuple(result.token_ids)] += 1
        multi += result.stats.rounds < base.max_new_tokens
    return counts, multi


def assert_emitted_distribution(counts: dict, exact: dict, n_samples: int, vocab: int) -> None:
    """Sequences emitted `counts` times over n_samples generations follow the enumerated distribution `exact`:
    nothing impossible, a chi-square test (rare outcomes pooled), and total variation on the first two tokens
    (vocab^2 outcomes: sampling noise alone stays well below the bound)."""
    keys = [k for k in exact if exact[k] > 0]
    assert all(counts[k] == 0 for k in exact if exact[k] == 0), "emitted a sequence the target cannot produce"
    observed = np.array([counts[k] for k in keys], dtype=float)
    expected = np.array([exact[k] for k in keys]) * n_samples
    big = expected >= 5  # chi-square needs enough expected counts; pool the rest
    obs, exp = observed[big], expected[big]
    if (~big).any():
        obs, exp = np.append(obs, observed[~big].sum()), np.append(exp, expected[~big].sum())
    assert chisquare(obs, exp).pvalue > 1e-3
    tv = 0.0
    for prefix in itertools.product(range(vocab), repeat=2):
        emitted = sum(counts[k] for k in exact if k[:2] == prefix) / n_samples
        tv += 0.5 * abs(emitted - sum(exact[k] for k in exact if k[:2] == prefix))
    assert tv < 0.08


def reference_row(
    raw: torch.Tensor,  # [V]
    prompt: list[int],
    generated: list[int],  # every token generated before this position
    params: SamplingParams,
    stop_ids: frozenset[int],
) -> torch.Tensor:
    """One position's processed logits, token by token, as a target-only decoding loop would compute them."""
    x = raw.clone()
    for token, bias in params.logit_bias:
        x[token] += bias
    for v in range(x.numel()):
        count = generated.count(v)
        if count or v in prompt:
            r = params.repetition_penalty
            x[v] = x[v] / r if x[v] > 0 else x[v] * r
        x[v] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    if len(generated) < params.min_tokens:
        for v in stop_ids:
            x[v] = -math.inf
    return x


def greedy_margin(model, prompt: list[int], generated: list[int]) -> float:
    """Smallest top-1 minus top-2 logit of HF `model` along a greedy path: float32 tree and single-token forwards may
    disagree in the last bits, so exact-equality tests must not sit on a near-tie."""
    ids = torch.tensor(prompt + generated)
    with torch.no_grad():
        logits = model(ids[None]).logits[0, len(prompt) - 1 : -1]
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def assert_greedy_speculation_is_the_target_alone(reference, target: TargetModel, prompt_step: int = 7) -> None:
    """Plain decoding and tree drafts (lookup included) on `target` give HF generate's tokens on `reference`, over 6
    prompts (5 + prompt_step * k tokens), of which those whose greedy path holds a float32 near-tie are skipped (at
    least 4 must be left)."""
    drafter = tiny_mamba(torch.float32, fast_matmul=True)
    engines = [SpeculativeEngine(target, None)] + [
        SpeculativeEngine(target, drafter, TreeConfig.parse(t)) for t in ("1,1,1", "3,2,1", "2,2,1+L4")]
    checked = 0
    for seed in range(6):
        length = 5 + prompt_step * seed
        prompt = torch.randint(1, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
        expected = out[0, len(prompt):].tolist()
        if greedy_margin(reference, prompt, expected) < 1e-4:
            continue
        checked += 1
        for engine in engines:
            assert engine.generate(prompt, SamplingParams(max_new_tokens=20)).token_ids == expected
    assert checked >= 4
