"""The state-copy kernel compiled for a real GPU, against its torch reference (skipped without CUDA).

test_state_copy.py runs the kernel under Triton's interpreter on CPU; this file runs the compiled kernel on the device:
fresh random inputs per case, destinations poisoned with NaN (an unwritten row fails), strided destinations, the
default drafter's shape and a large one, and one source whose layer offset passes 2**31 elements (the kernel's int64
indexing), where the device has the memory for it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kernels.state_copy import copy_state_rows, state_copy, state_copy_ref  # noqa: E402

DEVICE = torch.device("cuda")

# (n_layers, rows_src, rows_out, d_inner, d_conv, d_state, conv dtype, ssm dtype)
SHAPES = [
    (4, 1, 1, 512, 4, 16, torch.float16, torch.float32),  # the default drafter, chain
    (4, 6, 12, 512, 4, 16, torch.float16, torch.float32),  # the default drafter, a tree depth
    (24, 9, 27, 1536, 4, 16, torch.bfloat16, torch.float32),  # mamba-130m-sized, 27 rows
    (3, 5, 7, 300, 3, 7, torch.float32, torch.float32),  # ragged: rows not a multiple of any block
    (2, 2, 64, 2049, 4, 16, torch.float16, torch.float16),  # 64 rows, more than one block per row
]


def _case(shape, seed: int, dst_offset: int):
    n_layers, rows_src, rows_out, d_inner, d_conv, d_state, conv_dtype, ssm_dtype = shape
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    src_conv = torch.randn(n_layers, rows_src, d_inner, d_conv, generator=gen, device=DEVICE).to(conv_dtype)
    src_ssm = torch.randn(n_layers, rows_src, d_inner, d_state, generator=gen, device=DEVICE).to(ssm_dtype)
    index = torch.randint(0, rows_src, (rows_out,), generator=gen, device=DEVICE)
    # destinations: rows [offset, offset + rows_out) of NaN buffers with spare rows on both sides
    rows = slice(dst_offset, dst_offset + rows_out)
    conv_buf = torch.full((n_layers, rows_out + dst_offset + 2, d_inner, d_conv), float("nan"), device=DEVICE,
                          dtype=conv_dtype)
    ssm_buf = torch.full((n_layers, rows_out + dst_offset + 2, d_inner, d_state), float("nan"), device=DEVICE,
                         dtype=ssm_dtype)
    return src_conv, src_ssm, index, conv_buf, ssm_buf, rows


@pytest.mark.parametrize("dst_offset", [0, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])))
def test_compiled_kernel_matches_reference(shape, dst_offset):
    for seed in range(3):
        src_conv, src_ssm, index, conv_buf, ssm_buf, rows = _case(shape, seed, dst_offset)
        state_copy(src_conv, src_ssm, index, conv_buf[:, rows], ssm_buf[:, rows])
        want_conv, want_ssm = torch.empty_like(conv_buf[:, rows]), torch.empty_like(ssm_buf[:, rows])
        state_copy_ref(src_conv, src_ssm, index, want_conv, want_ssm)
        torch.cuda.synchronize()
        # a copy is exact: bit-identical, NaN nowhere inside the destination, and untouched outside it
        assert torch.equal(conv_buf[:, rows], want_conv)
        assert torch.equal(ssm_buf[:, rows], want_ssm)
        outside = [r for r in range(conv_buf.shape[1]) if not rows.start <= r < rows.stop]
        assert conv_buf[:, outside].isnan().all() and ssm_buf[:, outside].isnan().all()


@pytest.mark.parametrize("shape, kernel", [(SHAPES[1], False), ((64, 4, 12, 5120, 4, 16, torch.float32,
                                                                  torch.float32), True)])
def test_dispatch_takes_the_kernel_for_big_copies_on_cuda(monkeypatch, shape, kernel):
    """copy_state_rows launches the kernel for copies of KERNEL_MIN_BYTES or more, two torch gathers below that."""
    import kernels.state_copy as module

    called = []
    monkeypatch.setattr(module, "state_copy", lambda *a: called.append(True) or state_copy(*a))
    src_conv, src_ssm, index, conv_buf, ssm_buf, rows = _case(shape, 0, 0)
    copy_state_rows(src_conv, src_ssm, index, conv_buf[:, rows], ssm_buf[:, rows])
    assert called == ([True] if kernel else [])
    assert torch.equal(conv_buf[:, rows], src_conv.index_select(1, index))
    assert torch.equal(ssm_buf[:, rows], src_ssm.index_select(1, index))


def test_bad_index_is_refused_before_the_kernel_reads():
    src_conv, src_ssm, index, conv_buf, ssm_buf, rows = _case(SHAPES[1], 0, 0)
    bad = index.clone()
    bad[-1] = src_conv.shape[1]
    with pytest.raises(ValueError, match="out of range"):
        state_copy(src_conv, src_ssm, bad, conv_buf[:, rows], ssm_buf[:, rows])
    assert conv_buf.isnan().all()


def test_offsets_past_int32():
    """Source rows and layer 1 start past 2**31 elements: 32-bit offsets would wrap and read the wrong rows."""
    n_layers, rows_src, d_inner, d_conv, d_state = 2, (1 << 15) + 2, 4096, 4, 16
    need = n_layers * rows_src * d_inner * (d_state + d_conv) * 2  # bytes of the fp16 sources
    free, _ = torch.cuda.mem_get_info()
    if free < 2 * need:
        pytest.skip(f"needs {2 * need / 2**30:.0f} GiB of free device memory")
    assert (rows_src - 1) * d_inner * d_state > 2**31
    src_ssm = torch.empty(n_layers, rows_src, d_inner, d_state, dtype=torch.float16, device=DEVICE).normal_()
    src_conv = torch.empty(n_layers, rows_src, d_inner, d_conv, dtype=torch.float16, device=DEVICE).normal_()
    index = torch.tensor([rows_src - 1, 1, rows_src - 2], device=DEVICE)
    dst_conv = torch.full((n_layers, 3, d_inner, d_conv), float("nan"), dtype=torch.float16, device=DEVICE)
    dst_ssm = torch.full((n_layers, 3, d_inner, d_state), float("nan"), dtype=torch.float16, device=DEVICE)
    state_copy(src_conv, src_ssm, index, dst_conv, dst_ssm)
    assert torch.equal(dst_ssm, src_ssm.index_select(1, index))
    assert torch.equal(dst_conv, src_conv.index_select(1, index))


def test_rows_longer_than_a_grid_axis():
    """A row of more than 65535 blocks (the limit of grid axes 1 and 2) still copies whole."""
    d_inner, d_state = 1 << 17, 513  # 65.7M elements per SSM row: 65,664 blocks of 1024
    src_conv = torch.randn(1, 2, d_inner, 4, device=DEVICE)
    src_ssm = torch.empty(1, 2, d_inner, d_state, device=DEVICE).normal_()
    index = torch.tensor([1], device=DEVICE)
    dst_conv = torch.full((1, 1, d_inner, 4), float("nan"), device=DEVICE)
    dst_ssm = torch.full((1, 1, d_inner, d_state), float("nan"), device=DEVICE)
    state_copy(src_conv, src_ssm, index, dst_conv, dst_ssm)
    assert torch.equal(dst_ssm[0, 0], src_ssm[0, 1]) and torch.equal(dst_conv[0, 0], src_conv[0, 1])
