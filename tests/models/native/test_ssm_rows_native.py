"""The native row kernels of an SSM target's elementwise work (models/native/ssm_rows.py) against their definitions
(the torch path of models/target/ssm.py, in float64 from the same float32 inputs) on every instruction-set build, at
widths that leave a partial vector and over strided rows; and a row's bits alone, among other rows, on 1 or 2
threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ray_specdec.models.native import library, ssm_rows
from ray_specdec.models.target.ssm import rms_norm

pytestmark = pytest.mark.usefixtures("fresh_native_loader")

# float32 against float64: a few ulp of exp / log1p, sums of up to ~1,000 squares
TOL = dict(rtol=2e-6, atol=1e-6)


def columns(rows: int, width: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """[rows, width] float32 as a column slice of wider rows (the layers hand over slices of a projection)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width + 9, generator=g) * scale)[:, 4:-5]


def dt_ref(raw, bias, repeat, limits):
    v = raw.double() + (0 if bias is None else bias.double())
    return F.softplus(v).clamp(*limits).repeat_interleave(repeat, dim=1)


def gate_ref(y, x, D, z, norm, group, eps):
    g = (y.double() + x.double() * D.double()) * F.silu(z.double())
    if norm is None:
        return g
    g = g.unflatten(-1, (-1, group))
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return norm.double() * g.flatten(-2)


@pytest.mark.parametrize("d", [40, 7, 384])
def test_rms_norm_is_the_definition(native_isa, d):
    x, w = columns(6, d, seed=d, scale=3.0), columns(1, d, seed=1)[0]
    assert x.stride(0) == d + 9
    torch.testing.assert_close(ssm_rows.rms_norm(x, w, 1e-5).double(), rms_norm(x.double(), w.double(), 1e-5), **TOL)


@pytest.mark.parametrize("heads, repeat, limits", [(13, 5, (0.0, float("inf"))), (16, 1, (0.0, float("inf"))),
                                                   (20, 3, (0.01, 4.0))], ids=["ragged", "per-channel", "clamped"])
def test_dt_is_the_definition(native_isa, heads, repeat, limits):
    """Softplus relative to its value (within a few ulp, small results too, down to where exp leaves float32's
    normal range), over torch's threshold of 20 (above it the input itself) and across the clamp."""
    raw = columns(8, heads, seed=heads, scale=15.0)
    raw[0, :3] = torch.tensor([19.99, -60.0, -0.001])
    bias = None if repeat == 1 else columns(1, heads, seed=2)[0]
    got = ssm_rows.dt(raw, bias, repeat, limits)
    torch.testing.assert_close(got.double(), dt_ref(raw, bias, repeat, limits), rtol=1e-6, atol=1e-15)
    over = torch.tensor([[20.001, 23.5, 1e4]])
    assert torch.equal(ssm_rows.dt(over, None, 1), over)


@pytest.mark.parametrize("d, group", [(40, 0), (72, 12), (96, 48)], ids=["no-norm", "groups-of-12", "groups-of-48"])
def test_gate_is_the_definition(native_isa, d, group):
    """(y + x D) SiLU(z), then Mamba2's RMSNorm per group of channels; in place over y too."""
    y, x, z = columns(5, d, seed=3, scale=4.0).contiguous(), columns(5, d, seed=4), columns(5, d, seed=5, scale=6.0)
    D, norm = columns(1, d, seed=6)[0], (columns(1, d, seed=7)[0] if group else None)
    want = gate_ref(y, x, D, z, norm, group, 1e-6)
    torch.testing.assert_close(ssm_rows.gate(y, x, D, z, norm, group, 1e-6).double(), want, **TOL)
    out = ssm_rows.gate(y, x, D, z, norm, group, 1e-6, out=y)
    assert out.data_ptr() == y.data_ptr()
    torch.testing.assert_close(y.double(), want, **TOL)


def test_a_rows_bits_do_not_depend_on_the_others_or_the_threads(native_isa):
    """Batch invariance: every kernel gives a row the same bits alone, among other rows, and on one thread or two
    (enough rows that the kernels do split them over threads)."""
    rows, heads, head_dim = 300, 20, 50
    d = heads * head_dim  # a partial vector at the end of each row
    x, z, y = columns(rows, d, seed=8), columns(rows, d, seed=9), columns(rows, d, seed=10)
    w, D, norm = (columns(1, d, seed=s)[0] for s in (11, 12, 13))
    raw, bias = columns(rows, heads, seed=14, scale=5.0), columns(1, heads, seed=15)[0]

    def run(r):
        return (ssm_rows.rms_norm(x[r], w, 1e-5), ssm_rows.dt(raw[r], bias, head_dim, (0.001, 10.0)),
                ssm_rows.gate(y[r], x[r], D, z[r], norm, 100, 1e-5), ssm_rows.gate(y[r], x[r], D, z[r]))

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        everything = run(slice(None))
        torch.set_num_threads(1)
        one_thread = run(slice(None))
        alone, some = run(slice(7, 8)), run(slice(5, 12))
    finally:
        torch.set_num_threads(threads)
    for a, b, c, e in zip(everything, one_thread, alone, some):
        assert torch.equal(a, b) and torch.equal(a[7:8], c) and torch.equal(a[5:12], e)


def test_the_kernels_refuse_what_they_cannot_take():
    if library.load() is None:
        pytest.skip(library.why_unavailable())
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="float32"):
        ssm_rows.rms_norm(x.double(), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match=r"weight must be float32 \[8\]"):
        ssm_rows.rms_norm(x, torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="groups of 3"):
        ssm_rows.gate(x, x, torch.ones(8), x, torch.ones(8), 3, 1e-5)
