"""End to end: speculative output is exactly the target's (greedy ids; sampled distribution)."""

from __future__ import annotations


import pytest
import torch
from scipy.stats import chisquare

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.config import EngineConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.native import library
from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.drafting import DrafterSession, empty_draft
from ray_specdec.speculation.verify import judge
from tests.helpers.drafters import EchoState, TargetEchoDrafter
from tests.helpers.configs import lookup_off
from tests.helpers.inputs import TREES, random_prompt
from tests.helpers.models import tiny_gpt_neox, tiny_mamba
from tests.helpers.reference import (ENUMERATED_VOCAB, assert_emitted_distribution, enumerate_target, hf_greedy,
                                     hf_greedy_ignore_eos, seeded_generations)


@pytest.mark.parametrize("prompt_len", [1, 37, 300])
def test_greedy_matches_target_and_hf_generate_for_every_tree(target, prompt_len):
    prompt = random_prompt(prompt_len, seed=prompt_len)
    n = 23  # odd, so that rounds end mid-tree
    expected = hf_greedy(target, prompt, n)
    plain = SpeculativeEngine(target, None).generate(prompt, SamplingParams(max_new_tokens=n))
    assert plain.token_ids == expected
    # the drafter's precision never shows in the output: a float32 drafter with low-precision matmuls drafts for the
    # float64 target too
    drafters = [tiny_mamba(), tiny_mamba(torch.float32, fast_matmul=True)]
    if prompt_len < 100:  # the echo drafter re-runs the whole context every step: keep its contexts short
        drafters.append(TargetEchoDrafter(target.model, noise=2.0))
    for branching in TREES:
        for drafter in drafters:
            for min_path_prob in (0.0, 0.3):  # 0.3: drafts cut short where the drafter rates its paths unlikely
                engine = SpeculativeEngine(target, drafter, TreeConfig(branching),
                                           config=lookup_off(min_path_prob=min_path_prob))
                result = engine.generate(prompt, SamplingParams(max_new_tokens=n))
                assert result.token_ids == expected, (branching, type(drafter).__name__, min_path_prob)
                assert len(result.token_ids) <= n


def test_echo_drafter_gets_deep_acceptance(target):
    """The agreeing drafter must actually exercise multi-token rounds (otherwise the test above proves little)."""
    prompt = random_prompt(20, seed=1)
    result = SpeculativeEngine(target, TargetEchoDrafter(target.model, noise=0.0), TreeConfig((1, 1, 1, 1))).generate(
        prompt, SamplingParams(max_new_tokens=30, ignore_eos=True)
    )
    assert result.stats.mean_accepted_length > 3.0
    assert len(result.token_ids) == 30
    assert result.token_ids == hf_greedy_ignore_eos(target, prompt, 30)


@pytest.mark.parametrize("max_new", [1, 2, 5, 11])
def test_never_overshoots_max_new_tokens(target, max_new):
    prompt = random_prompt(10, seed=3)
    engine = SpeculativeEngine(target, TargetEchoDrafter(target.model, noise=0.0), TreeConfig((2, 2, 1, 1, 1, 1)))
    result = engine.generate(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    assert len(result.token_ids) == max_new
    assert result.finish_reason == "length"
    assert result.token_ids == hf_greedy_ignore_eos(target, prompt, max_new)


def test_eos_stops_generation(target):
    prompt = random_prompt(10, seed=3)
    engine = SpeculativeEngine(target, TargetEchoDrafter(target.model, noise=0.0), TreeConfig((1, 1, 1)))
    free = engine.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True)).token_ids
    eos = free[5]
    target.eos_token_ids, saved = frozenset({eos}), target.eos_token_ids
    try:
        result = engine.generate(prompt, SamplingParams(max_new_tokens=12))
    finally:
        target.eos_token_ids = saved
    assert result.token_ids == free[: free.index(eos) + 1]
    assert result.finish_reason == "stop"


