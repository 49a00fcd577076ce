"""The native tree scan and conv of an SSM target's layers (models/native/ssm_scan.py) against their definitions
(`tree_scan_ref` and `tree_conv`, in float64 from the same float32 inputs) on every instruction-set build, their batch
invariance, and the float32 target that takes them: greedy output is HF generate's."""

from __future__ import annotations

import pytest
import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.native import library, ssm_scan as native_ssm_scan
from ray_specdec.models.target.ssm import SSMTargetModel
from ray_specdec.models.target.forward_layout import Segment
from ray_specdec.models.target.ssm_scan import RowTrees, tree_conv, tree_scan_ref
from ray_specdec.speculation.tree import build_tree
from tests.helpers.configs import lookup_off
from tests.helpers.inputs import random_prompt
from tests.helpers.models import SSM_TARGETS, tiny_mamba, tiny_mamba_lm
from tests.helpers.reference import greedy_margin, hf_greedy_ignore_eos

# float32 against the float64 definition, over paths of up to 30 steps with |values| up to ~50
TOL = dict(rtol=1e-5, atol=1e-5)


pytestmark = pytest.mark.usefixtures("fresh_native_loader")


def segments_parents() -> list[torch.Tensor]:
    """A chain (a prefill chunk), a wide tree, a root alone, and a chunk followed by a tree (a prompt's last chunk and
    its first round)."""
    tree = build_tree([(0,), (1,), (2,), (0, 0), (0, 1), (2, 0), (0, 0, 0), (2, 0, 0), (2, 0, 0, 0)]).parents
    small = build_tree([(0,), (1,), (0, 0)]).parents
    chunk_then_tree = torch.cat([torch.arange(-1, 4), torch.where(small >= 0, small + 5, 4)])
    return [torch.arange(-1, 29), tree, torch.tensor([-1]), chunk_then_tree]


def random_inputs(layout: RowTrees, d_inner: int, n: int, groups: int | None, per_channel: bool, seed: int = 0):
    """float32 inputs laid out as the target's layers hand them over: x and B / C as column slices of wider rows."""
    g = torch.Generator().manual_seed(seed)
    rows, width = layout.rows, 1 if groups is None else groups

    def r(*shape):
        return torch.randn(*shape, generator=g)

    dt = torch.nn.functional.softplus(r(rows, d_inner))
    x = r(rows, d_inner + 3)[:, 2:-1]
    bc = r(rows, 5 + 2 * width * n)[:, 5:]
    B, C = bc[:, :width * n], bc[:, width * n:]
    if groups is not None:
        B, C = B.view(rows, groups, n), C.view(rows, groups, n)
    else:
        B, C = B.view(rows, n), C.view(rows, n)
    A = -torch.rand(d_inner, 1 if per_channel else n, generator=g) * 2
    start = r(layout.segments, d_inner, n)
    return dt, x, B, C, A.expand(d_inner, n).contiguous(), start


@pytest.mark.parametrize("groups, per_channel, n", [(None, False, 16), (None, False, 6), (1, True, 8),
                                                    (3, True, 16), (3, False, 5)],
                         ids=["mamba", "mamba-ragged-state", "mamba2-1-group", "mamba2-3-groups", "3-groups-full-A"])
def test_native_scan_is_the_definition(native_isa, groups, per_channel, n):
    """Every row's output and state against a sequential scan along its root-to-row path from its segment's starting
    state; only the kept rows' states come back, in the order asked."""
    layout = RowTrees.build(segments_parents(), d_conv=4)
    dt, x, B, C, A, start = random_inputs(layout, 24, n, groups, per_channel)
    keep = torch.arange(layout.rows)
    y, states = native_ssm_scan.tree_scan(dt, x, B, C, A[:, 0] if per_channel else A, start, layout, keep)
    y_ref, states_ref = tree_scan_ref(*(t.double() for t in (dt, x, B, C, A, start)), layout)
    torch.testing.assert_close(y.double(), y_ref, **TOL)
    torch.testing.assert_close(states.double(), states_ref, **TOL)
    some = torch.tensor([3, 29, 31, 40, layout.rows - 1])
    y_some, states_some = native_ssm_scan.tree_scan(dt, x, B, C, A[:, 0] if per_channel else A, start, layout, some)
    assert torch.equal(y_some, y) and torch.equal(states_some, states[some])


