import pytest
import torch
from scipy.stats import chisquare

from ray_specdec.config import SamplingParams
from ray_specdec.speculation.sampling import gumbel_top_k, logits_to_probs, sample


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


SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=50),
            SamplingParams(temperature=1.3, top_p=0.9), SamplingParams(temperature=0.9, top_k=20, top_p=0.8)]


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plain_sampled_rounds_drawn_together_are_each_rounds_own_draw(dtype, device):
    """judge_plain_sampled over 48 rounds of four sampling settings, interleaved: every bonus token is the one
    `judge` draws for the round alone from the same stream, and every stream ends where judge leaves it (the next
    draw agrees too). Peaked and flat rows, and a row whose mass sits on one token. On CUDA the logits live on the
    device and the streams on the host, as a request's do."""
    from ray_specdec.speculation.drafting import empty_draft
    from ray_specdec.speculation.verify import judge, judge_plain_sampled, plain_sampled

    vocab, rounds = 4096, 48
    torch.manual_seed(0)
    logits = torch.randn(rounds, 1, vocab, dtype=dtype) * torch.linspace(0.5, 12.0, rounds, dtype=dtype)[:, None, None]
    logits[5, 0, 17] = 1e4
    logits = logits.to(device)
    params = [SETTINGS[i % len(SETTINGS)] for i in range(rounds)]
    assert all(plain_sampled(empty_draft(), p) for p in params)
    alone = [torch.Generator().manual_seed(100 + i) for i in range(rounds)]
    together = [torch.Generator().manual_seed(100 + i) for i in range(rounds)]
    want = [judge(logits[i], empty_draft(), params[i], alone[i]) for i in range(rounds)]
    got = judge_plain_sampled(list(logits), params, together)
    assert got == want
    assert got[5].new_tokens == (17,)
    assert [torch.rand(1, generator=g).item() for g in together] == [torch.rand(1, generator=g).item() for g in alone]


def test_only_sampled_rounds_without_draft_or_logit_processing_are_plain():
    from ray_specdec.speculation.drafting import empty_draft, lookup_draft
    from ray_specdec.speculation.verify import plain_sampled

    assert not plain_sampled(empty_draft(), SamplingParams(temperature=0.0))
    assert not plain_sampled(empty_draft(), SamplingParams(temperature=1.0, presence_penalty=0.5))
    assert not plain_sampled(lookup_draft([3, 4]), SamplingParams(temperature=1.0))
    assert plain_sampled(empty_draft(), SamplingParams(temperature=1.0, logprobs=2))  # logprobs come from the logits


@pytest.mark.parametrize("device", DEVICES)
def test_sample_rows_draws_each_row_from_its_own_stream(device):
    from ray_specdec.speculation.sampling import sample_rows

    probs = torch.softmax(torch.randn(6, 300), dim=-1).to(device)
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    again = [torch.Generator().manual_seed(i) for i in range(6)]
    assert sample_rows(probs, gens).tolist() == [int(sample(probs[i], again[i])) for i in range(6)]