@pytest.mark.parametrize("min_path_prob", [0.0, 0.02, 0.06])
@pytest.mark.parametrize("branching", [(3, 2, 1), (1, 1, 1, 1), (2,)])
def test_drafter_state_after_commits_equals_prefill_from_scratch(branching, min_path_prob):
    """Commit every possible accepted depth (0 .. leaf) and compare with prefilling all tokens from scratch; drafts
    cut short by min_path_prob (before or after stepping their last depth) too."""
    from ray_specdec.speculation.acceptance import Verdict

    drafter = tiny_mamba(vocab=32)
    config = TreeConfig(branching)
    tokens = random_prompt(12, seed=4, vocab=32)
    session = DrafterSession(drafter, tokens, vocab_size=32)
    g = torch.Generator().manual_seed(0)
    for round_ in range(2 * (config.depth + 1)):
        draft = session.draft(config, SamplingParams(temperature=1.0), g, min_path_prob)
        tree = draft.tree
        assert draft.arm == config and draft.tokens.numel() == tree.num_nodes
        depth = min(round_ % (config.depth + 1), draft.config.depth)
        leaf = tree.leaf_paths[int(torch.randint(len(tree.leaf_paths), (1,), generator=g))]
        rows = leaf[1 : depth + 1]
        accepted = tuple(int(draft.tokens[r - 1]) for r in rows)
        verdict = Verdict(rows, accepted, bonus_token=int(torch.randint(32, (1,), generator=g)))
        session.commit(verdict)
        tokens += verdict.new_tokens
        fresh_state, fresh_logits = drafter.prefill(torch.tensor(tokens))
        torch.testing.assert_close(session.root_state.conv, fresh_state.conv)
        torch.testing.assert_close(session.root_state.ssm, fresh_state.ssm)
        torch.testing.assert_close(session.root_logits[0], fresh_logits)


# ---- sampling: the emitted distribution is the target's ------------------------------------------------------------

@pytest.mark.parametrize(
    "branching, draft_sampling, temperature, top_k, top_p, min_path_prob, native",
    [
        ((2, 1), "iid", 0.9, 0, 1.0, 0.0, False),
        ((3, 2), "without_replacement", 0.9, 0, 1.0, 0.0, False),
        # filtered supports of target and drafter overlap only partly here: rejections must renormalize correctly
        ((2, 2), "without_replacement", 2.0, 4, 0.9, 0.0, False),
        # drafts cut short by the drafter's own path probabilities: the cut must not bias what is kept
        ((2, 1), "iid", 2.0, 0, 1.0, 0.15, False),
        ((3, 2), "without_replacement", 2.0, 0, 1.0, 0.15, False),
        # a float32 drafter on the native C step (models/native): its q is what it sampled from
        ((3, 2), "without_replacement", 0.9, 0, 1.0, 0.0, True),
        ((2, 1), "iid", 2.0, 0, 1.0, 0.15, True),
    ],
)
def test_sampled_generation_has_target_distribution(branching, draft_sampling, temperature, top_k, top_p,
                                                    min_path_prob, native):
    target = TargetModel(tiny_gpt_neox(torch.float64, vocab=ENUMERATED_VOCAB, seed=5))
    target.eos_token_ids = frozenset()
    if native and library.load() is None:
        pytest.skip(f"native kernels unavailable: {library.why_unavailable()}")
    drafter = tiny_mamba(torch.float32 if native else torch.float64, vocab=ENUMERATED_VOCAB, seed=6)
    assert (drafter.native is not None) == native
    prompt = [1, 4, 2]
    # with a cut, 3 tokens: the first round may draft depth 2 (later rounds are cut to what is left anyway)
    n_tokens, n_samples = (3 if min_path_prob else 2), 2000
    base = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=n_tokens,
                          draft_sampling=draft_sampling)
    exact = enumerate_target(target, prompt, base, n_tokens)
    engine = SpeculativeEngine(target, drafter, TreeConfig(branching),
                               config=lookup_off(min_path_prob=min_path_prob, sampling_coupling="rejection"))
    counts = dict.fromkeys(exact, 0)
    accepted = full = 0
    for result in seeded_generations(engine, prompt, base, n_samples):
        counts[tuple(result.token_ids)] += 1
        accepted += result.stats.rounds < n_tokens
        full += str(TreeConfig(branching)) in result.stats.trees  # only a first round can draft the whole tree
    assert accepted > 0, "some generations must take several tokens in one round, or drafting was not tested"
    if min_path_prob:  # first rounds of both kinds happened: drafts cut to depth 1, and whole depth-2 drafts
        assert 0 < full < n_samples, full
    assert_emitted_distribution(counts, exact, n_samples, ENUMERATED_VOCAB)


