"""The fused Mamba2 drafter forward (native/mamba2_cpu.c) against the float64 torch path of Mamba2Drafter, on every
instruction-set build this CPU runs, on shapes that cross the C GEMM's block boundaries (in_proj's 218 outputs: 64-
and 16-wide blocks and a ragged tail), with biases, two groups of heads and a clamped dt."""

from __future__ import annotations

import pytest
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM

from ray_specdec.models.drafter.mamba2 import Mamba2Drafter
from ray_specdec.models.native import library

VOCAB = 50
TOL = dict(rtol=1e-4, atol=5e-5)

pytestmark = pytest.mark.usefixtures("fresh_native_loader")


def mamba2() -> Mamba2ForCausalLM:
    config = Mamba2Config(vocab_size=VOCAB, hidden_size=40, num_hidden_layers=2, num_heads=10, head_dim=8, n_groups=2,
                          state_size=12, expand=2, conv_kernel=3, use_bias=True, time_step_limit=(0.0, 0.5),
                          tie_word_embeddings=False, initializer_range=0.1)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Mamba2ForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_steps_and_catch_ups_match_the_float64_torch_path(native_isa, rows):
    model = mamba2()
    fast = Mamba2Drafter(model.float(), native=True)
    exact = Mamba2Drafter(model.double(), native=False)
    assert fast.native is not None and exact.native is None
    gen = torch.Generator().manual_seed(rows)
    prompt = torch.randint(0, VOCAB, (11,), generator=gen)
    f_state, e_state = (d.copy_rows(d.prefill(prompt)[0], [0] * rows) for d in (fast, exact))
    for _ in range(3):
        tokens = torch.randint(0, VOCAB, (rows,), generator=gen)
        torch.testing.assert_close(fast.step(f_state, tokens).double(), exact.step(e_state, tokens), **TOL)
    torch.testing.assert_close(f_state.ssm.double(), e_state.ssm, **TOL)
    torch.testing.assert_close(f_state.conv.double(), e_state.conv, **TOL)
    catch_up = torch.randint(0, VOCAB, (5,), generator=gen)
    f_row, e_row = fast.copy_rows(f_state, [rows - 1]), exact.copy_rows(e_state, [rows - 1])
    torch.testing.assert_close(fast.extend(f_row, catch_up).double(), exact.extend(e_row, catch_up), **TOL)
    torch.testing.assert_close(f_row.ssm.double(), e_row.ssm, **TOL)


def test_off_for_other_dtypes_and_insisted_on_with_a_reason():
    if library.load() is None:
        pytest.skip(library.why_unavailable())
    model = mamba2()
    assert Mamba2Drafter(model.float()).native is not None
    f64 = Mamba2Drafter(model.double())
    assert f64.native is None and "float32" in f64.native_why and not f64.steps_row_invariant
    with pytest.raises(RuntimeError, match="native=True but .*float32"):
        Mamba2Drafter(model.double(), native=True)
