"""Mamba2Drafter against HF's Mamba2ForCausalLM and against itself (sequence pass vs steps, copied rows, row
invariance); through the engine (output is the target alone's); the drafter loader's choice of class.

HF's Mamba2 runs its chunked scan in float32 even for a float64 model, so comparisons with HF hold to float32 rounding;
comparisons of the float64 drafter with itself are tight.
"""

from __future__ import annotations

import pytest
import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.factory import LoadError, load_drafter
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.drafter.mamba2 import Mamba2Drafter
from ray_specdec.models.drafter.mamba_state import MambaState
from ray_specdec.models.native import library
from ray_specdec.models.target.model import TargetModel
from ray_specdec.models.target.ssm import SSMTargetModel
from tests.helpers.configs import lookup_off
from tests.helpers.models import tiny_gpt_neox, tiny_mamba2, tiny_mamba2_lm, tiny_mamba_lm, tiny_tokenizer
from tests.helpers.reference import (ENUMERATED_VOCAB, assert_emitted_distribution, enumerate_target,
                                     seeded_generations)

VOCAB = 61
PATHS = {"f64": (torch.float64, False), "f32-torch": (torch.float32, False), "f32-native": (torch.float32, True)}
HF_ATOL = 2e-5  # HF's scan is float32 (module docstring)
SELF_TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=2e-5)}


def needs_native() -> None:
    if library.load() is None:
        pytest.skip(f"native kernels unavailable: {library.why_unavailable()}")


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:  # [S, V] float64
    with torch.no_grad():
        return hf(ids[None]).logits[0].to(torch.float64)


@pytest.fixture(scope="module", params=list(PATHS))
def hf_and_drafter(request) -> tuple[torch.nn.Module, Mamba2Drafter]:
    dtype, native = PATHS[request.param]
    if native:
        needs_native()
    hf = tiny_mamba2_lm(dtype, vocab=VOCAB)
    drafter = Mamba2Drafter(hf, native=native)
    assert (drafter.native is not None) == native
    return hf, drafter


def test_prefill_steps_and_extend_give_hf_logits(hf_and_drafter):
    hf, drafter = hf_and_drafter
    ids = prompt(40)
    ref = hf_logits(hf, ids)
    state, logits = drafter.prefill(ids[:9])
    torch.testing.assert_close(logits.double(), ref[8], rtol=0, atol=HF_ATOL)
    for i in range(9, 20):
        logits = drafter.step(state, ids[i : i + 1])
        torch.testing.assert_close(logits[0].double(), ref[i], rtol=0, atol=HF_ATOL)
    logits = drafter.extend(state, ids[20:40])
    torch.testing.assert_close(logits.double(), ref[39], rtol=0, atol=HF_ATOL)


def test_a_long_prompt_prefills_to_hf_logits(hf_and_drafter):
    hf, drafter = hf_and_drafter
    ids = prompt(1500, seed=2)
    _, logits = drafter.prefill(ids)
    torch.testing.assert_close(logits.double(), hf_logits(hf, ids)[-1], rtol=0, atol=HF_ATOL)


def test_a_sequence_pass_equals_its_steps():
    drafter = tiny_mamba2(torch.float64, vocab=VOCAB)
    ids = prompt(30, seed=3)
    whole, whole_logits = drafter.prefill(ids)
    stepped, logits = drafter.prefill(ids[:1])
    for token in ids[1:]:
        logits = drafter.step(stepped, token[None])[0]
    torch.testing.assert_close(logits, whole_logits, **SELF_TOL[torch.float64])
    torch.testing.assert_close(stepped.conv, whole.conv, **SELF_TOL[torch.float64])
    torch.testing.assert_close(stepped.ssm, whole.ssm, **SELF_TOL[torch.float64])


def test_a_tree_of_copied_rows_equals_each_path_alone(hf_and_drafter):
    _, drafter = hf_and_drafter
    tol = SELF_TOL[drafter.dtype]
    context = prompt(12, seed=4).tolist()
    root, _ = drafter.prefill(context)
    # depth 1: three children of the root; depth 2: two children of row 0, one of row 2
    depth1 = drafter.copy_rows(root, [0, 0, 0])
    tokens1 = [5, 17, 33]
    logits1 = drafter.step(depth1, tokens1)
    parents2, tokens2 = [0, 0, 2], [8, 40, 2]
    depth2 = drafter.copy_rows(depth1, parents2)
    logits2 = drafter.step(depth2, tokens2)
    paths = [([t], depth1, logits1, row) for row, t in enumerate(tokens1)]
    paths += [([tokens1[p], t], depth2, logits2, row) for row, (p, t) in enumerate(zip(parents2, tokens2))]
    for path, state, logits, row in paths:
        alone, want = drafter.prefill(context)
        for token in path:
            want = drafter.step(alone, [token])[0]
        torch.testing.assert_close(logits[row], want, **tol)
        torch.testing.assert_close(state.ssm[:, row], alone.ssm[:, 0], **tol)
        torch.testing.assert_close(state.conv[:, row], alone.conv[:, 0], **tol)


def test_extend_rows_equals_each_extend(hf_and_drafter):
    """Catch-ups of several states at once (one native call) are each state's own catch-up: bit for bit on the
    native path."""
    _, drafter = hf_and_drafter
    contexts = [prompt(n, seed=n).tolist() for n in (5, 9, 14)]
    catch_ups = [[3], [7, 1, 30], list(range(60)) + list(range(20))]  # one token, a few, more than the fused call takes
    together = drafter.extend_rows([drafter.prefill(c)[0] for c in contexts], catch_ups)
    for context, ids, logits in zip(contexts, catch_ups, together):
        alone = drafter.extend(drafter.prefill(context)[0], ids)
        if drafter.native is not None:
            assert torch.equal(logits, alone)
        else:
            torch.testing.assert_close(logits, alone, **SELF_TOL[drafter.dtype])


