"""Half-precision panels of the native GEMM (native/gemm_cpu.c): for a weight that float16 / bfloat16 hold exactly,
products are the float32 panels' bit for bit, on every instruction-set path this CPU runs (the scalar widening
included); a weight they do not hold stays float32."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from ray_specdec.models.native import gemm, library


from ray_specdec.models.drafter.mamba import MambaDrafter
from tests.helpers.native_mamba import CONFIGS, VOCAB, mamba

pytestmark = pytest.mark.skipif(library.load() is None,
                                reason=f"native kernels unavailable: {library.why_unavailable()}")
HALF = [torch.float16, torch.bfloat16]
SHAPES = [(150, 70), (93, 37), (16, 5), (7, 3)]  # 64- and 16-wide blocks, ragged tails, a tail-only product


def half_exact(n_out, n_in, dtype, seed=0):
    """A float32 weight whose values `dtype` holds exactly, with a subnormal, a zero, a negative zero and a large
    value."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n_out, n_in, generator=g) * 3).to(dtype)
    flat = w.view(-1)
    flat[:4] = torch.tensor([1e-7 if dtype == torch.float16 else 1e-39, 0.0, -0.0, 6e4], dtype=torch.float32).to(dtype)
    return w.float()


def products(lib, rows, weight, bias, panel_dtypes, seed=1):
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(seed))
    outs = []
    for dtype in panel_dtypes:
        panels = gemm.pack_panels(weight, dtype)
        y = torch.full((rows, weight.shape[0]), float("nan"))
        lib.linear_panels(gemm.PANEL_FORMATS[dtype], rows, weight.shape[0], weight.shape[1], panels.data_ptr(),
                          None if bias is None else bias.data_ptr(), x.data_ptr(), y.data_ptr())  # fmt: skip
        outs.append(y)
    return x, outs


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n_out, n_in", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_half_panels_give_the_float32_panels_product_bit_for_bit(dtype, n_out, n_in, bias):
    lib = library.load()
    weight = half_exact(n_out, n_in, dtype)
    b = torch.randn(n_out) if bias else None
    # row groups of 4 or 6, ragged; from WIDEN_MIN_ROWS (24) on, half panels widened once per pass
    for rows in (1, 2, 5, 6, 7, 13, 23, 24, 64, 131):
        x, (full, half) = products(lib, rows, weight, b, [torch.float32, dtype])
        assert torch.equal(full, half), (rows, (full - half).abs().max())
        want = F.linear(x.double(), weight.double(), None if b is None else b.double())
        torch.testing.assert_close(half.double(), want, rtol=1e-5, atol=1e-4)


def test_exact_panel_dtype_and_packing():
    fp16, bf16 = half_exact(20, 8, torch.float16), half_exact(20, 8, torch.bfloat16)
    fast = bool(library.load().half_panels_fast())
    assert gemm.exact_panel_dtype(fp16) == (torch.float16 if fast else torch.float32)
    bf16[0, 0] = 2.0**100  # beyond float16's range: only bfloat16 holds it
    assert gemm.exact_panel_dtype(bf16) == (torch.bfloat16 if fast else torch.float32)
    full = torch.randn(20, 8)  # float32 values neither half format holds
    assert gemm.exact_panel_dtype(full) == torch.float32
    assert gemm.exact_panel_dtype(full.double()) == torch.float32
    with pytest.raises(ValueError, match="does not hold exactly"):
        gemm.pack_panels(full, torch.float16)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        gemm.pack_panels(fp16, torch.int16)
    assert gemm.pack_panels(fp16, torch.float16).dtype == torch.float16


@pytest.mark.skipif(not library.load().half_panels_fast(), reason="this build widens half values slowly")
def test_the_native_path_packs_exact_weights_in_half_and_computes_the_same():
    weight, bias = half_exact(93, 37, torch.float16), torch.randn(93)
    x = torch.randn(5, 37)
    out = gemm.PATHS[gemm.NATIVE](x, weight, bias)
    assert weight._ray_specdec_panels[1].dtype == torch.float16
    assert torch.equal(out, gemm.linear(x, gemm.pack_panels(weight), bias, 93))
    with torch.no_grad():
        weight[0, 0] = 0.1  # not a float16 value: packed again, in float32
    gemm.PATHS[gemm.NATIVE](x, weight, bias)
    assert weight._ray_specdec_panels[1].dtype == torch.float32


