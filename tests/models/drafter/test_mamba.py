"""MambaDrafter against HF's MambaForCausalLM, and against itself (prefill vs steps, row copies, commits).

HF's Mamba computes its RMSNorms, dt bias, B, x and logits in float32 even for a float64 model, so comparisons with HF
hold to float32 rounding in both dtypes; comparisons of the drafter with itself in float64 are tight.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import DynamicCache, MambaConfig, MambaForCausalLM

from ray_specdec.models.native import gemm

from ray_specdec.models.drafter import mamba
from ray_specdec.models.drafter.mamba import MambaDrafter, MambaState
from tests.helpers.models import perturbed_mamba

VOCAB = 61

CONFIGS = {
    # HF defaults: no linear biases, conv bias, tied embeddings, float32 residual.
    "default": dict(hidden_size=24, state_size=8, num_hidden_layers=2),
    # Every other switch flipped; d_inner = 3 * 20 is not a power of two.
    "biases_untied": dict(
        hidden_size=20,
        state_size=5,
        num_hidden_layers=3,
        expand=3,
        conv_kernel=3,
        time_step_rank=3,
        use_bias=True,
        use_conv_bias=False,
        tie_word_embeddings=False,
        residual_in_fp32=False,
        layer_norm_epsilon=1e-3,
    ),
}
HF_ATOL = {torch.float64: 2e-6, torch.float32: 2e-5}  # HF's logits are float32 (see module docstring)
SELF_TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=2e-5)}


def tiny_mamba(config_name: str = "default", dtype: torch.dtype = torch.float64, seed: int = 0) -> MambaForCausalLM:
    return perturbed_mamba(MambaConfig(vocab_size=VOCAB, **CONFIGS[config_name]), seed).to(dtype)


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=[torch.float64, torch.float32], ids=["f64", "f32"])
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture(scope="module", params=list(CONFIGS))
def hf_and_drafter(request, dtype) -> tuple[MambaForCausalLM, MambaDrafter]:
    model = tiny_mamba(request.param, dtype)
    return model, MambaDrafter(model)


def assert_states_close(a: MambaState, b: MambaState, dtype: torch.dtype) -> None:
    torch.testing.assert_close(a.conv, b.conv, **SELF_TOL[dtype])
    torch.testing.assert_close(a.ssm, b.ssm, **SELF_TOL[dtype])


@torch.no_grad()
def test_prefill_matches_hf_logits_and_cache(hf_and_drafter, dtype):
    model, drafter = hf_and_drafter
    ids = prompt(13)
    cache = DynamicCache(config=model.config)
    hf_logits = model(ids[None], cache_params=cache, use_cache=True).logits[0]  # [S, V]
    state, logits = drafter.prefill(ids)

    assert logits.shape == (VOCAB,) and logits.dtype == dtype
    assert state.rows == 1
    torch.testing.assert_close(logits.float(), hf_logits[-1], rtol=0, atol=HF_ATOL[dtype])
    for layer in range(drafter.n_layers):  # same state layout as HF (and mamba_ssm)
        hf_layer = cache.layers[layer]
        torch.testing.assert_close(state.conv[layer], hf_layer.conv_states[0], rtol=0, atol=HF_ATOL[dtype])
        torch.testing.assert_close(state.ssm[layer], hf_layer.recurrent_states[0], rtol=0, atol=HF_ATOL[dtype])


@torch.no_grad()
def test_steps_match_hf_logits_at_every_position(hf_and_drafter, dtype):
    model, drafter = hf_and_drafter
    ids = prompt(9, seed=2)
    hf_logits = model(ids[None]).logits[0]  # [S, V]
    state = drafter.new_state(1)
    for pos, token in enumerate(ids.tolist()):
        logits = drafter.step(state, [token])
        torch.testing.assert_close(logits[0].float(), hf_logits[pos], rtol=0, atol=HF_ATOL[dtype])


@pytest.mark.parametrize("prefix_len", [1, 2, 4, 7])
def test_prefill_prefix_then_steps_equals_prefill_whole(hf_and_drafter, dtype, prefix_len, monkeypatch):
    _, drafter = hf_and_drafter
    # Scan blocks of 3 tokens, so the whole prompt also crosses block boundaries.
    monkeypatch.setattr(mamba, "_SCAN_BLOCK_ELEMENTS", 3 * drafter.d_inner * drafter.d_state)
    ids = prompt(10, seed=3)
    whole_state, whole_logits = drafter.prefill(ids)
    state, logits = drafter.prefill(ids[:prefix_len])
    for token in ids[prefix_len:].tolist():
        logits = drafter.step(state, [token])[0]
    assert_states_close(state, whole_state, dtype)
    torch.testing.assert_close(logits, whole_logits, **SELF_TOL[dtype])


@pytest.mark.parametrize("prefix_len, extra", [(1, 1), (1, 2), (3, 3), (4, 6)])
def test_extend_equals_steps_and_prefill_of_the_whole(hf_and_drafter, dtype, prefix_len, extra, monkeypatch):
    """extend(k tokens) from a mid-sequence state: the conv window and the scan both carry the state in."""
    _, drafter = hf_and_drafter
    monkeypatch.setattr(mamba, "_SCAN_BLOCK_ELEMENTS", 2 * drafter.d_inner * drafter.d_state)
    ids = prompt(prefix_len + extra, seed=11)
    whole_state, whole_logits = drafter.prefill(ids)
    stepped, _ = drafter.prefill(ids[:prefix_len])
    for token in ids[prefix_len:].tolist():
        step_logits = drafter.step(stepped, [token])[0]
    extended, _ = drafter.prefill(ids[:prefix_len])
    logits = drafter.extend(extended, ids[prefix_len:])
    assert logits.shape == (VOCAB,)
    assert_states_close(extended, whole_state, dtype)
    assert_states_close(extended, stepped, dtype)
    torch.testing.assert_close(logits, whole_logits, **SELF_TOL[dtype])
    torch.testing.assert_close(logits, step_logits, **SELF_TOL[dtype])


def test_extend_rejects_bad_input():
    drafter = MambaDrafter(tiny_mamba())
    state, _ = drafter.prefill(prompt(4))
    with pytest.raises(ValueError, match="at least one token"):
        drafter.extend(state, [])
    with pytest.raises(ValueError, match="1-row state"):
        drafter.extend(drafter.copy_rows(state, [0, 0]), [1, 2])


def distinct_rows(drafter: MambaDrafter, rows: int) -> MambaState:
    """A state whose rows have different histories: one prompt, then a different token per row, twice."""
    state = drafter.copy_rows(drafter.prefill(prompt(5, seed=4))[0], [0] * rows)
    for offset in (0, 7):
        drafter.step(state, [(offset + 3 * r) % VOCAB for r in range(rows)])
    return state


def single_row(state: MambaState, row: int) -> MambaState:
    return MambaState(conv=state.conv[:, row : row + 1].clone(), ssm=state.ssm[:, row : row + 1].clone())


def test_batch_rows_are_independent(hf_and_drafter, dtype):
    _, drafter = hf_and_drafter
    state = distinct_rows(drafter, 4)
    assert not torch.equal(state.ssm[:, 0], state.ssm[:, 1])
    singles = [single_row(state, r) for r in range(4)]
    tokens = [11, 5, 11, 40]
    batch_logits = drafter.step(state, tokens)
    for r, single in enumerate(singles):
        logits = drafter.step(single, [tokens[r]])
        torch.testing.assert_close(batch_logits[r : r + 1], logits, **SELF_TOL[dtype])
        assert_states_close(single_row(state, r), single, dtype)


def test_copy_rows_then_step_equals_stepping_source_rows(hf_and_drafter, dtype):
    _, drafter = hf_and_drafter
    src = distinct_rows(drafter, 3)
    index = torch.tensor([2, 0, 2, 1, 1])
    out = drafter.copy_rows(src, index)
    assert torch.equal(out.conv, src.conv[:, index]) and torch.equal(out.ssm, src.ssm[:, index])
    reused = drafter.copy_rows(src, [1, 2], out=drafter.new_state(2))  # into a preallocated state
    assert torch.equal(reused.ssm, src.ssm[:, [1, 2]])

    tokens = [3, 3, 17, 0, 59]
    logits = drafter.step(out, tokens)
    for i, j in enumerate(index.tolist()):
        ref = single_row(src, j)
        torch.testing.assert_close(logits[i : i + 1], drafter.step(ref, [tokens[i]]), **SELF_TOL[dtype])
        assert_states_close(single_row(out, i), ref, dtype)


@pytest.mark.parametrize("accepted_depth", [0, 1, 2])
def test_commit_by_row_copy_equals_reprefill(hf_and_drafter, dtype, accepted_depth):
    """Draft a (2, 2) tree by batch stepping, accept a path, copy its last row, step the bonus token."""
    _, drafter = hf_and_drafter
    ids = prompt(6, seed=5)
    root, _ = drafter.prefill(ids)
    depth1 = drafter.copy_rows(root, [0, 0])
    drafter.step(depth1, [8, 21])  # children of the root
    depth2 = drafter.copy_rows(depth1, [0, 0, 1, 1])
    drafter.step(depth2, [30, 2, 44, 9])  # children of 8: (30, 2); of 21: (44, 9)
    # Accepted path 21 -> 44: row 1 at depth 1, row 2 at depth 2.
    states, rows, path = [root, depth1, depth2], [0, 1, 2], [21, 44]
    bonus = 13

    state = drafter.copy_rows(states[accepted_depth], [rows[accepted_depth]])
    logits = drafter.step(state, [bonus])[0]
    accepted = path[:accepted_depth]
    want_state, want_logits = drafter.prefill(torch.cat([ids, torch.tensor(accepted + [bonus])]))
    assert_states_close(state, want_state, dtype)
    torch.testing.assert_close(logits, want_logits, **SELF_TOL[dtype])


def test_save_fp16_load_as_float32(tmp_path):
    model = tiny_mamba("biases_untied", torch.float16)
    model.save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    assert {t.dtype for t in on_disk.values()} == {torch.float16}

    # CPU default: float32, whatever the checkpoint holds
    drafter = MambaDrafter.from_pretrained(str(tmp_path), fast_matmul=False)
    assert drafter.dtype == torch.float32 and drafter.device.type == "cpu"
    assert (drafter.n_layers, drafter.d_inner, drafter.d_conv, drafter.d_state) == (3, 60, 3, 5)
    assert drafter.vocab_size == VOCAB
    in_memory = MambaDrafter(model.float())  # the same fp16 weights, upcast in memory
    ids = prompt(8, seed=6)
    _, loaded_logits = drafter.prefill(ids)
    _, memory_logits = in_memory.prefill(ids)
    assert loaded_logits.dtype == torch.float32
    assert torch.equal(loaded_logits, memory_logits)
    assert MambaDrafter.from_pretrained(str(tmp_path), dtype="float64").dtype == torch.float64


def test_fast_matmul_is_the_cpu_float32_default_and_stays_close(tmp_path, monkeypatch):
    model = tiny_mamba("biases_untied", torch.float16)
    model.save_pretrained(tmp_path)
    assert MambaDrafter.from_pretrained(str(tmp_path))._low_precision  # on by default for float32 on CPU
    assert not MambaDrafter.from_pretrained(str(tmp_path), dtype="float64")._low_precision
    with pytest.raises(ValueError, match="float32 drafters on CPU"):
        MambaDrafter(model.double(), fast_matmul=True)

    for bf16 in (False, True):  # with and without bf16 matrix instructions (the copies are made at init)
        monkeypatch.setattr(mamba, "_cpu_has_bf16_matmul", lambda bf16=bf16: bf16)
        # the torch step's product paths (the native step, on by default, has its own tests)
        fast = MambaDrafter(model.float(), fast_matmul=True, native=False)
        exact = MambaDrafter(model.float(), native=False)
        assert fast.gemm_plan is not None and exact.gemm_plan is None
        assert set(fast.gemm_plan.paths) <= set(fast._gemm_paths)
        assert ("bfloat16" in fast._gemm_paths) == bf16 and "float16" in fast._gemm_paths
        ids = prompt(12, seed=3)
        exact_state, exact_logits = exact.prefill(ids)
        for path in fast._gemm_paths:  # every path the plan may pick, forced for every row count
            fast.gemm_plan = gemm.GemmPlan((64,), (path,))
            fast_state, fast_logits = fast.prefill(ids)  # the prefill's last-row logits go through the path
            torch.testing.assert_close(fast_logits, exact_logits, atol=2e-2, rtol=2e-2)
            for rows in (1, 3, 100):  # 100: a batched step of more rows than the plan measured takes its last path
                f_state, e_state = fast.copy_rows(fast_state, [0] * rows), exact.copy_rows(exact_state, [0] * rows)
                tokens = torch.arange(rows) % (VOCAB - 5) + 5
                f_logits, e_logits = fast.step(f_state, tokens), exact.step(e_state, tokens)
                assert f_logits.dtype == torch.float32 and f_logits.shape == (rows, VOCAB)
                torch.testing.assert_close(f_logits, e_logits, atol=5e-2, rtol=5e-2)
                # the low-precision copies are used: their logits differ from float32's beyond float32 rounding
                differs = not torch.allclose(f_logits, e_logits, atol=1e-5, rtol=1e-5)
                assert differs == (path in ("float16", "bfloat16"))
                torch.testing.assert_close(f_state.ssm, e_state.ssm, atol=2e-2, rtol=2e-2)


def reference_conv_update(x, conv_state, weight, bias=None, activation=None):
    """causal_conv1d_update's contract: shift in x, convolve the window, optional SiLU."""
    conv_state.copy_(torch.cat([conv_state[:, :, 1:], x.unsqueeze(-1)], dim=-1))
    out = (conv_state * weight).sum(-1) + (0 if bias is None else bias)
    return F.silu(out) if activation == "silu" else out


