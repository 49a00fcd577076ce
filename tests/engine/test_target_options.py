"""End to end: penalties, logit_bias, min_tokens (on stop ids and stop strings) and stop_token_ids keep speculation
lossless; logprobs do not depend on drafting."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import DynamicCache

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.defaults import DEFAULT_DRAFTER, DEFAULT_TARGET
from ray_specdec.engine.config import EngineConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.sampling import logits_to_probs
from tests.helpers.drafters import TargetEchoDrafter
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_gpt_neox, tiny_llama, tiny_mamba, tiny_tokenizer
from tests.helpers.reference import assert_emitted_distribution, reference_row, sample_counts

TREES = ["1,1,1", "3,2,1", "2,2,1,1", "1,1,1+L4", "2,2,1+L8"]
TARGETS = {"neox": tiny_gpt_neox, "llama": tiny_llama}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request):
    return TargetModel(TARGETS[request.param](torch.float64, max_positions=512))


def reference_greedy(model, prompt: list[int], params: SamplingParams, stop_ids: frozenset[int]) -> list[int]:
    """Target-only greedy decoding, one-token forwards over the KV cache, the options applied position by position."""
    generated: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), past_key_values=DynamicCache(config=model.config), use_cache=True)
        while True:
            row = reference_row(out.logits[0, -1].double(), prompt, generated, params, stop_ids)
            generated.append(int(row.argmax()))
            if generated[-1] in stop_ids or len(generated) == params.max_new_tokens:
                return generated
            out = model(torch.tensor([generated[-1:]]), past_key_values=out.past_key_values, use_cache=True)


def options(case: str, target: TargetModel) -> SamplingParams:
    eos = sorted(target.eos_token_ids)
    return {
        "penalties": SamplingParams(max_new_tokens=24, presence_penalty=1.0, frequency_penalty=0.5,
                                    logit_bias=((7, 2.0), (20, -100.0))),
        # below 1 and negative: repeats are favoured, so the paths' own counts decide many tokens
        "favour repeats": SamplingParams(max_new_tokens=24, repetition_penalty=0.7, frequency_penalty=-0.5),
        # EOS is every row's argmax once allowed: generation stops right at min_tokens + 1
        "min_tokens": SamplingParams(max_new_tokens=24, repetition_penalty=1.4, min_tokens=9, stop_token_ids=(11,),
                                     logit_bias=tuple((e, 100.0) for e in eos)),
    }[case]


@pytest.mark.parametrize("case", ["penalties", "favour repeats", "min_tokens"])
def test_greedy_with_options_equals_the_reference_loop_for_every_tree(target, case):
    params = options(case, target)
    stop_ids = target.eos_token_ids | frozenset(params.stop_token_ids)
    deep = 0
    for prompt in (random_prompt(9, seed=1), random_prompt(16, seed=2) * 2):  # the second repeats: lookup matches
        expected = reference_greedy(target.model, prompt, params, stop_ids)
        if case == "min_tokens":
            assert len(expected) == params.min_tokens + 1 and expected[-1] in target.eos_token_ids
        else:
            assert expected != reference_greedy(target.model, prompt, SamplingParams(max_new_tokens=24), stop_ids)
        plain = SpeculativeEngine(target, None).generate(prompt, params)
        assert plain.token_ids == expected
        for text, drafter in itertools.product(TREES, (tiny_mamba(), TargetEchoDrafter(target.model, noise=1.0))):
            result = SpeculativeEngine(target, drafter, TreeConfig.parse(text)).generate(prompt, params)
            assert result.token_ids == expected, (text, type(drafter).__name__)
            assert result.finish_reason == plain.finish_reason
            deep += sum(a >= 3 for a in result.stats.accepted_lengths)
    assert deep > 0, "no round accepted two drafts: the rows' own path counts were never exercised"


def test_stop_token_ids_stop_speculative_generation_where_plain_decoding_stops(target):
    prompt = random_prompt(12, seed=3)
    free = SpeculativeEngine(target, None).generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
    stop = free.token_ids[7]
    first = free.token_ids.index(stop)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, stop_token_ids=(stop,))
    for text in ("none", *TREES):
        result = SpeculativeEngine(target, TargetEchoDrafter(target.model, noise=0.0), TreeConfig.parse(text)).generate(
            prompt, params
        )
        assert result.token_ids == free.token_ids[: first + 1] and result.finish_reason == "stop", text


def first_stop(tokenizer, token_ids: list[int], stop: str, min_tokens: int) -> int | None:
    """Slow reference: how many tokens a generation keeps when `stop` may end it only where it completes in a token
    after the first min_tokens (None: never)."""
    held = len(tokenizer.decode(token_ids[:min_tokens], skip_special_tokens=True))
    for n in range(min_tokens + 1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:n], skip_special_tokens=True)
        if any(text.startswith(stop, p) and p + len(stop) > held for p in range(len(text))):
            return n
    return None


@pytest.mark.parametrize("min_tokens, kept", [(0, 4), (3, 4), (4, 7), (6, 7), (7, None)])
def test_min_tokens_runs_past_an_early_stop_string_with_drafting_on_and_off(min_tokens, kept):
    tok = tiny_tokenizer()
    target = TargetModel(tiny_gpt_neox(torch.float64, vocab=len(tok)), tok)
    prompt = "the quick brown"
    free = SpeculativeEngine(target, None).generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
    # "jumps" completes at tokens 4 and 7 (token 6 is an EOS, ignored; its text is empty), never again
    assert free.text.startswith("of is is jumps verified jumps verified of the") and free.token_ids[5] == 0
    assert first_stop(tok, free.token_ids, "jumps", min_tokens) == kept
    expected = free.token_ids[:kept]
    expected_text = free.text if kept is None else tok.decode(expected, skip_special_tokens=True)[: -len("jumps")]
    assert expected_text.count("jumps") == (min_tokens >= 4) + (kept is None)  # the early ones stay in the text
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, stop=("jumps",), min_tokens=min_tokens)
    deep = 0
    for text, drafter in [("none", None), *itertools.product(["1,1,1", "3,2,1", "2,2,1+L4"], [
            TargetEchoDrafter(target.model, noise=0.0), tiny_mamba(vocab=len(tok))])]:  # fmt: skip
        result = SpeculativeEngine(target, drafter, TreeConfig.parse(text)).generate(prompt, params)
        assert result.token_ids == expected, (text, type(drafter).__name__)
        assert (result.text, result.finish_reason) == (expected_text, "length" if kept is None else "stop")
        deep += sum(a >= 3 for a in result.stats.accepted_lengths)
    assert deep > 0, "no round accepted several tokens: the stop never fell inside a round"


def test_logit_bias_outside_the_vocabulary_is_refused(target):
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeEngine(target, None).generate([5, 6], SamplingParams(logit_bias=((target.vocab_size, 1.0),)))


# ---- logprobs: the target's own, whatever was drafted ---------------------------------------------------------------


def test_logprobs_with_drafting_equal_logprobs_without_on_the_shipped_pair():
    """The shipped target in float32 on CPU is batch-invariant: every verify row equals the one-token row exactly."""
    target = TargetModel.from_pretrained(str(DEFAULT_TARGET))
    assert target.batch_invariant
    drafter = MambaDrafter.from_pretrained(str(DEFAULT_DRAFTER))
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    params = SamplingParams(max_new_tokens=40, presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.1,
                            logit_bias=((0, -5.0), (13, 1.0)), logprobs=5)
    plain = SpeculativeEngine(target, None).generate(prompt, params)
    assert len(plain.logprobs) == len(plain.token_ids) and all(len(lp.top) == 5 for lp in plain.logprobs)
    accepted = 0
    for text in ("1,1,1", "2,2,1,1", "1,1,1+L8"):
        result = SpeculativeEngine(target, drafter, TreeConfig.parse(text)).generate(prompt, params)
        assert result.token_ids == plain.token_ids, text
        assert result.logprobs == plain.logprobs, text  # float for float, ids and order of the top-5 too
        accepted += sum(a > 1 for a in result.stats.accepted_lengths)
    assert accepted > 0
    off = SpeculativeEngine(target, drafter, TreeConfig.parse("2,2,1,1")).generate(
        prompt, SamplingParams(**{**params.__dict__, "logprobs": None})
    )
    assert off.token_ids == plain.token_ids and off.logprobs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logprobs_are_the_raw_targets_with_and_without_drafting(dtype):
    """float32: batch-invariant verify rows, so equal to the last bit; float64: equal within rounding. Both are the
    log_softmax of the model's own logits, before penalties and temperature."""
    target = TargetModel(tiny_llama(dtype, max_positions=512))
    assert dtype != torch.float32 or target.batch_invariant
    prompt = random_prompt(10, seed=4)
    params = SamplingParams(max_new_tokens=20, frequency_penalty=0.8, logprobs=3, ignore_eos=True)
    plain = SpeculativeEngine(target, None).generate(prompt, params)
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + plain.token_ids])).logits[0, len(prompt) - 1: -1]
    reference = torch.log_softmax(logits.to(torch.float64), dim=-1)
    got = torch.tensor([lp.logprob for lp in plain.logprobs], dtype=torch.float64)
    chosen = reference.gather(1, torch.tensor(plain.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(got, chosen, rtol=1e-4 if dtype == torch.float32 else 1e-10, atol=1e-5)
    assert [[t for t, _ in lp.top] for lp in plain.logprobs[:5]] == reference[:5].topk(3).indices.tolist()
    for text in ("3,2,1", "2,2,1,1+L4"):
        result = SpeculativeEngine(target, TargetEchoDrafter(target.model, noise=1.0), TreeConfig.parse(text)).generate(
            prompt, params
        )
        assert result.token_ids == plain.token_ids
        assert max(result.stats.accepted_lengths) > 1  # some logprobs come from rows below the root
        if dtype == torch.float32:
            assert result.logprobs == plain.logprobs
        else:
            for a, b in zip(result.logprobs, plain.logprobs):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-12)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]