class PeakedDrafter:
    """A test drafter whose next-token distribution is the same after any context: `probs`."""

    def __init__(self, probs: list[float]):
        self.logits = torch.tensor(probs, dtype=torch.float64).log()
        self.device, self.prefill_window = torch.device("cpu"), None
        self.steps_row_invariant = False  # its states cannot be stacked: each request drafts alone
        self.vocab_size = len(probs)

    def prefill(self, ids):
        return EchoState(1), self.logits.clone()

    def copy_rows(self, state, index):
        return EchoState(len(index))

    def step(self, state, tokens):
        return self.logits.expand(len(tokens), -1).clone()

    def extend(self, state, ids):
        return self.logits.clone()


def test_cut_drafts_keep_the_target_distribution():
    """The cut may look at drafted nodes, never at the children it would drop. Here a cut that looked at them would
    keep depth 2 only when its child is the drafter's favourite token, and the output would visibly drift."""
    target = TargetModel(tiny_gpt_neox(torch.float64, vocab=ENUMERATED_VOCAB, seed=5))
    target.eos_token_ids = frozenset()
    # path probabilities: 0.7, 0.49, or 0.042 and below
    drafter = PeakedDrafter([0.7] + [0.06] * (ENUMERATED_VOCAB - 1))
    prompt, n_tokens, n_samples = [1, 4, 2], 3, 5000
    params = SamplingParams(temperature=1.0, max_new_tokens=n_tokens, draft_sampling="iid")
    exact = enumerate_target(target, prompt, params, n_tokens)
    engine = SpeculativeEngine(target, drafter, TreeConfig((1, 1)),
                               config=lookup_off(min_path_prob=0.45, sampling_coupling="rejection"))
    counts = dict.fromkeys(exact, 0)
    kinds = set()
    for result in seeded_generations(engine, prompt, params, n_samples):
        counts[tuple(result.token_ids)] += 1
        kinds.add("1,1" in result.stats.trees)
    assert kinds == {True, False}  # whole drafts and drafts cut after depth 1 both happened
    for prefix_len in (1, 2):  # marginals of the first one and two tokens: enough counts for a sharp test
        emitted, expected = {}, {}
        for seq, p in exact.items():
            expected[seq[:prefix_len]] = expected.get(seq[:prefix_len], 0.0) + p
            emitted[seq[:prefix_len]] = emitted.get(seq[:prefix_len], 0) + counts[seq]
        keys = sorted(expected)
        assert chisquare([emitted[k] for k in keys], [expected[k] * n_samples for k in keys]).pvalue > 1e-3


def test_same_seed_same_sample():
    target = TargetModel(tiny_gpt_neox(torch.float64, vocab=32))
    engine = SpeculativeEngine(target, tiny_mamba(vocab=32), TreeConfig((2, 2, 1)))
    params = SamplingParams(temperature=1.0, seed=123, max_new_tokens=16)
    assert engine.generate([3, 4, 5], params).token_ids == engine.generate([3, 4, 5], params).token_ids


def test_empty_prompt_and_overlong_requests_are_rejected():
    target = TargetModel(tiny_gpt_neox(torch.float32, max_positions=64))
    engine = SpeculativeEngine(target, None)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], SamplingParams())
    with pytest.raises(ValueError, match="context length"):
        engine.generate(list(range(5, 60)), SamplingParams(max_new_tokens=20))