def reference_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """mamba_ssm selective_state_update's contract (Mamba v1 shapes)."""
    dt = dt.to(state.dtype) + dt_bias.to(state.dtype)
    dt = F.softplus(dt) if dt_softplus else dt
    state.copy_(state * torch.exp(dt[..., None] * A) + (dt * x)[..., None] * B[:, None, :])
    out = (state * C[:, None, :]).sum(-1) + x * D
    return (out * F.silu(z)).to(x.dtype)


def reference_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False):
    """mamba_ssm selective_scan_fn's contract, channels first: u, delta, z [b, D, L]; B, C [b, N, L]."""
    delta = delta.float() + delta_bias[:, None]
    delta = F.softplus(delta) if delta_softplus else delta
    state = u.new_zeros(u.shape[0], A.shape[0], A.shape[1], dtype=torch.float32)
    ys = []
    for t in range(u.shape[-1]):
        dt = delta[..., t]
        state = state * torch.exp(dt[..., None] * A) + (dt * u[..., t])[..., None] * B[:, None, :, t]
        ys.append((state * C[:, None, :, t]).sum(-1))
    y = (torch.stack(ys, dim=-1) + u * D[:, None]) * F.silu(z)
    return (y, state) if return_last_state else y


def test_kernel_paths_match_torch_paths(monkeypatch):
    """The GPU fast paths' wiring, with mamba_ssm's kernels replaced by references to their contracts."""
    drafter = MambaDrafter(tiny_mamba("biases_untied", torch.float32), native=False)
    ids = prompt(9, seed=8)
    state, logits = drafter.prefill(ids)
    state = drafter.copy_rows(state, [0, 0, 0])
    step_logits = drafter.step(state, [1, 2, 3])
    monkeypatch.setattr(mamba, "causal_conv1d_update", reference_conv_update)
    monkeypatch.setattr(mamba, "selective_state_update", reference_state_update)
    monkeypatch.setattr(mamba, "selective_scan_fn", reference_scan)
    monkeypatch.setattr(drafter, "_use_kernels", True)

    fast_state, fast_logits = drafter.prefill(ids)
    torch.testing.assert_close(fast_logits, logits, **SELF_TOL[torch.float32])
    fast_state = drafter.copy_rows(fast_state, [0, 0, 0])
    torch.testing.assert_close(drafter.step(fast_state, [1, 2, 3]), step_logits, **SELF_TOL[torch.float32])
    assert_states_close(fast_state, state, torch.float32)