# ---- sampling: the emitted distribution is the processed target's -------------------------------------------------

VOCAB = 6


def enumerate_processed(target: TargetModel, prompt: list[int], params: SamplingParams, n: int) -> dict:
    """Exact target-only distribution over the next n tokens, processed position by position (reference_row), then
    temperature / top-k / top-p."""
    stop_ids = target.eos_token_ids | frozenset(params.stop_token_ids)
    dist = {}
    for seq in itertools.product(range(VOCAB), repeat=n):
        with torch.no_grad():
            logits = target.model(torch.tensor([prompt + list(seq)])).logits[0].double()
        p = 1.0
        for i, token in enumerate(seq):
            row = reference_row(logits[len(prompt) - 1 + i], prompt, list(seq[:i]), params, stop_ids)
            p *= float(logits_to_probs(row, params)[token])
        dist[seq] = p
    return dist


SAMPLED = {
    "penalties": dict(presence_penalty=0.8, frequency_penalty=0.6, logit_bias=((2, 1.5), (5, -1.0))),
    "repetition, top-k": dict(repetition_penalty=1.8, frequency_penalty=-0.7, top_k=4, temperature=1.5),
    # EOS (0) cannot come first or second; it can third
    "min_tokens": dict(repetition_penalty=0.6, presence_penalty=-1.0, min_tokens=2, logit_bias=((0, 2.0),)),
}


