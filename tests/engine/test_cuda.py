"""The engine on a CUDA device (skipped without one): the same promises as on CPU, checked where the GPU paths run.

- float64: greedy output is bit for bit HF `generate`'s and our plain decoding's, for every tree shape, with the
  shipped models and with tiny random ones (the drafter's tree states are copied by the Triton state-copy kernel);
- float32 and bfloat16: a batched tree forward and a one-token forward round differently, so greedy speculation may
  leave the plain output only where the target's two best tokens are a near-tie (DESIGN.md, "Floating point");
- sampled output has the target's distribution (chi-square and total variation against the enumerated target);
- the drafter's CUDA step, extend and prefill agree with its float64 CPU reference.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from ray_specdec.config import SamplingParams, TreeConfig  # noqa: E402
from ray_specdec.defaults import DEFAULT_DRAFTER, DEFAULT_TARGET  # noqa: E402
from ray_specdec.engine.llm import SpeculativeEngine  # noqa: E402
from ray_specdec.models.drafter.mamba import MambaDrafter  # noqa: E402
from ray_specdec.models.target.model import TargetModel  # noqa: E402
from ray_specdec.speculation.sampling import logits_to_probs  # noqa: E402
from ray_specdec.training.corpus import heldout_prompts  # noqa: E402
from ray_specdec.speculation.tree import build_tree  # noqa: E402
from tests.helpers.inputs import TREES, random_prompt  # noqa: E402
from tests.helpers.models import tiny_gpt_neox, tiny_llama, tiny_mamba  # noqa: E402
from tests.helpers.reference import sample_counts  # noqa: E402

CUDA = torch.device("cuda")
SHIPPED_TREES = [(1, 1, 1, 1), (2, 2, 1, 1), (3, 2, 2, 1, 1), (2, 2, 2, 1, 1, 1)]


def greedy_hf(target: TargetModel, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=target.device)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                eos_token_id=sorted(target.eos_token_ids) or None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def shipped64():
    target = TargetModel.from_pretrained(str(DEFAULT_TARGET), dtype=torch.float64, device="cuda")
    drafter = MambaDrafter.from_pretrained(str(DEFAULT_DRAFTER), dtype=torch.float64, device="cuda")
    return target, drafter


def shipped_prompts(tokenizer) -> list[list[int]]:
    short = heldout_prompts(3, 40, 200, seed=21, tokenizer=tokenizer)
    long = heldout_prompts(1, 1500, 2000, seed=22, tokenizer=tokenizer)
    return [p.token_ids for p in short + long]


def test_shipped_models_float64_greedy_is_the_targets_for_every_tree(shipped64):
    target, drafter = shipped64
    assert drafter.device.type == "cuda" and target.device.type == "cuda"
    n = 48
    for prompt in shipped_prompts(target.tokenizer):
        expected = greedy_hf(target, prompt, n)
        assert SpeculativeEngine(target, None).generate(prompt, SamplingParams(max_new_tokens=n)).token_ids == expected
        accepted = []
        for branching in SHIPPED_TREES:
            result = SpeculativeEngine(target, drafter, TreeConfig(branching)).generate(
                prompt, SamplingParams(max_new_tokens=n))
            assert result.token_ids == expected, branching
            accepted.append(sum(result.stats.accepted_lengths) - result.stats.rounds)
        assert max(accepted) > n // 4, "the shipped pair must agree often, or the test checked little drafting"


@pytest.mark.parametrize("make_target", [tiny_gpt_neox, tiny_llama], ids=["neox", "llama"])
def test_tiny_models_float64_greedy_for_every_tree(make_target):
    target = TargetModel(make_target(torch.float64, max_positions=512).to(CUDA))
    drafter = MambaDrafter(tiny_mamba().model.to(CUDA))
    for prompt_len in (1, 37, 300):
        prompt, n = random_prompt(prompt_len, seed=prompt_len), 23
        expected = greedy_hf(target, prompt, n)
        for branching in TREES:
            result = SpeculativeEngine(target, drafter, TreeConfig(branching)).generate(
                prompt, SamplingParams(max_new_tokens=n))
            assert result.token_ids == expected, (prompt_len, branching)


@pytest.mark.parametrize("dtype, tie", [(torch.float32, 1e-3), (torch.bfloat16, 0.25)])
def test_low_precision_greedy_leaves_the_target_only_at_near_ties(dtype, tie):
    """Where speculation's greedy text first differs from plain decoding's, the plain target's logits there must hold
    both tokens within `tie` of each other (bfloat16 logits of magnitude ~10 are spaced 0.0625 apart)."""
    target = TargetModel.from_pretrained(str(DEFAULT_TARGET), dtype=dtype, device="cuda")
    drafter = MambaDrafter.from_pretrained(str(DEFAULT_DRAFTER), dtype=dtype, device="cuda")
    n, same = 48, 0
    prompts = shipped_prompts(target.tokenizer)
    for prompt in prompts:
        plain = SpeculativeEngine(target, None).generate(prompt, SamplingParams(max_new_tokens=n)).token_ids
        for branching in SHIPPED_TREES[:2]:
            ours = SpeculativeEngine(target, drafter, TreeConfig(branching)).generate(
                prompt, SamplingParams(max_new_tokens=n)).token_ids
            if ours == plain:
                same += 1
                continue
            at = next(i for i, (a, b) in enumerate(zip(ours, plain)) if a != b)
            with torch.inference_mode():
                ids = torch.tensor([prompt + plain[:at]], device=CUDA)
                logits = target.model(ids).logits[0, -1].double()
            gap = abs(float(logits[plain[at]] - logits[ours[at]]))
            assert gap <= tie, (branching, at, gap)
    assert same >= len(prompts), "near-ties should be rare: most generations must match plain decoding exactly"


VOCAB = 6


def test_sampled_output_has_the_target_distribution_on_cuda():
    target = TargetModel(tiny_gpt_neox(torch.float64, vocab=VOCAB, seed=5).to(CUDA))
    target.eos_token_ids = frozenset()
    drafter = MambaDrafter(tiny_mamba(torch.float32, vocab=VOCAB, seed=6).model.to(CUDA))
    prompt, n_tokens, n_samples = [1, 4, 2], 2, 2000
    base = SamplingParams(temperature=0.9, max_new_tokens=n_tokens, draft_sampling="without_replacement")
    exact = {}
    for seq in itertools.product(range(VOCAB), repeat=n_tokens):
        with torch.inference_mode():
            logits = target.model(torch.tensor([prompt + list(seq)], device=CUDA)).logits[0].double().cpu()
        probs = logits_to_probs(logits, base)
        exact[seq] = float(np.prod([probs[len(prompt) - 1 + i, t] for i, t in enumerate(seq)]))
    engine = SpeculativeEngine(target, drafter, TreeConfig((3, 2)))
    counts, multi = sample_counts(engine, prompt, base, exact, n_samples)
    assert multi > 0, "some generations must take two tokens in one round, or drafting was not tested"
    keys = [k for k in exact if exact[k] * n_samples >= 5]
    rest = [k for k in exact if k not in keys]
    observed = np.array([counts[k] for k in keys] + [sum(counts[k] for k in rest)], dtype=float)
    expected = np.array([exact[k] for k in keys] + [sum(exact[k] for k in rest)]) * n_samples
    assert chisquare(observed, expected).pvalue > 1e-3
    tv = 0.5 * sum(abs(counts[k] / n_samples - exact[k]) for k in exact)
    assert tv < 0.08


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
def test_drafter_on_cuda_matches_its_float64_cpu_reference(dtype, rtol):
    reference = MambaDrafter.from_pretrained(str(DEFAULT_DRAFTER), dtype=torch.float64, device="cpu", native=False)
    drafter = MambaDrafter.from_pretrained(str(DEFAULT_DRAFTER), dtype=dtype, device="cuda")
    ids = heldout_prompts(1, 300, 300, seed=23, tokenizer=None)[0].token_ids
    ref_state, ref_logits = reference.prefill(ids)
    state, logits = drafter.prefill(ids)

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        err = (got.double().cpu() - want).norm() / want.norm()
        assert err < rtol, float(err)

    close(logits, ref_logits)
    ref_rows, rows = reference.copy_rows(ref_state, [0, 0, 0]), drafter.copy_rows(state, [0, 0, 0])
    tokens = [ids[-1], 17, 99]
    close(drafter.step(rows, tokens), reference.step(ref_rows, tokens))
    close(rows.ssm, ref_rows.ssm)
    close(drafter.extend(state, ids[:40]), reference.extend(ref_state, ids[:40]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_steps_are_the_eager_steps_bit_for_bit(dtype):
    graphed = MambaDrafter.from_pretrained(str(DEFAULT_DRAFTER), dtype=dtype, device="cuda")
    eager = MambaDrafter.from_pretrained(str(DEFAULT_DRAFTER), dtype=dtype, device="cuda", cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    gen = torch.Generator(device=CUDA).manual_seed(0)
    ids = heldout_prompts(1, 64, 64, seed=24, tokenizer=None)[0].token_ids
    root, _ = graphed.prefill(ids)
    # two states of the same row count stepped alternately: each replay must read its caller's state, and the
    # logits handed out earlier must survive later replays
    for rows in (1, 3, 12, 64, 65):  # 65: past MAX_GRAPH_ROWS, the eager step
        a, b = graphed.copy_rows(root, [0] * rows), graphed.copy_rows(root, [0] * rows)
        a_ref, b_ref = graphed.copy_rows(root, [0] * rows), graphed.copy_rows(root, [0] * rows)
        kept = []
        for _ in range(3):
            for state, ref in ((a, a_ref), (b, b_ref)):
                tokens = torch.randint(0, graphed.vocab_size, (rows,), generator=gen, device=CUDA)
                got, want = graphed.step(state, tokens), eager.step(ref, tokens)
                kept.append((got, want.clone()))
                assert torch.equal(state.conv, ref.conv) and torch.equal(state.ssm, ref.ssm)
        assert all(torch.equal(got, want) for got, want in kept)
    assert graphed.graphs.captured == list(range(1, 65))  # all captured at load
    # catch-ups: a 1-row state advanced by n tokens, n up to MAX_GRAPH_TOKENS (33: past it, eager)
    for n in (1, 2, 5, 33, 2):
        state, ref = graphed.copy_rows(root, [0]), graphed.copy_rows(root, [0])
        ids = torch.randint(0, graphed.vocab_size, (n,), generator=gen, device=CUDA)
        assert torch.equal(graphed.extend(state, ids), eager.extend(ref, ids))
        assert torch.equal(state.conv, ref.conv) and torch.equal(state.ssm, ref.ssm)
    assert graphed.extend_graphs.captured == list(range(2, 33))  # one token: a step (graphed as a step)


def test_target_forwards_never_take_cudnn_attention():
    """cuDNN's sdpa builds an execution plan per new shape, and every verify of a growing cache is a new shape (~7 ms
    of host time per attention call in bfloat16 on an H200): the target's prefill and verify run without it."""
    target = TargetModel.from_pretrained(str(DEFAULT_TARGET), dtype=torch.bfloat16, device="cuda")
    cache = target.new_cache()
    tree = build_tree([(0,), (0, 0)])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        target.prefill(cache, torch.randint(1, target.vocab_size, (700,)))
        for _ in range(3):
            target.verify(cache, 5, tree, torch.tensor([7, 8]))
            target.commit(cache, [0, 1])
        torch.cuda.synchronize()
    names = {event.name for event in prof.events()}
    assert any("scaled_dot_product" in name for name in names)  # attention did run through sdpa
    assert not [name for name in names if "cudnn" in name.lower()]