def test_native_scan_advances_states_in_their_slots(native_isa):
    """In place: each segment starts from its slot of a pool (`start_rows`) and one kept row's state per segment
    replaces it there, bit for bit the state the scan returns otherwise; slots no segment names stay as they were."""
    layout = RowTrees.build(segments_parents(), d_conv=4)
    dt, x, B, C, A, start = random_inputs(layout, 24, 8, 3, True, seed=5)
    ends = torch.tensor([29, 32, 40, layout.rows - 1])  # a chunk's last row, a leaf, a root alone, a tree's leaf
    _, want = native_ssm_scan.tree_scan(dt, x, B, C, A[:, 0], start, layout, ends)
    slots = torch.tensor([6, 1, 4, 3])
    pool = torch.randn(8, 3, 24, 8)  # [slots, layers, d_inner, N]: a layer's view has rows 3 states apart
    before = pool.clone()
    pool[slots, 1] = start
    y, kept = native_ssm_scan.tree_scan(dt, x, B, C, A[:, 0], pool[:, 1], layout, ends, start_rows=slots,
                                        in_place=True)  # fmt: skip
    y_ref, _ = native_ssm_scan.tree_scan(dt, x, B, C, A[:, 0], start, layout, ends)
    assert torch.equal(y, y_ref) and kept.data_ptr() == pool[:, 1].data_ptr()
    assert torch.equal(pool[slots, 1], want)
    untouched = torch.ones(8, 3, dtype=torch.bool)
    untouched[slots, 1] = False
    assert torch.equal(pool[untouched], before[untouched])
    with pytest.raises(ValueError, match="one row of a segment"):
        native_ssm_scan.tree_scan(dt, x, B, C, A[:, 0], pool[:, 1], layout, torch.tensor([0, 29]), start_rows=slots,
                                  in_place=True)  # fmt: skip


def test_a_segments_bits_do_not_depend_on_the_others_or_the_threads(native_isa):
    """Batch invariance: a segment's outputs and states are the same bits alone, among other segments, and on one
    thread or two (enough work that the kernel does split it over threads)."""
    parents = segments_parents()
    d_inner, n = 256, 16
    layout = RowTrees.build(parents, d_conv=4)
    dt, x, B, C, A, start = random_inputs(layout, d_inner, n, None, False, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y, states = native_ssm_scan.tree_scan(dt, x, B, C, A, start, layout, torch.arange(layout.rows))
        torch.set_num_threads(1)
        y1, states1 = native_ssm_scan.tree_scan(dt, x, B, C, A, start, layout, torch.arange(layout.rows))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y, y1) and torch.equal(states, states1)
    for s in range(layout.segments):
        a, b = layout.starts[s], layout.starts[s + 1]
        alone = RowTrees.build([parents[s]], d_conv=4)
        y_alone, states_alone = native_ssm_scan.tree_scan(dt[a:b], x[a:b], B[a:b], C[a:b], A, start[s:s + 1], alone,
                                                          torch.arange(b - a))  # fmt: skip
        assert torch.equal(y_alone, y[a:b]) and torch.equal(states_alone, states[a:b])


@pytest.mark.parametrize("d_conv, with_bias, silu", [(4, True, True), (2, False, False), (1, True, False)],
                         ids=["4-bias-silu", "2", "1"])
