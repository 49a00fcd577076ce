"""The training forwards of training/mamba_train.py compute HF's function: logits and gradients."""

from __future__ import annotations

import pytest
import torch

from ray_specdec.training.mamba_train import fast_training_forward
from tests.helpers.models import tiny_bamba_lm, tiny_mamba2_lm


def _logits_and_grads(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits.pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build", [tiny_bamba_lm, tiny_mamba2_lm], ids=["bamba", "mamba2"])
def test_mamba2_quadratic_scan_is_hfs_chunked_scan(build):
    """Bamba's and Mamba2ForCausalLM's Mamba2 layers in the quadratic form over whole windows (two groups of heads,
    windows longer than HF's 16-token chunks): HF's logits and every parameter's gradient, to float32 rounding (HF's
    torch path takes A and the gated norm in float32 for a float64 model too); the model's cache setting comes
    back."""
    model = build(torch.float64, seed=1).train()
    ids = torch.randint(4, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    expected, expected_grads = _logits_and_grads(model, ids)
    with fast_training_forward(model):
        assert not model.config.use_cache
        logits, grads = _logits_and_grads(model, ids)
    assert model.config.use_cache
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    assert grads.keys() == expected_grads.keys() and any("mamba" in n or "mixer" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-3, atol=1e-6, msg=name)
