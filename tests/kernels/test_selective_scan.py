"""Selective-scan kernel vs a float64 token-by-token reference.

On CPU the kernel runs under TRITON_INTERPRET=1 in a child process (this file as a script), as in test_state_copy.py:
the parent builds the inputs, the child scans them, the parent compares. On a GPU the kernel also runs directly.
"""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("triton")

from kernels.selective_scan import selective_scan, selective_scan_ref  # noqa: E402
from tests.helpers.triton_interpreter import run_interpreted  # noqa: E402


# (name, tokens, d_inner, d_state, dt_rank): ragged channel blocks, a d_state below its power of two, no tokens
CASES = [
    ("one_token", 1, 8, 16, 2),
    ("ragged", 37, 5, 6, 3),
    ("several_programs", 23, 300, 16, 4),
    ("wide_state", 9, 24, 40, 2),
    ("no_tokens", 0, 8, 4, 2),
]


def _make_case(case, seed: int, device: str = "cpu") -> dict:
    """B and C are column slices of one x_proj output, as in the drafter (strided rows); the state starts non-zero."""
    _, tokens, d_inner, d_state, dt_rank = case
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(tokens, dt_rank + 2 * d_state, generator=g)
    return {
        "dt": torch.nn.functional.softplus(torch.randn(tokens, d_inner, generator=g)).to(device),
        "x": torch.randn(tokens, d_inner, generator=g).to(device),
        "proj": proj.to(device),
        "A": -torch.rand(d_inner, d_state, generator=g).add(0.1).mul(3).to(device),
        "state": torch.randn(d_inner, d_state, generator=g).to(device),
        "dt_rank": dt_rank,
        "d_state": d_state,
    }


def _split(case: dict):
    _, B, C = case["proj"].split([case["dt_rank"], case["d_state"], case["d_state"]], dim=-1)
    return B, C


def _scan(case: dict) -> dict:
    B, C = _split(case)
    state = case["state"].clone()
    y = selective_scan(case["dt"], case["x"], B, C, case["A"], state)
    return {"y": y.cpu(), "state": state.cpu()}


def _reference(case: dict) -> dict:
    B, C = _split(case)
    state = case["state"].double().cpu()
    y = selective_scan_ref(case["dt"].double().cpu(), case["x"].double().cpu(), B.double().cpu(), C.double().cpu(),
                           case["A"].double().cpu(), state)  # fmt: skip
    return {"y": y, "state": state}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> list[dict]:
    inputs = [_make_case(case, seed) for seed, case in enumerate(CASES)]
    return run_interpreted(__file__, inputs, tmp_path_factory.mktemp("selective_scan"))


def _check(got: dict, want: dict, tokens: int, d_inner: int) -> None:
    assert got["y"].shape == (tokens, d_inner) and got["y"].dtype == torch.float32
    torch.testing.assert_close(got["y"].double(), want["y"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["state"].double(), want["state"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case_id", range(len(CASES)), ids=[c[0] for c in CASES])
def test_interpreted_kernel_matches_reference(interpreted, case_id):
    case = CASES[case_id]
    _check(interpreted[case_id], _reference(_make_case(case, case_id)), case[1], case[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case_id", range(len(CASES)), ids=[c[0] for c in CASES])
def test_cuda_kernel_matches_reference(case_id):
    case = CASES[case_id]
    inputs = _make_case(case, case_id, "cuda")
    _check(_scan(inputs), _reference(inputs), case[1], case[2])


def test_reference_continues_a_scan():
    """Two halves with the state carried between them give the whole scan (what prefill then extend relies on)."""
    case = _make_case(CASES[1], 0)
    B, C = _split(case)
    whole_state, split_state = case["state"].double(), case["state"].double()
    args = [t.double() for t in (case["dt"], case["x"], B, C)]
    whole = selective_scan_ref(*args, case["A"].double(), whole_state)
    first = selective_scan_ref(*(t[:20] for t in args), case["A"].double(), split_state)
    second = selective_scan_ref(*(t[20:] for t in args), case["A"].double(), split_state)
    torch.testing.assert_close(torch.cat([first, second]), whole)
    torch.testing.assert_close(split_state, whole_state)


@pytest.mark.parametrize("bad, message", [
    (dict(dt=torch.zeros(4, 8)), "dt has shape"),
    (dict(A=torch.zeros(8, 5)), "B has shape"),
    (dict(x=torch.zeros(3, 8, dtype=torch.float64)), "float32"),
    (dict(state=torch.zeros(16, 8).t()), "contiguous"),
])  # fmt: skip
def test_bad_arguments_raise(bad, message):
    args = dict(dt=torch.zeros(3, 8), x=torch.zeros(3, 8), B=torch.zeros(3, 4), C=torch.zeros(3, 4),
                A=torch.zeros(8, 4), state=torch.zeros(8, 4)) | bad  # fmt: skip
    if "state" in bad:
        args["A"] = torch.zeros(8, 16)
        args["B"] = args["C"] = torch.zeros(3, 16)
    with pytest.raises(ValueError, match=message):
        selective_scan(**args)


if __name__ == "__main__":  # child: TRITON_INTERPRET=1 is set, so the kernel runs on CPU tensors
    cases = torch.load(sys.argv[1])
    torch.save([_scan(case) for case in cases], sys.argv[2])
