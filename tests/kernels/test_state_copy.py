"""State-copy kernel vs its torch reference.

The Triton kernel runs on CPU only under TRITON_INTERPRET=1, which triton reads when a kernel is defined; another test
file may already have imported kernels.state_copy without it. So the kernel runs in a child process (this file run as
a script with TRITON_INTERPRET=1): the parent builds the inputs, the child runs the kernel on them, and the parent
compares the child's outputs with the reference. Destinations start as NaN, so any row the kernel misses fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from kernels.state_copy import copy_state_rows, state_copy, state_copy_ref  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]

# (name, n_layers, rows_src, index, d_inner, d_conv, d_state, conv dtype, ssm dtype, dst row offset in a bigger buffer)
CASES = [
    ("fp32_permute", 2, 3, [2, 0, 1], 8, 4, 16, torch.float32, torch.float32, 0),
    ("fp16_repeat_grow", 3, 2, [1, 1, 0, 1, 0, 0, 1], 5, 3, 6, torch.float16, torch.float16, 0),
    ("bf16_multi_block", 2, 4, [3, 3, 1, 0, 2, 3], 300, 4, 16, torch.bfloat16, torch.bfloat16, 0),
    ("mixed_conv_longer", 2, 3, [0, 2], 7, 4, 2, torch.bfloat16, torch.float32, 0),
    ("fp32_single_row", 1, 5, [4], 12, 4, 8, torch.float32, torch.float32, 0),
    ("fp16_dst_slice", 2, 3, [2, 2, 0, 1], 6, 4, 5, torch.float16, torch.float16, 3),
]


def _make_case(case, seed: int) -> dict:
    name, n_layers, rows_src, index, d_inner, d_conv, d_state, conv_dtype, ssm_dtype, offset = case
    gen = torch.Generator().manual_seed(seed)
    rows_out = len(index)
    # dst is rows [offset, offset + rows_out) of a NaN-filled buffer with 2 spare rows after it: strided rows.
    conv_buf = torch.full((n_layers, offset + rows_out + 2, d_inner, d_conv), float("nan"), dtype=conv_dtype)
    ssm_buf = torch.full((n_layers, offset + rows_out + 2, d_inner, d_state), float("nan"), dtype=ssm_dtype)
    return {
        "src_conv": torch.randn(n_layers, rows_src, d_inner, d_conv, generator=gen).to(conv_dtype),
        "src_ssm": torch.randn(n_layers, rows_src, d_inner, d_state, generator=gen).to(ssm_dtype),
        "index": torch.tensor(index, dtype=torch.long),
        "conv_buf": conv_buf,
        "ssm_buf": ssm_buf,
        "offset": offset,
        "rows_out": rows_out,
    }


def _dst(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    rows = slice(case["offset"], case["offset"] + case["rows_out"])
    return case["conv_buf"][:, rows], case["ssm_buf"][:, rows]


def _run_kernel_on_cases(cases: list[dict]) -> None:
    for case in cases:
        state_copy(case["src_conv"], case["src_ssm"], case["index"], *_dst(case))


@pytest.fixture(scope="module")
def kernel_outputs(tmp_path_factory) -> list[dict]:
    """All cases through the interpreted kernel in one child process (one triton import, not one per case)."""
    tmp = tmp_path_factory.mktemp("state_copy")
    cases = [_make_case(case, seed) for seed, case in enumerate(CASES)]
    torch.save(cases, tmp / "in.pt")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp / "in.pt"), str(tmp / "out.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(tmp / "out.pt")


@pytest.mark.parametrize("case_id", range(len(CASES)), ids=[c[0] for c in CASES])
def test_kernel_matches_reference(kernel_outputs, case_id):
    inputs = _make_case(CASES[case_id], case_id)  # same seed: the exact inputs the child saw
    out = kernel_outputs[case_id]
    got_conv, got_ssm = _dst(out)
    want_conv, want_ssm = (torch.empty_like(t) for t in _dst(inputs))
    state_copy_ref(inputs["src_conv"], inputs["src_ssm"], inputs["index"], want_conv, want_ssm)

    assert not got_conv.isnan().any() and not got_ssm.isnan().any(), "some output row was not written"
    assert torch.equal(got_conv, want_conv)
    assert torch.equal(got_ssm, want_ssm)
    # The rows of the buffer outside dst are untouched.
    rows = slice(out["offset"], out["offset"] + out["rows_out"])
    for buf in (out["conv_buf"], out["ssm_buf"]):
        outside = torch.cat([buf[:, : rows.start], buf[:, rows.stop :]], dim=1)
        assert outside.isnan().all()


def test_reference_gathers_rows():
    src_conv = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).reshape(2, 3, 2, 2)
    src_ssm = -torch.arange(2 * 3 * 2 * 3, dtype=torch.float32).reshape(2, 3, 2, 3)
    index = torch.tensor([2, 2, 0])
    dst_conv, dst_ssm = torch.empty(2, 3, 2, 2), torch.empty(2, 3, 2, 3)
    copy_state_rows(src_conv, src_ssm, index, dst_conv, dst_ssm)  # CPU without interpreter: the reference
    for layer in range(2):
        for i, j in enumerate([2, 2, 0]):
            assert torch.equal(dst_conv[layer, i], src_conv[layer, j])
            assert torch.equal(dst_ssm[layer, i], src_ssm[layer, j])


def test_reference_gathers_from_a_slot_major_pool_layer_by_layer():
    """A source whose layers are not one block (a slot pool viewed as [L, slots, ...]) into a contiguous destination
    and into a strided one: the same rows as from a contiguous copy of it."""
    pool_conv = torch.randn(5, 3, 4, 2)  # [slots, L, d_inner, d_conv]
    pool_ssm = torch.randn(5, 3, 4, 6)
    src_conv, src_ssm = pool_conv.transpose(0, 1), pool_ssm.transpose(0, 1)  # [L, slots, ...] views
    assert not src_conv.is_contiguous()
    index = torch.tensor([4, 4, 0, 2])
    want_conv, want_ssm = src_conv.contiguous().index_select(1, index), src_ssm.contiguous().index_select(1, index)
    dst_conv, dst_ssm = torch.empty(3, 4, 4, 2), torch.empty(3, 4, 4, 6)
    state_copy_ref(src_conv, src_ssm, index, dst_conv, dst_ssm)
    assert torch.equal(dst_conv, want_conv) and torch.equal(dst_ssm, want_ssm)
    wide_conv, wide_ssm = torch.zeros(3, 6, 4, 2), torch.zeros(3, 6, 4, 6)  # rows 1..4 of wider buffers: strided
    state_copy_ref(src_conv, src_ssm, index, wide_conv[:, 1:5], wide_ssm[:, 1:5])
    assert torch.equal(wide_conv[:, 1:5], want_conv) and torch.equal(wide_ssm[:, 1:5], want_ssm)
    assert not wide_conv[:, 0].any() and not wide_ssm[:, 5].any()


def _valid_args() -> dict:
    return {
        "src_conv": torch.zeros(2, 3, 4, 4),
        "src_ssm": torch.zeros(2, 3, 4, 8),
        "index": torch.tensor([0, 2]),
        "dst_conv": torch.zeros(2, 2, 4, 4),
        "dst_ssm": torch.zeros(2, 2, 4, 8),
    }


BAD_ARGS = {
    "index_too_big": ("index", torch.tensor([0, 3]), "out of range"),
    "index_negative": ("index", torch.tensor([-1, 0]), "out of range"),
    "index_int32": ("index", torch.tensor([0, 1], dtype=torch.int32), "torch.long"),
    "dst_rows_mismatch": ("dst_conv", torch.zeros(2, 3, 4, 4), "dst_conv has shape"),
    "ssm_layers_mismatch": ("src_ssm", torch.zeros(1, 3, 4, 8), "src_ssm has shape"),
    "d_inner_mismatch": ("dst_ssm", torch.zeros(2, 2, 5, 8), "dst_ssm has shape"),
    "dtype_mismatch": ("dst_ssm", torch.zeros(2, 2, 4, 8, dtype=torch.float16), "dtypes"),
    "not_4d": ("src_conv", torch.zeros(3, 4, 4), "4-D"),
}


@pytest.mark.parametrize("launch", [state_copy, copy_state_rows], ids=["launcher", "dispatch"])
@pytest.mark.parametrize("bad", BAD_ARGS.values(), ids=BAD_ARGS.keys())
def test_bad_arguments_raise(launch, bad):
    name, value, message = bad
    args = _valid_args() | {name: value}
    with pytest.raises(ValueError, match=message):
        launch(**args)


def test_launcher_rejects_noncontiguous_rows_and_overlap():
    args = _valid_args()
    with pytest.raises(ValueError, match="contiguous"):
        state_copy(**args | {"dst_ssm": torch.zeros(2, 2, 8, 4).transpose(2, 3)})
    ssm_pool = torch.zeros(2, 5, 4, 8)
    with pytest.raises(ValueError, match="overlap"):
        state_copy(**args | {"src_ssm": ssm_pool[:, :3], "dst_ssm": ssm_pool[:, 2:4]})


if __name__ == "__main__":  # child process: python test_state_copy.py in.pt out.pt (with TRITON_INTERPRET=1)
    assert os.environ.get("TRITON_INTERPRET") == "1"
    child_cases = torch.load(sys.argv[1])
    _run_kernel_on_cases(child_cases)
    torch.save(child_cases, sys.argv[2])
