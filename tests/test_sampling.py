import pytest
import torch
from scipy.stats import chisquare

from ray_specdec.config import SamplingParams
from ray_specdec.sampling import gumbel_top_k, logits_to_probs, sample


def test_temperature_top_k_top_p_by_hand():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(p, torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([2 / 3, 1 / 3, 0, 0], dtype=torch.float64))
    # top_p=0.7: 0.5 alone is not enough, 0.5 + 0.25 is -> two tokens kept
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([2 / 3, 1 / 3, 0, 0], dtype=torch.float64))
    p = logits_to_probs(logits, SamplingParams(temperature=0.5))
    expected = torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64) ** 2
    assert torch.allclose(p, expected / expected.sum())


def test_greedy_has_no_distribution():
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(3), SamplingParams())


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(max_new_tokens=0), dict(draft_sampling="x")])
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_gumbel_top_k_is_sampling_without_replacement():
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([gumbel_top_k(probs, 2, g) for _ in range(20000)])
    assert (draws[:, 0] != draws[:, 1]).all()
    first = torch.bincount(draws[:, 0], minlength=3).double() / len(draws)
    assert torch.allclose(first, probs[0].double(), atol=0.015)
    # P(second = 2) = 0.5 * 0.2/0.5 + 0.3 * 0.2/0.7
    second_is_2 = (draws[:, 1] == 2).double().mean()
    assert abs(float(second_is_2) - (0.2 + 0.3 * 0.2 / 0.7)) < 0.015


def test_gumbel_top_k_puts_zero_probability_tokens_last():
    probs = torch.tensor([[0.0, 0.6, 0.0, 0.4]])
    draws = gumbel_top_k(probs, 3, torch.Generator().manual_seed(1))
    assert set(draws[0, :2].tolist()) == {1, 3}


def test_sample_draws_each_token_with_its_probability_and_never_one_without_mass(monkeypatch):
    """Inverse-CDF draws against the distribution (chi-square), zero-mass tokens never drawn (at both ends, between),
    a seed gives the same draws, and a draw that rounds up to the whole mass falls on the last token with mass."""
    probs = torch.tensor([0.0, 0.1, 0.0, 0.25, 0.05, 0.6, 0.0])
    draws = sample(probs.expand(20000, -1), torch.Generator().manual_seed(3))
    counts = torch.bincount(draws, minlength=probs.numel())
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    assert chisquare(counts[support].numpy(), 20000 * probs[support].numpy()).pvalue > 1e-3
    assert torch.equal(draws, sample(probs.expand(20000, -1), torch.Generator().manual_seed(3)))
    batch = sample(torch.stack([probs, probs.flip(0)])[None], torch.Generator().manual_seed(1))
    assert batch.shape == (1, 2) and probs[batch[0, 0]] > 0 and probs.flip(0)[batch[0, 1]] > 0
    # a uniform draw times the mass that rounds up to the mass itself
    monkeypatch.setattr(torch, "rand", lambda *shape, **kwargs: torch.ones(*shape, dtype=torch.float64))
    assert sample(probs, None).item() == 5  # the last token with mass, not the zero-mass one after it