def test_native_conv_is_the_definition(native_isa, d_conv, with_bias, silu):
    """Every row's conv over its ancestors' inputs (into its segment's starting conv state) against torch's
    `tree_conv` in float64 (and its SiLU, the layer's activation), and the kept rows' conv states (their windows'
    last inputs) exactly."""
    layout = RowTrees.build(segments_parents(), d_conv=d_conv)
    g = torch.Generator().manual_seed(2)
    d = 40  # two full 16-wide vectors and a tail
    x = torch.randn(layout.rows, d + 7, generator=g)[:, 3:-4]
    history = torch.randn(layout.segments, d_conv - 1, d, generator=g)
    weight, bias = torch.randn(d, d_conv, generator=g), torch.randn(d, generator=g) if with_bias else None
    keep = torch.tensor([0, 29, 30, 33, 40, layout.rows - 1])
    kept = torch.empty(keep.numel(), d_conv - 1, d)
    out = native_ssm_scan.tree_conv(x, history, layout, weight, bias, keep, kept, silu=silu)
    expected, inputs = tree_conv(x.double(), history.double(), layout, weight.double(),
                                 None if bias is None else bias.double())  # fmt: skip
    expected = torch.nn.functional.silu(expected) if silu else expected
    torch.testing.assert_close(out.double(), expected, **TOL)
    assert torch.equal(kept.double(), inputs[layout.windows[keep, 1:]])


def test_the_kernel_refuses_what_it_cannot_scan():
    if library.load() is None:
        pytest.skip(library.why_unavailable())
    layout = RowTrees.build(segments_parents(), d_conv=4)
    dt, x, B, C, A, start = random_inputs(layout, 24, 8, None, False)
    with pytest.raises(ValueError, match="float32"):
        native_ssm_scan.tree_scan(dt.double(), x, B, C, A, start, layout, torch.arange(3))
    with pytest.raises(ValueError, match="do not agree"):
        native_ssm_scan.tree_scan(dt, x, B, C, A, start[:2], layout, torch.arange(3))


@pytest.mark.parametrize("kind", sorted(SSM_TARGETS))
def test_float32_target_takes_the_native_scan_and_greedy_is_hf_generate(kind, monkeypatch):
    """A float32 target on CPU scans natively (the torch scan where asked, or with RAY_SPECDEC_NATIVE=0, or for a
    float64 model); its greedy tokens, plain and drafting trees, are HF generate's on prompts without a near tie."""
    if library.load() is None:
        pytest.skip(library.why_unavailable())
    model = SSM_TARGETS[kind](torch.float32, seed=1)
    target = SSMTargetModel(model)
    assert target.native_scan_why is None
    assert SSMTargetModel(model, native_scan=False).native_scan_why == "native_scan=False"
    with pytest.raises(RuntimeError, match="native_scan=True but .*float32"):
        SSMTargetModel(tiny_mamba_lm(), native_scan=True)
    monkeypatch.setenv("RAY_SPECDEC_NATIVE", "0")
    assert SSMTargetModel(model).native_scan_why == "RAY_SPECDEC_NATIVE=0"
    monkeypatch.delenv("RAY_SPECDEC_NATIVE")
    # one verify through each path: the same logits to float32 rounding
    logits = []
    for each in (target, SSMTargetModel(model, native_scan=False)):
        cache = each.new_cache()
        each.prefill(cache, torch.tensor(random_prompt(9, seed=1)))
        tree = build_tree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
        logits.append(each.forward_batch([Segment(cache, torch.tensor(random_prompt(6, seed=2)), tree)])[0])
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-4)
    n, checked = 12, 0
    engines = [SpeculativeEngine(target, None, TreeConfig(()), config=lookup_off()),
               SpeculativeEngine(target, tiny_mamba(torch.float32), config=lookup_off(prefill_chunk=8))]
    for length in (3, 19, 40):
        prompt = random_prompt(length, seed=length)
        expected = hf_greedy_ignore_eos(target, prompt, n)
        if greedy_margin(model, prompt, expected) < 1e-3:
            continue  # a float32 near tie: HF's scan and this one may round it either way
        checked += 1
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        assert engines[0].generate(prompt, params).token_ids == expected
        for tree in ((1, 1, 1), (3, 2, 1)):
            assert engines[1].generate(prompt, params, TreeConfig(tree)).token_ids == expected, (tree, length)
    assert checked >= 2
