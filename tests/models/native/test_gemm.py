"""Planned GEMM paths: every path computes F.linear's product, the plan picks by measured time, install is invisible
to the model's parameters and (up to float32 rounding) to its outputs, and greedy speculation stays exact on it."""

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ray_specdec.models.native import gemm, library
from ray_specdec.models.native.gemm import LINEAR, GemmPlan, PlannedLinear
from ray_specdec.models.target.model import TargetModel
from tests.helpers.models import tiny_gpt_neox, tiny_llama
from tests.helpers.reference import assert_greedy_speculation_is_the_target_alone


@pytest.mark.parametrize("path", gemm.available_paths())
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n_out, n_in", [(48, 40), (93, 37), (150, 70)])  # native: 16-blocks, a ragged tail, threads
@pytest.mark.parametrize("threads", [1, 2])  # native: products of >= 2^19 multiply-adds split over threads
def test_every_path_computes_the_linear_product(path, bias, n_out, n_in, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # what the native path reads; torch's own pool
    torch.manual_seed(0)                                            # stays as conftest set it
    weight, b = torch.randn(n_out, n_in), torch.randn(n_out) if bias else None
    for rows in (1, 2, 3, 7, 16, 17, 65):
        x = torch.randn(rows, n_in)
        out = gemm.PATHS[path](x, weight, b)
        want = F.linear(x.double(), weight.double(), None if b is None else b.double())
        assert out.shape == (rows, n_out) and out.dtype == torch.float32 and out.is_contiguous()
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif("native" not in gemm.available_paths(), reason="native kernels unavailable")
def test_native_product_is_the_same_bits_however_its_blocks_are_claimed(monkeypatch):
    """Two threads claim the native GEMM's output blocks one at a time (which thread gets which changes from call to
    call); every block is computed whole by one thread in one order, so the product is bit for bit the one thread's."""
    torch.manual_seed(1)
    weight, bias = torch.randn(1040, 96), torch.randn(1040)  # 16 blocks of 64 and one of 16
    x = torch.randn(48, 96)  # ~4.8M multiply-adds: split over the threads
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    alone = gemm.PATHS["native"](x, weight, bias)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    for _ in range(20):
        assert torch.equal(gemm.PATHS["native"](x, weight, bias), alone)


@pytest.mark.skipif("native" not in gemm.available_paths(), reason="native kernels unavailable")
def test_native_path_follows_in_place_weight_changes_and_autograd():
    """The packed copy of the weight is packed again after an in-place change (a load_state_dict, say); with
    autograd on, the product is F.linear's, so gradients flow."""
    linear = torch.nn.Linear(37, 93)
    x = torch.randn(3, 37)
    with torch.no_grad():
        first = gemm.PATHS["native"](x, linear.weight, linear.bias)
        torch.testing.assert_close(first, F.linear(x, linear.weight, linear.bias))
        linear.weight.mul_(2.0)
        torch.testing.assert_close(gemm.PATHS["native"](x, linear.weight, linear.bias),
                                   F.linear(x, linear.weight, linear.bias))
    out = gemm.PATHS["native"](x, linear.weight, linear.bias)
    out.sum().backward()
    assert linear.weight.grad is not None and linear.weight.grad.abs().sum() > 0


def test_plan_lookup_and_description():
    plan = GemmPlan((1, 2, 4, 8), ("weight_left", "weight_left", "onednn", LINEAR))
    assert [plan.path_for(m) for m in (1, 2, 3, 4, 5, 8, 9, 500)] == [
        "weight_left", "weight_left", "onednn", "onednn", LINEAR, LINEAR, LINEAR, LINEAR]
    assert plan.describe() == "rows 1-2: weight_left, 3-4: onednn, 5-8: linear, more: linear"
    # more rows than were calibrated take the largest calibrated count's path (measured per CPU, as every other)
    plan = GemmPlan((1, 64, 512), (LINEAR, "native", "onednn"))
    assert [plan.path_for(m) for m in (1, 2, 64, 65, 512, 513, 4096)] == [
        LINEAR, "native", "native", "onednn", "onednn", "onednn", "onednn"]
    assert plan.describe() == "rows 1: linear, 2-64: native, 65-512: onednn, more: onednn"


def test_choose_keeps_linear_unless_another_path_is_clearly_faster():
    timings = {
        (LINEAR, 1): 1.0, ("a", 1): 0.95, ("b", 1): 0.97,  # within the margin: stay with F.linear
        (LINEAR, 2): 1.0, ("a", 2): 0.5, ("b", 2): 0.6,  # the fastest of those that pass
        (LINEAR, 3): 1.0, ("a", 3): 1.5, ("b", 3): 0.85,
    }
    assert gemm.choose(timings, (1, 2, 3)).paths == (LINEAR, "a", "b")


def test_calibrate_finds_the_fast_path_by_timing():
    def slow(x, w, b):
        time.sleep(0.002)
        return F.linear(x, w, b)

    weights = [(torch.randn(16, 8), None), (torch.randn(8, 16), torch.randn(8))]
    rows = (1, 3, 8)
    assert gemm.calibrate(weights, rows, repeats=1, paths={LINEAR: slow, "fast": F.linear}).paths == ("fast",) * 3
    assert gemm.calibrate(weights, rows, repeats=1, paths={LINEAR: F.linear, "slow": slow}).paths == (LINEAR,) * 3
    with pytest.raises(ValueError, match="must include 'linear'"):
        gemm.calibrate(weights, rows, paths={"fast": F.linear})


@pytest.mark.parametrize("build", [tiny_gpt_neox, tiny_llama], ids=["neox", "llama"])
def test_install_changes_the_product_path_only(build):
    model = build(torch.float32)
    params_before = dict(model.named_parameters())
    ids = torch.randint(1, 128, (1, 11))
    with torch.no_grad():
        before = model(ids).logits
    every_path = GemmPlan(gemm.CALIBRATED_ROWS, ("onednn",) * len(gemm.CALIBRATED_ROWS))
    for plan in (None, every_path, GemmPlan((64,), ("weight_left",))):
        chosen = gemm.install(model, plan)
        assert plan is None or chosen is plan
        layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
        assert layers and all(type(m) is PlannedLinear and m.gemm_plan is chosen for m in layers)
        assert {k: v for k, v in model.named_parameters()} == params_before  # the same tensors, the same names
        with torch.no_grad():
            for rows in (1, 11):  # 11 rows in one forward, and a one-token forward after a cache-free prefix
                torch.testing.assert_close(model(ids[:, :rows]).logits, before[:, :rows], atol=1e-5, rtol=1e-5)
    gemm.uninstall(model)
    assert not any(type(m) is PlannedLinear for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_target_takes_a_plan_for_float32_on_cpu_only(monkeypatch):
    assert TargetModel(tiny_gpt_neox(torch.float32)).gemm_plan is not None
    assert TargetModel(tiny_gpt_neox(torch.float64)).gemm_plan is None  # float64 keeps F.linear, exactly
    assert TargetModel(tiny_gpt_neox(torch.float32), planned_gemm=False).gemm_plan is None
    with pytest.raises(ValueError, match="float32 models on CPU"):
        TargetModel(tiny_gpt_neox(torch.float64), planned_gemm=True)
    monkeypatch.setenv("RAY_SPECDEC_PLANNED_GEMM", "0")
    assert TargetModel(tiny_gpt_neox(torch.float32)).gemm_plan is None


@pytest.mark.parametrize("path", [p for p in gemm.available_paths() if p != "linear"])
def test_greedy_speculation_on_planned_paths_is_the_target_alone(path):
    """float32, every product through one planned path: tree drafts and plain decoding on the planned target give
    HF generate's tokens on the unplanned model (prompts whose greedy path holds no float32 near-tie)."""
    target = TargetModel(tiny_gpt_neox(torch.float32, seed=5), planned_gemm=False)
    gemm.install(target.model, GemmPlan((64,), (path,)))
    assert_greedy_speculation_is_the_target_alone(tiny_gpt_neox(torch.float32, seed=5), target)


def test_plans_are_measured_once_per_machine_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_SPECDEC_CACHE_DIR", str(tmp_path))
    measured = []
    monkeypatch.setattr(gemm, "calibrate", lambda *a, **k: measured.append(1) or GemmPlan((1, 64), (
        "weight_left", LINEAR)))
    monkeypatch.setattr(gemm, "_PLANS", {})
    weights = [(torch.randn(24, 8), torch.randn(24)), (torch.randn(8, 24), None)]
    plan = gemm.plan_for(weights, rows=(1, 64))
    assert measured == [1] and len(list(tmp_path.glob("gemm-plan-*.json"))) == 1
    assert gemm.plan_for(weights, rows=(1, 64)) is plan and measured == [1]  # this process's copy
    monkeypatch.setattr(gemm, "_PLANS", {})  # a new process: the kept file
    assert gemm.plan_for(weights, rows=(1, 64)) == plan and measured == [1]
    gemm.plan_for([(torch.randn(24, 9), None)], rows=(1, 64))  # other shapes: measured
    assert measured == [1, 1]

    monkeypatch.setattr(gemm, "_PLANS", {})
    for file in tmp_path.glob("gemm-plan-*.json"):
        file.write_text("{not json")  # damaged: measured again and rewritten
    assert gemm.plan_for(weights, rows=(1, 64)) == plan and measured == [1, 1, 1]
    monkeypatch.setattr(gemm, "_PLANS", {})
    assert gemm.plan_for(weights, rows=(1, 64)) == plan and measured == [1, 1, 1]

    monkeypatch.setenv("RAY_SPECDEC_CACHE_DIR", "")  # no cache dir: nothing kept on disk
    monkeypatch.setattr(gemm, "_PLANS", {})
    for file in tmp_path.glob("gemm-plan-*.json"):
        file.unlink()
    gemm.plan_for(weights, rows=(1, 64))
    assert measured == [1, 1, 1, 1] and not list(tmp_path.glob("*"))


def test_cpu_identity_tells_apart_cpus_of_one_name_by_their_instruction_sets(tmp_path):
    """Plans and native builds are kept per CPU kind: two VMs that both call themselves "AMD EPYC" but differ in
    AVX-512 must not share them (a shared home directory would hand an AVX-512 build to a CPU without it)."""
    def cpuinfo(name, flags):
        path = tmp_path / f"{name}-{len(flags)}-{flags[0]}"
        block = f"processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: 25\nmodel\t\t: 1\nflags\t\t: {flags}\n"
        path.write_text(block + "\n" + block.replace("processor\t: 0", "processor\t: 1"))
        return str(path)

    zen3 = library.cpu_identity(cpuinfo("a", "fpu avx2 fma f16c"))
    assert zen3 == library.cpu_identity(cpuinfo("b", "f16c fma avx2 fpu"))  # the same set, another order
    assert zen3 != library.cpu_identity(cpuinfo("c", "fpu avx2 fma f16c avx512f avx512bw"))
    assert "AMD EPYC" in zen3
