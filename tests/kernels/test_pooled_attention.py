"""Pooled tree attention kernel vs its torch reference, and the reference vs attention written out by hand.

The Triton kernel runs on CPU only under TRITON_INTERPRET=1: in a child process (tests/helpers/triton_interpreter.py).
"""

from __future__ import annotations

import sys

import pytest
import torch

from kernels.pooled_attention import META_FIELDS, pooled_attention, pooled_attention_ref
from tests.helpers.triton_interpreter import run_interpreted

# (name, heads, kv heads, head size, value size, dtype, requests as (pool offset, cached keys, new rows, kind))
CASES = [
    ("mha_fp32", 4, 4, 8, 8, torch.float32, [(0, 5, 3, "tree"), (40, 0, 4, "causal"), (20, 11, 1, "tree")]),
    ("gqa_fp64_long", 8, 2, 16, 16, torch.float64, [(3, 70, 5, "tree"), (100, 33, 2, "causal"), (150, 0, 1, "tree")]),
    ("odd_sizes_bf16", 6, 3, 12, 10, torch.bfloat16, [(0, 40, 6, "tree"), (60, 1, 3, "causal")]),
]


def build(case, seed: int) -> dict:
    name, heads, kv_heads, dim, value_dim, dtype, requests = case
    g = torch.Generator().manual_seed(seed)
    rows = sum(r[2] for r in requests) + 2  # two padding rows at the end
    width = rows + 3
    meta = torch.zeros(rows, META_FIELDS, dtype=torch.int32)
    visible = torch.zeros(rows, width, dtype=torch.int8)
    start = 0
    for offset, cached, n, kind in requests:
        for i in range(n):
            meta[start + i] = torch.tensor([offset, cached, start, n])
            if kind == "causal":
                visible[start + i, : i + 1] = 1
            else:  # a chain's first half, then the row itself: ancestors of an uneven tree
                visible[start + i, : (i + 1) // 2] = 1
                visible[start + i, i] = 1
        start += n
    pool_rows = max(o + c + n for o, c, n, _ in requests) + 4
    query = torch.randn(heads, rows, dim, generator=g).to(dtype).transpose(0, 1)  # [R, H, D], strided like the graphs'
    return {
        "query": query,
        "new_keys": torch.randn(rows, kv_heads, dim, generator=g).to(dtype),
        "new_values": torch.randn(rows, kv_heads, value_dim, generator=g).to(dtype),
        "pool_keys": torch.randn(pool_rows, kv_heads, dim, generator=g).to(dtype),
        "pool_values": torch.randn(pool_rows, kv_heads, value_dim, generator=g).to(dtype),
        "meta": meta,
        "visible": visible,
        "scale": dim**-0.5,
        "out": torch.full((rows, heads, value_dim), 7.0).to(dtype),  # padding rows must keep it
    }


def run(case: dict, fn) -> dict:
    case = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    fn(**case)
    return case


@pytest.fixture(scope="module")
def kernel_outputs(tmp_path_factory) -> list[dict]:
    inputs = [build(case, seed) for seed, case in enumerate(CASES)]
    return run_interpreted(__file__, inputs, tmp_path_factory.mktemp("pooled_attention"), timeout=600)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_kernel_matches_reference(kernel_outputs, index):
    pytest.importorskip("triton")
    want = run(build(CASES[index], index), pooled_attention_ref)
    got = kernel_outputs[index]
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[CASES[index][5]]
    torch.testing.assert_close(got["out"], want["out"], rtol=tolerance, atol=tolerance)
    assert torch.equal(got["pool_keys"], want["pool_keys"]) and torch.equal(got["pool_values"], want["pool_values"])


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_reference_is_attention_over_each_requests_rows(index):
    """Each real row: softmax over its request's cached pool rows and its visible new rows, its key head's; padding
    rows untouched; each new row's K/V in its pool row afterwards."""
    case = build(CASES[index], index)
    done = run(case, pooled_attention_ref)
    groups = case["query"].shape[1] // case["new_keys"].shape[1]
    for r, (offset, cached, start, n) in enumerate(case["meta"].tolist()):
        if n == 0:
            assert (done["out"][r] == 7.0).all()
            continue
        new = [c for c in range(n) if case["visible"][r, c]]
        for h in range(case["query"].shape[1]):
            kv = h // groups
            keys = torch.cat([case["pool_keys"][offset : offset + cached, kv], case["new_keys"][start:][new, kv]])
            values = torch.cat([case["pool_values"][offset : offset + cached, kv],
                                case["new_values"][start:][new, kv]]).double()  # fmt: skip
            weights = (keys.double() @ case["query"][r, h].double() * case["scale"]).softmax(0)
            torch.testing.assert_close(done["out"][r, h].double(), weights @ values, rtol=2e-2, atol=2e-2)
        dest = offset + cached + r - start
        assert torch.equal(done["pool_keys"][dest], case["new_keys"][r])
        assert torch.equal(done["pool_values"][dest], case["new_values"][r])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_compiled_kernel_on_cuda_matches_reference(index):
    pytest.importorskip("triton")
    case = build(CASES[index], index)
    want = run(case, pooled_attention_ref)
    got = run({k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in case.items()}, pooled_attention)
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[CASES[index][5]]
    torch.testing.assert_close(got["out"].cpu(), want["out"], rtol=tolerance, atol=tolerance)
    assert torch.equal(got["pool_keys"].cpu(), want["pool_keys"])


def test_bad_arguments_raise():
    pytest.importorskip("triton")
    case = build(CASES[0], 0)
    with pytest.raises(ValueError, match="meta must be int32"):
        pooled_attention(**{**case, "meta": case["meta"].long()})
    with pytest.raises(ValueError, match="do not group"):
        pooled_attention(**{**case, "query": case["query"][:, :3]})


if __name__ == "__main__":  # the child: run the interpreted kernel on the parent's inputs
    cases = torch.load(sys.argv[1])
    torch.save([run(case, pooled_attention) for case in cases], sys.argv[2])