def test_empty_draft_round_is_plain_decoding():
    target = TargetModel(tiny_gpt_neox(torch.float64))
    cache = target.new_cache()
    target.prefill(cache, torch.tensor([5, 6]))
    draft = empty_draft()
    logits = target.verify(cache, 7, draft.tree, draft.tokens)
    assert logits.shape == (1, target.vocab_size)
    verdict = judge(logits, empty_draft(), SamplingParams(), None)
    assert verdict.accepted_rows == () and verdict.bonus_token == int(logits[0].argmax())


def test_greedy_with_a_lookup_branch_matches_target(target):
    """Lookup branches, merged into trees of every shape, never change greedy output; and they do get accepted
    beyond the drafter's own depth (random tiny targets repeat themselves)."""
    deeper = 0
    for prompt_len in (1, 37, 300):
        prompt = random_prompt(prompt_len, seed=prompt_len)
        n = 23
        expected = hf_greedy(target, prompt, n)
        for text in ("1+L6", "1,1,1+L2", "2,2,1+L8", "3,1+L4"):
            config = TreeConfig.parse(text)
            for min_path_prob in (0.0, 0.3):
                settings = lookup_off(min_path_prob=min_path_prob)
                result = SpeculativeEngine(target, tiny_mamba(), config, config=settings).generate(
                    prompt, SamplingParams(max_new_tokens=n)
                )
                assert result.token_ids == expected, (prompt_len, text, min_path_prob)
                deeper += sum(a - 1 > config.depth for a in result.stats.accepted_lengths)
    assert deeper > 0


@pytest.mark.parametrize("draft_sampling", ["iid", "without_replacement"])
def test_sampled_generation_with_a_lookup_branch_has_target_distribution(draft_sampling):
    """The prompt ends with a bigram seen before, so every first round carries a lookup branch (tried before the
    drafter's children at the root); the emitted tokens must still follow the target exactly."""
    target = TargetModel(tiny_gpt_neox(torch.float64, vocab=ENUMERATED_VOCAB, seed=5))
    target.eos_token_ids = frozenset()
    prompt, n_tokens, n_samples = [1, 4, 2, 3, 5, 1, 4], 3, 3000
    base = SamplingParams(temperature=1.0, max_new_tokens=n_tokens, draft_sampling=draft_sampling)
    exact = enumerate_target(target, prompt, base, n_tokens)
    engine = SpeculativeEngine(target, tiny_mamba(vocab=ENUMERATED_VOCAB, seed=6), TreeConfig((2, 1), lookup=2),
                               config=EngineConfig().with_fields(sampling_coupling="rejection"))
    counts = dict.fromkeys(exact, 0)
    lookup_rounds = multi = 0
    for result in seeded_generations(engine, prompt, base, n_samples):
        counts[tuple(result.token_ids)] += 1
        lookup_rounds += sum(n for name, n in result.stats.trees.items() if "+L" in name)
        multi += result.stats.rounds < n_tokens
    assert lookup_rounds >= n_samples and multi > 0
    for prefix_len in (1, 2):  # marginals of the first one and two tokens: enough counts for a sharp test
        emitted, expected = {}, {}
        for seq, prob in exact.items():
            expected[seq[:prefix_len]] = expected.get(seq[:prefix_len], 0.0) + prob
            emitted[seq[:prefix_len]] = emitted.get(seq[:prefix_len], 0) + counts[seq]
        keys = [k for k in sorted(expected) if expected[k] * n_samples >= 5]
        obs, exp = [emitted[k] for k in keys], [expected[k] * n_samples for k in keys]
        if n_samples - sum(exp) > 1e-9:  # pool the rare outcomes
            obs, exp = obs + [n_samples - sum(obs)], exp + [n_samples - sum(exp)]
        assert chisquare(obs, exp).pvalue > 1e-3, prefix_len


class RecordingPolicy:
    def __init__(self, tree: TreeConfig):
        self.tree, self.records = tree, []
        self.arms = (tree,)

    def throughput(self, context_len, sampled=False, draw=False, *, load=1):
        return {}

    def select(self, context_len, sampled=False, *, load=1):
        return self.tree

    def record(self, tree, context_len, accepted_tokens, round_time_s, sampled=False, what_if=None, *, load=1):
        self.records.append((str(tree), accepted_tokens, sampled))