@pytest.mark.parametrize(
    "case, tree, draft_sampling, coupling",
    [
        ("penalties", "2,1", "iid", "rejection"),
        ("penalties", "3,2", "without_replacement", "rejection"),
        ("repetition, top-k", "2,2", "without_replacement", "rejection"),
        ("min_tokens", "2,1", "without_replacement", "rejection"),
        # a deterministic lookup branch tried before the drafter's children
        ("penalties", "2,1+L2", "iid", "rejection"),
        # coupled: each row's keyed argmax of its processed distribution
        ("penalties", "3,2", "without_replacement", "coupled"),
        ("repetition, top-k", "2,1+L2", "without_replacement", "coupled"),
        ("min_tokens", "2,1", "without_replacement", "coupled"),
    ],
)
def test_sampled_generation_with_options_has_the_processed_target_distribution(case, tree, draft_sampling, coupling):
    target = TargetModel(tiny_gpt_neox(torch.float64, vocab=VOCAB, seed=5))  # eos = 0
    if case != "min_tokens":
        target.eos_token_ids = frozenset()
    prompt = [1, 4, 2, 3, 5, 1, 4]  # ends with a bigram seen before: lookup branches find it
    n_tokens, n_samples = 3, 2000
    base = SamplingParams(**{"temperature": 1.0, **SAMPLED[case]}, max_new_tokens=n_tokens,
                          draft_sampling=draft_sampling)
    exact = enumerate_processed(target, prompt, base, n_tokens)
    assert abs(sum(exact.values()) - 1.0) < 1e-9
    engine = SpeculativeEngine(target, tiny_mamba(vocab=VOCAB, seed=6), TreeConfig.parse(tree),
                               config=EngineConfig().with_fields(sampling_coupling=coupling))
    counts, multi = sample_counts(engine, prompt, base, exact, n_samples)
    assert multi > 0, "some generations must take several tokens in one round, or drafting was not tested"
    assert_emitted_distribution(counts, exact, n_samples, VOCAB)