def test_bad_inputs_raise():
    drafter = MambaDrafter(tiny_mamba())
    with pytest.raises(ValueError, match="at least one token"):
        drafter.prefill([])
    with pytest.raises(ValueError, match="2 tokens for a state of 3 rows"):
        drafter.step(drafter.new_state(3), [1, 2])
    with pytest.raises(ValueError, match="1-D"):
        drafter.step(drafter.new_state(1), [[1]])
    with pytest.raises(ValueError, match="out of range"):
        drafter.copy_rows(drafter.new_state(2), [2])


@pytest.mark.parametrize("half, atol", [(torch.bfloat16, 0.05), (torch.float16, 0.01)], ids=["bf16", "f16"])
def test_half_model_keeps_state_and_residual_in_float32(half, atol):
    model = tiny_mamba("default", half)
    drafter = MambaDrafter(model)
    ids = prompt(12, seed=7)
    state, logits = drafter.prefill(ids)
    assert state.conv.dtype == half and state.ssm.dtype == torch.float32 and logits.dtype == torch.float32
    assert drafter.residual_dtype == torch.float32
    logits = drafter.step(state, [4])[0]
    # Against the same weights in float64 (logits ~3 here): half-precision rounding, not formula differences.
    want_state, want_logits = MambaDrafter(model.double()).prefill(torch.cat([ids, torch.tensor([4])]))
    torch.testing.assert_close(logits.double(), want_logits, rtol=0, atol=atol)
    torch.testing.assert_close(state.ssm.double(), want_state.ssm, rtol=0, atol=atol / 10)


