"""Training steps, distillation loss, checkpoint resume, and the Mamba training forward, on tiny models."""

from __future__ import annotations

import pytest
import torch
from transformers import GPTNeoXConfig, MambaConfig

from ray_specdec.training.mamba_train import fast_training_forward
from ray_specdec.training.models import ARCHITECTURES, build_config, build_model
from ray_specdec.training.train import (TrainSettings, batch_loss, lr_at, make_optimizer, restore_checkpoint,
                                        sample_batch, save_checkpoint)

VOCAB = 64


def tiny_neox():
    torch.manual_seed(0)
    return build_model(GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64))


def tiny_mamba():
    torch.manual_seed(0)
    return build_model(MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4, expand=2))


SETTINGS = TrainSettings(arch="tiny", name="tiny", tokenizer="", seq_len=16, batch_size=4, lr=1e-2, warmup_steps=2)


def train_steps(model, optimizer, stream, gen, steps: int, teacher=None) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = batch_loss(model, teacher, sample_batch(stream, SETTINGS, gen), alpha=0.5)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("make_model", [tiny_neox, tiny_mamba])
def test_steps_reduce_loss_on_a_repeated_batch(make_model):
    model = make_model()
    stream = torch.arange(17).repeat(4) % VOCAB                    # one window, always the same tokens
    optimizer = make_optimizer(model, SETTINGS)
    with fast_training_forward(model) if isinstance(model.config, MambaConfig) else torch.enable_grad():
        losses = train_steps(model, optimizer, stream[:18], torch.Generator().manual_seed(0), steps=8)
    assert losses[-1] < 0.7 * losses[0]


def test_distillation_from_itself_is_only_the_cross_entropy_part():
    model = tiny_neox().eval()
    batch = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ce = batch_loss(model, None, batch, alpha=0.0)
        mixed = batch_loss(model, model, batch, alpha=0.3)
    assert mixed.item() == pytest.approx(0.7 * ce.item(), abs=1e-5)


def test_resume_restores_step_optimizer_and_rng_exactly(tmp_path):
    stream = torch.randint(0, VOCAB, (500,), generator=torch.Generator().manual_seed(2))
    model, gen = tiny_neox(), torch.Generator().manual_seed(0)
    optimizer = make_optimizer(model, SETTINGS)
    train_steps(model, optimizer, stream, gen, steps=3)
    save_checkpoint(tmp_path / "ckpt.pt", model, optimizer, 3, 12.5, 192, SETTINGS, gen)
    expected = train_steps(model, optimizer, stream, gen, steps=2)

    fresh, fresh_gen = build_model(model.config), torch.Generator()
    fresh_opt = make_optimizer(fresh, SETTINGS)
    assert restore_checkpoint(tmp_path / "ckpt.pt", fresh, fresh_opt, fresh_gen) == (3, 12.5, 192)
    assert fresh_opt.state_dict()["state"][0]["step"].item() == 3
    assert train_steps(fresh, fresh_opt, stream, fresh_gen, steps=2) == expected
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_mamba_training_forward_matches_transformers():
    model = tiny_mamba().double().eval()
    ids = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        with fast_training_forward(model):
            fast = model(input_ids=ids).logits
        restored = model(input_ids=ids).logits
    # transformers computes its scan in float32, hence the tolerance.
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(restored, reference)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    s = TrainSettings(arch="a", name="a", tokenizer="", lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_at(s, step, 0.0) for step in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(s, 10, 0.5) == pytest.approx(0.55)
    assert lr_at(s, 10, 1.0) == pytest.approx(0.1)
    assert lr_at(s, 10, 3.0) == pytest.approx(0.1)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_architectures_share_the_vocab_and_reach_8k_context(arch):
    config = build_config(arch, 4096, 0)
    assert config.vocab_size == 4096 and config.eos_token_id == 0
    if arch.startswith("target"):
        assert config.max_position_embeddings >= 8192