def test_native_steps_are_row_invariant():
    """A row's logits and state are the bits it gets stepped alone, in batches small and large (400 rows: the fused
    forward splits its channels over threads there)."""
    needs_native()
    drafter = tiny_mamba2(torch.float32, vocab=VOCAB)
    assert drafter.steps_row_invariant
    assert not tiny_mamba2(torch.float32, vocab=VOCAB, native=False).steps_row_invariant
    gen = torch.Generator().manual_seed(0)
    for rows in (3, 400):
        batch = drafter.new_state(rows)
        batch.conv.copy_(torch.randn(batch.conv.shape, generator=gen))
        batch.ssm.copy_(torch.randn(batch.ssm.shape, generator=gen))
        tokens = torch.randint(0, VOCAB, (rows,), generator=gen)
        alone = [drafter.copy_rows(batch, [r]) for r in (0, rows - 1)]
        logits = drafter.step(batch, tokens)
        for r, state in zip((0, rows - 1), alone):
            assert torch.equal(drafter.step(state, tokens[r : r + 1])[0], logits[r])
            assert torch.equal(state.ssm[:, 0], batch.ssm[:, r]) and torch.equal(state.conv[:, 0], batch.conv[:, r])


def test_state_is_mambas_layout():
    drafter = tiny_mamba2(torch.float64, vocab=VOCAB)
    state = drafter.new_state(3)
    assert isinstance(state, MambaState)
    assert state.conv.shape == (2, 3, drafter.conv_dim, 4) and state.ssm.shape == (2, 3, 64, 8)


@pytest.fixture(scope="module")
def mamba2_target() -> SSMTargetModel:
    return SSMTargetModel(tiny_mamba2_lm(torch.float64))


@pytest.mark.parametrize("tree", ["1,1,1", "3,2,1"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_greedy_output_with_a_mamba2_drafter_is_the_target_alones(mamba2_target, tree, dtype):
    """The drafter carries the Mamba2 target's own weights, so it drafts what the target decides: long accepted
    paths exercise the drafter's commits (a wrong state would show as low acceptance), and the output must be the
    target alone's token for token. An attention target with a random Mamba2 drafter too."""
    if dtype == torch.float32:
        needs_native()
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    drafter = Mamba2Drafter(tiny_mamba2_lm(dtype), native=None)
    for p in ([3, 9, 27, 81, 4], prompt(37, seed=5).tolist()):
        alone = SpeculativeEngine(mamba2_target, None).generate(p, params)
        result = SpeculativeEngine(mamba2_target, drafter, TreeConfig.parse(tree), config=lookup_off()).generate(
            p, params)
        assert result.token_ids == alone.token_ids
        assert result.stats.mean_accepted_length > 3.0, result.stats.mean_accepted_length
    attention = TargetModel(tiny_gpt_neox(torch.float64, vocab=128))
    p = prompt(20, seed=6).tolist()
    alone = SpeculativeEngine(attention, None).generate(p, params)
    result = SpeculativeEngine(attention, tiny_mamba2(dtype, vocab=128, seed=1), TreeConfig.parse(tree),
                               config=lookup_off()).generate(p, params)  # fmt: skip
    assert result.token_ids == alone.token_ids


def test_sampled_output_with_a_mamba2_drafter_has_the_target_distribution():
    target = TargetModel(tiny_gpt_neox(torch.float64, vocab=ENUMERATED_VOCAB, seed=5))
    target.eos_token_ids = frozenset()
    drafter = tiny_mamba2(torch.float64, vocab=ENUMERATED_VOCAB, seed=6)
    context, n_tokens, n_samples = [1, 4, 2], 2, 2000
    base = SamplingParams(temperature=1.0, max_new_tokens=n_tokens, draft_sampling="iid")
    exact = enumerate_target(target, context, base, n_tokens)
    engine = SpeculativeEngine(target, drafter, TreeConfig((2, 1)),
                               config=lookup_off(sampling_coupling="rejection"))  # fmt: skip
    counts = dict.fromkeys(exact, 0)
    accepted = 0
    for result in seeded_generations(engine, context, base, n_samples):
        counts[tuple(result.token_ids)] += 1
        accepted += result.stats.rounds < n_tokens
    assert accepted > 0, "some generations must take several tokens in one round, or drafting was not tested"
    assert_emitted_distribution(counts, exact, n_samples, ENUMERATED_VOCAB)


def test_load_drafter_picks_the_class_from_the_config_and_refuses_others(tmp_path):
    tiny_mamba2_lm(torch.float32, vocab=VOCAB).save_pretrained(tmp_path / "mamba2")
    tiny_mamba_lm(torch.float32, vocab=VOCAB).save_pretrained(tmp_path / "mamba")
    tiny_gpt_neox(torch.float32, vocab=VOCAB).save_pretrained(tmp_path / "neox")
    for directory in ("mamba2", "mamba", "neox"):
        tiny_tokenizer().save_pretrained(tmp_path / directory)
    assert isinstance(load_drafter(str(tmp_path / "mamba2"), dtype="float64"), Mamba2Drafter)
    assert isinstance(load_drafter(str(tmp_path / "mamba"), dtype="float64"), MambaDrafter)
    with pytest.raises(LoadError) as refused:
        load_drafter(str(tmp_path / "neox"))
    message = str(refused.value)
    assert "GPTNeoXForCausalLM cannot be a drafter; supported: MambaForCausalLM, Mamba2ForCausalLM" in message
    assert "\n" not in message