def test_cuda_graphs_stay_off_on_cpu_and_asking_for_them_is_an_error():
    from ray_specdec.models.drafter.cuda_graphs import StepGraphs

    model = tiny_mamba()
    assert MambaDrafter(model).graphs is None
    with pytest.raises(ValueError, match="CUDA device"):
        MambaDrafter(model, cuda_graphs=True)
    with pytest.raises(ValueError, match="CUDA device"):
        StepGraphs(lambda *a: None, lambda rows: (None, None), torch.device("cpu"))


def test_a_failed_graph_capture_leaves_the_drafter_eager_unless_graphs_were_asked_for(monkeypatch):
    class FailingGraphs:
        def __init__(self, *args, max_tokens=64):
            self.max_tokens = max_tokens

        def capture(self, counts):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore lines")

    drafter = MambaDrafter(tiny_mamba())
    monkeypatch.setattr(mamba, "StepGraphs", FailingGraphs)
    drafter._start_graphs(insist=False)
    assert drafter.graphs is None and drafter.extend_graphs is None
    assert drafter.graphs_why == ("CUDA graph capture failed: RuntimeError: CUDA error: operation not permitted when "
                                  "stream is capturing")
    with pytest.raises(RuntimeError, match="operation not permitted"):
        drafter._start_graphs(insist=True)


def test_copy_rows_refuses_an_index_out_of_range_before_copying():
    drafter = MambaDrafter(tiny_mamba())
    state = drafter.copy_rows(drafter.prefill([1, 2, 3])[0], [0, 0])
    for bad in ([0, 2], [-1], torch.tensor([5])):
        with pytest.raises(ValueError, match="out of range"):
            drafter.copy_rows(state, bad)