def test_every_instruction_set_path_computes_the_same(native_isa):
    """The widening on each path this CPU runs (AVX-512; F16C and AVX2; scalar code on a plain x86-64) gives the
    float32 panels' product bit for bit, and that product is the CPU's own build's to rounding."""
    lib = library.load()
    assert lib.half_panels_fast() == (native_isa != "scalar")
    native_lib = library.load("native")
    for dtype in HALF:
        for n_out, n_in in SHAPES:
            weight = half_exact(n_out, n_in, dtype, seed=n_out)
            for rows in (1, 4, 9, 30):
                _, (full, half) = products(lib, rows, weight, None, [torch.float32, dtype])
                assert torch.equal(full, half)
                _, (reference,) = products(native_lib, rows, weight, None, [torch.float32])
                torch.testing.assert_close(full, reference, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not library.load().half_panels_fast(), reason="this build widens half values slowly")
@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_native_drafter_on_half_panels_is_its_float32_panels_step_bit_for_bit(config, monkeypatch):
    """A drafter whose weights float16 holds (as a half-precision checkpoint's): steps and catch-ups on half panels
    give the logits and states of the same kernels on float32 panels, bit for bit."""
    model = mamba(config).half().float()
    half = MambaDrafter(model, native=True)
    assert half.native.panel_formats == ["float16"]
    monkeypatch.setattr(gemm, "exact_panel_dtype", lambda weight: torch.float32)
    full = MambaDrafter(model, native=True)
    assert full.native.panel_formats == ["float32"]
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(0))
    (states, logits) = zip(*(d.prefill(prompt) for d in (half, full)))
    assert torch.equal(logits[0], logits[1])
    for tokens in ([[5, 9, 2, 4]], [[3]], [[7]]):  # a catch-up of 4 tokens, then steps of one row
        out = [d.native.forward(s.conv, s.ssm, torch.tensor(tokens)) for d, s in zip((half, full), states)]
        assert torch.equal(out[0], out[1])
    rows = [(s.conv.repeat(1, 3, 1, 1), s.ssm.repeat(1, 3, 1, 1)) for s in states]  # a step of three tree rows
    out = [d.native.forward(conv, ssm, torch.tensor([[3], [7], [11]])) for d, (conv, ssm) in zip((half, full), rows)]
    assert torch.equal(out[0], out[1])
    for (conv_a, ssm_a), (conv_b, ssm_b) in [(rows[0], rows[1]), ((states[0].conv, states[0].ssm),
                                                                 (states[1].conv, states[1].ssm))]:
        assert torch.equal(conv_a, conv_b) and torch.equal(ssm_a, ssm_b)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_every_row_gets_its_bits_alone_whatever_the_rows_beside_it(dtype):
    """Batch invariance of the native GEMM: a row's product does not depend on how many rows share the call, or
    where in it the row sits. Rows go through register blocks of every height (up to 6 rows, the rest ragged; products
    of one or two rows in wider passes), and every block sums each output over the inputs in the same order from the
    bias."""
    lib = library.load()
    weight = half_exact(200, 70, dtype) if dtype != torch.float32 else torch.randn(200, 70)  # 3 x 64, 1 x 16, tail
    bias = torch.randn(200)
    x = torch.randn(40, 70, generator=torch.Generator().manual_seed(3))
    together = products_of(lib, x, weight, bias, dtype)
    for rows in [*range(1, 26), 31, 36]:
        assert torch.equal(products_of(lib, x[:rows], weight, bias, dtype), together[:rows]), rows
        assert torch.equal(products_of(lib, x[-rows:], weight, bias, dtype), together[-rows:]), rows
    alone = torch.cat([products_of(lib, x[r : r + 1], weight, bias, dtype) for r in range(40)])
    assert torch.equal(alone, together)
    torch.testing.assert_close(together.double(), F.linear(x.double(), weight.double(), bias.double()),
                               rtol=1e-5, atol=1e-4)  # fmt: skip


def products_of(lib, x, weight, bias, dtype):
    panels = gemm.pack_panels(weight, dtype)
    y = torch.full((x.shape[0], weight.shape[0]), float("nan"))
    lib.linear_panels(gemm.PANEL_FORMATS[dtype], x.shape[0], weight.shape[0], weight.shape[1], panels.data_ptr(),
                      bias.data_ptr(), x.contiguous().data_ptr(), y.data_ptr())  # fmt: skip
    return y