def test_engine_lookup_setting_extends_every_drafted_tree_and_records_the_picked_one(target):
    prompt = random_prompt(300, seed=300)
    expected = hf_greedy(target, prompt, 23)
    policy = RecordingPolicy(TreeConfig((1,)))
    engine = SpeculativeEngine(target, tiny_mamba(), policy, config=lookup_off(lookup=6))
    result = engine.generate(prompt, SamplingParams(max_new_tokens=23))
    assert result.token_ids == expected
    # lookup branches were drafted, named by the size asked for (less only where fewer tokens were left to generate)
    assert set(result.stats.trees) <= {"1", "none"} | {f"1+L{k}" for k in range(1, 7)}
    assert "1+L6" in result.stats.trees
    assert {name for name, _, _ in policy.records} <= {"1", "none"}  # ...and the policy hears of the tree it picked
    assert max(accepted for _, accepted, _ in policy.records) > 1
    assert not any(sampled for _, _, sampled in policy.records)
    with pytest.raises(ValueError, match="lookup"):
        SpeculativeEngine(target, tiny_mamba(), policy, config=lookup_off(lookup=-1))


def test_bandit_with_engine_lookup_learns_from_rounds_deeper_than_its_arms(target):
    from ray_specdec.speculation.bandit import Bandit, BanditConfig

    prompt = random_prompt(300, seed=300)
    bandit = Bandit(BanditConfig(arms=(TreeConfig((1,)), TreeConfig((1, 1)))), seed=0)  # always drafting
    engine = SpeculativeEngine(target, tiny_mamba(), bandit, config=lookup_off(lookup=8))
    result = engine.generate(prompt, SamplingParams(max_new_tokens=23))
    assert result.token_ids == hf_greedy(target, prompt, 23)
    assert max(result.stats.accepted_lengths) > 3  # lookup tokens accepted beyond every arm's depth
    # every round is recorded, but the last when its tree was cut to what was left (not an arm then)
    assert result.stats.rounds - 1 <= bandit.state.steps.sum() <= result.stats.rounds


def test_a_drafter_with_a_smaller_vocabulary_drafts_for_a_larger_target():
    """Target ids the drafter cannot embed (in the prompt, as bonus tokens, in lookup branches) never break a round."""
    target = TargetModel(tiny_gpt_neox(torch.float64, vocab=160, max_positions=512))
    prompt = random_prompt(40, seed=9, vocab=160)
    assert max(prompt) >= 128
    expected = hf_greedy(target, prompt, 23)
    for config in (TreeConfig((2, 1)), TreeConfig((1, 1), lookup=6)):
        engine = SpeculativeEngine(target, tiny_mamba(vocab=128), config)
        assert engine.generate(prompt, SamplingParams(max_new_tokens=23)).token_ids == expected
    sampled = SpeculativeEngine(target, tiny_mamba(vocab=128), TreeConfig((2, 1))).generate(
        prompt, SamplingParams(temperature=1.0, seed=1, max_new_tokens=23, ignore_eos=True))
    assert len(sampled.token_ids) == 23


def test_the_lookup_setting_leaves_sampled_requests_alone(target):
    """The engine-wide lookup setting is for greedy requests; a sampled one drafts exactly as without it."""
    prompt = random_prompt(300, seed=300)
    params = SamplingParams(temperature=1.0, seed=11, max_new_tokens=20)
    with_setting = SpeculativeEngine(target, tiny_mamba(), TreeConfig((2, 1)), config=lookup_off(lookup=8)).generate(
        prompt, params)
    without = SpeculativeEngine(target, tiny_mamba(), TreeConfig((2, 1)), config=lookup_off()).generate(prompt, params)
    assert with_setting.token_ids == without.token_ids
    assert not any("+L" in name for name in with_setting.stats.trees)

