"""The native C step and scan of the Mamba drafter (models/native) against the torch path, and their fallbacks.

The torch path is itself tested against HF's Mamba (tests/models/drafter/test_mamba.py, where float32 drafters now run
native by default); here the native kernels are held to the float64 torch path at float32 rounding, on shapes that cross
every block boundary of the C GEMM (64- and 16-wide output blocks, a ragged tail, row groups of 4).
"""

from __future__ import annotations

import pytest
import torch

from ray_specdec.models.native import gemm, library

from ray_specdec.models.drafter.mamba import _NATIVE_SEQUENCE_MAX, MambaDrafter
from ray_specdec.models.drafter.mamba_state import MambaState, StateSlots
from tests.helpers.native_mamba import CONFIGS, VOCAB, mamba

TOL = dict(rtol=1e-4, atol=5e-5)


pytestmark = pytest.mark.usefixtures("fresh_native_loader")


@pytest.fixture
def lib():
    if library.load() is None:
        pytest.skip(f"native kernels unavailable here: {library.why_unavailable()}")
    return library.load()


@pytest.fixture(params=list(CONFIGS))
def pair(request, lib) -> tuple[MambaDrafter, MambaDrafter]:
    """(native float32 drafter, torch float64 drafter) with the same weights."""
    model = mamba(request.param)
    fast = MambaDrafter(model.float(), native=True)
    assert fast.native is not None and fast.native_why is None
    return fast, MambaDrafter(model.double(), native=False)


def ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_on_by_default_for_float32_on_cpu_and_off_elsewhere(lib):
    model = mamba("ragged")
    assert MambaDrafter(model.float()).native is not None
    assert MambaDrafter(model.float(), native=False).native is None
    f64 = MambaDrafter(model.double())
    assert f64.native is None and "float32" in f64.native_why
    with pytest.raises(RuntimeError, match="native=True but .*float32"):
        MambaDrafter(model.double(), native=True)


@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9])
def test_steps_match_the_float64_torch_step(native_isa, pair, rows):
    fast, exact = pair
    prompt = ids(11)
    f_state, e_state = fast.copy_rows(fast.prefill(prompt)[0], [0] * rows), exact.copy_rows(exact.prefill(prompt)[0],
                                                                                           [0] * rows)
    for k in range(4):  # each row its own tokens, so rows diverge
        tokens = ids(rows, seed=10 + k)
        f_logits, e_logits = fast.step(f_state, tokens), exact.step(e_state, tokens)
        assert f_logits.shape == (rows, VOCAB) and f_logits.dtype == torch.float32
        torch.testing.assert_close(f_logits.double(), e_logits, **TOL)
    torch.testing.assert_close(f_state.conv.double(), e_state.conv, **TOL)
    torch.testing.assert_close(f_state.ssm.double(), e_state.ssm, **TOL)


def test_prefill_and_extend_scan_match_the_float64_torch_path(pair):
    fast, exact = pair
    prompt = ids(40, seed=2)
    (f_state, f_logits), (e_state, e_logits) = fast.prefill(prompt[:30]), exact.prefill(prompt[:30])
    torch.testing.assert_close(f_logits.double(), e_logits, **TOL)
    torch.testing.assert_close(f_state.ssm.double(), e_state.ssm, **TOL)
    f_logits, e_logits = fast.extend(f_state, prompt[30:]), exact.extend(e_state, prompt[30:])
    torch.testing.assert_close(f_logits.double(), e_logits, **TOL)
    torch.testing.assert_close(f_state.ssm.double(), e_state.ssm, **TOL)
    torch.testing.assert_close(f_state.conv.double(), e_state.conv, **TOL)


@pytest.fixture
def two_threads():
    """The kernels take torch's intra-op thread count; the test suite runs on one (conftest)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_long_prefill_scans_on_several_threads_and_matches(pair, two_threads):
    """Long enough that the scan and the projections split their channels / outputs over two threads."""
    fast, exact = pair
    prompt = ids(1200, seed=4)
    assert 1200 * fast.d_inner * fast.d_state >= library.PARALLEL_MIN_MACS
    (f_state, f_logits), (e_state, e_logits) = fast.prefill(prompt), exact.prefill(prompt)
    torch.testing.assert_close(f_logits.double(), e_logits, **TOL)
    torch.testing.assert_close(f_state.ssm.double(), e_state.ssm, **TOL)
    f_logits, e_logits = fast.extend(f_state, prompt[:60]), exact.extend(e_state, prompt[:60])  # one C forward
    torch.testing.assert_close(f_logits.double(), e_logits, **TOL)


def own_and_slotted_states(fast: MambaDrafter, n: int) -> tuple[list[MambaState], StateSlots]:
    """n one-row states after different prompts: the first half of their own, the rest slots of a pool."""
    slots, states = StateSlots(fast, n), []
    for i in range(n):
        state = fast.prefill(ids(3 + i, seed=10 + i))[0]
        states.append(state if i < n // 2 else fast.copy_rows(state, [0], out=slots.state(slots.acquire())))
    return states, slots


@pytest.mark.parametrize("threads", [1, 2])
def test_forward_rows_gives_each_state_the_bits_it_gets_alone(native_isa, pair, threads):
    """States of their own and slots of a pool, each advanced by its own number of tokens in one call: each gets the
    logits and state of its own forward on one thread, bit for bit, on one thread or two (enough tokens in all that
    the conv and the scan split their channels over two)."""
    fast, _ = pair
    lengths = [1, 3, 2, 40, 1, 60, 5, 64]
    assert sum(lengths) * fast.d_inner * fast.d_state * 8 >= library.PARALLEL_MIN_MACS
    states, _ = own_and_slotted_states(fast, len(lengths))
    alone = [MambaState(s.conv.clone(), s.ssm.clone()) for s in states]
    tokens = [ids(n, seed=20 + i) for i, n in enumerate(lengths)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = [fast.native.forward(s.conv, s.ssm, t[None])[0] for s, t in zip(alone, tokens)]
        torch.set_num_threads(threads)
        logits = fast.native.forward_rows([(s.conv, s.ssm) for s in states], tokens)
    finally:
        torch.set_num_threads(before)
    for i, (state, single) in enumerate(zip(states, alone)):
        assert torch.equal(logits[i], expected[i])
        assert torch.equal(state.conv, single.conv) and torch.equal(state.ssm, single.ssm)


def test_extend_rows_batches_what_the_native_forward_takes_and_extends_the_rest(pair, monkeypatch):
    """More tokens than one native call takes, or a strided state, extend alone; the rest go in one call; every
    state gets what `extend` gives it."""
    fast, _ = pair
    states, _ = own_and_slotted_states(fast, 4)
    wide = fast.copy_rows(fast.prefill(ids(6))[0], [0, 0])
    states.append(MambaState(wide.conv[:, 1:], wide.ssm[:, 1:]))  # one row of a two-row state: strided
    tokens = [ids(n, seed=30 + i) for i, n in enumerate([2, _NATIVE_SEQUENCE_MAX + 6, 1, 4, 3])]
    alone = [MambaState(s.conv.clone(), s.ssm.clone()) for s in states[:-1]]
    alone.append(MambaState(wide.conv.clone()[:, 1:], wide.ssm.clone()[:, 1:]))  # strided too
    expected = [fast.extend(s, t) for s, t in zip(alone, tokens)]
    calls = []
    forward_rows = fast.native.forward_rows
    monkeypatch.setattr(fast.native, "forward_rows", lambda st, ids_: calls.append(len(st)) or forward_rows(st, ids_))
    logits = fast.extend_rows(states, tokens)
    assert calls == [3]  # states 0, 2 and 3
    for i, (state, single) in enumerate(zip(states, alone)):
        assert torch.equal(logits[i], expected[i])
        assert torch.equal(state.conv, single.conv) and torch.equal(state.ssm, single.ssm)
    with pytest.raises(ValueError, match="2 token sequences for 1 states"):
        fast.extend_rows(states[:1], tokens[:2])
    with pytest.raises(ValueError, match="at least one token"):
        fast.extend_rows(states[:2], [tokens[0], []])
    with pytest.raises(ValueError, match="1-row states"):
        fast.extend_rows([wide], [tokens[0]])


def test_forward_rows_refuses_bad_input_and_changes_nothing(pair):
    fast, _ = pair
    states, _ = own_and_slotted_states(fast, 2)
    before = [(s.conv.clone(), s.ssm.clone()) for s in states]
    pairs = [(s.conv, s.ssm) for s in states]
    with pytest.raises(IndexError, match=f"token ids must be in \\[0, {VOCAB}\\)"):
        fast.native.forward_rows(pairs, [ids(2), torch.tensor([1, VOCAB])])
    with pytest.raises(ValueError, match="at least one token"):
        fast.native.forward_rows(pairs, [ids(2), torch.tensor([], dtype=torch.long)])
    with pytest.raises(ValueError, match="1 token sequences for 2 states"):
        fast.native.forward_rows(pairs, [ids(2)])
    two = fast.new_state(2)
    with pytest.raises(ValueError, match="one-row float32 states"):
        fast.native.forward_rows([pairs[0], (two.conv, two.ssm)], [ids(1), ids(1)])
    for s, (conv, ssm) in zip(states, before):
        assert torch.equal(s.conv, conv) and torch.equal(s.ssm, ssm)
    assert fast.native.forward_rows([], []).shape == (0, VOCAB)


def test_native_is_what_runs(pair, monkeypatch):
    """The comparisons above must compare the C code, not the torch path twice: a step and a catch-up are one C
    call each; a prefill scans each layer in C."""
    fast, _ = pair
    state, _ = fast.prefill(ids(5))
    lib, calls = library.load(), []
    class Spy:  # counts the kernel calls, passes everything else through
        def __getattr__(self, name):
            return getattr(lib, name)

        def mamba_forward(self, *args):
            calls.append("forward")
            return lib.mamba_forward(*args)

        def mamba_scan(self, *args):
            calls.append("scan")
            return lib.mamba_scan(*args)

    spy = Spy()
    monkeypatch.setattr(fast.native, "lib", spy)
    fast.step(state, [3])
    fast.extend(state, [4, 5, 6])
    assert calls == ["forward", "forward"]
    fast.prefill(ids(7))
    assert calls[2:] == ["scan"] * fast.n_layers


def test_pack_panels_layout():
    """Blocks of 64 outputs, then 16, then the rest padded with zeros to 16; each block [n_in, width] row-major, one
    after the other."""
    weight = torch.arange(1, 93 * 7 + 1, dtype=torch.float32).reshape(93, 7)  # [n_out, n_in]
    packed = gemm.pack_panels(weight)
    assert packed.shape == (96 * 7,)
    offset = 0
    for start, width in [(0, 64), (64, 16), (80, 16)]:
        block = packed[offset : offset + 7 * width].reshape(7, width)
        real = min(width, 93 - start)
        assert torch.equal(block[:, :real], weight[start : start + real].t())
        assert not block[:, real:].any()
        offset += 7 * width


def test_bad_tokens_raise_and_leave_the_state_alone(pair):
    fast, _ = pair
    state = fast.copy_rows(fast.prefill(ids(6))[0], [0, 0])
    before = (state.conv.clone(), state.ssm.clone())
    for bad in ([VOCAB, 1], [-1, 2]):
        with pytest.raises(IndexError, match=f"token ids must be in \\[0, {VOCAB}\\)"):
            fast.step(state, bad)
    assert torch.equal(state.conv, before[0]) and torch.equal(state.ssm, before[1])
    assert fast.step(fast.new_state(0), []).shape == (0, VOCAB)


def test_a_non_contiguous_state_takes_the_torch_step(pair):
    fast, exact = pair
    state = fast.copy_rows(fast.prefill(ids(8))[0], [0, 0, 0])
    view = type(state)(conv=state.conv[:, ::2], ssm=state.ssm[:, ::2])  # rows 0 and 2, strided
    want = exact.copy_rows(exact.prefill(ids(8))[0], [0, 0])
    torch.testing.assert_close(fast.step(view, [1, 2]).double(), exact.step(want, [1, 2]), **TOL)
    torch.testing.assert_close(state.ssm[:, ::2].double(), want.ssm, **TOL)  # advanced in place, through the view


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("RAY_SPECDEC_NATIVE", "0")
    assert library.load() is None and library.why_unavailable() == "RAY_SPECDEC_NATIVE=0"
    drafter = MambaDrafter(mamba("ragged").float())
    assert drafter.native is None and drafter.native_why == "RAY_SPECDEC_NATIVE=0"
    with pytest.raises(RuntimeError, match="native=True but RAY_SPECDEC_NATIVE=0"):
        MambaDrafter(mamba("ragged").float(), native=True)


def test_no_compiler_or_a_failing_build_falls_back_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_SPECDEC_CACHE_DIR", str(tmp_path))  # nothing built yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert library.load() is None and "no C compiler found" in library.why_unavailable()
    library.load.cache_clear()
    failing = tmp_path / "failing-cc"
    failing.write_text("#!/bin/sh\necho 'mamba_cpu.c:1: error: no luck' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    assert library.load() is None
    assert "could not be built" in library.why_unavailable() and "no luck" in library.why_unavailable()
    model = mamba("ragged").float()
    drafter = MambaDrafter(model)  # still drafts, through torch
    torch.testing.assert_close(drafter.prefill(ids(9))[1], MambaDrafter(model, native=False).prefill(ids(9))[1])
    assert not list(tmp_path.glob("native/*.so")) and not list(tmp_path.glob("native/*.tmp*"))


def test_built_once_per_machine(lib, monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_SPECDEC_CACHE_DIR", str(tmp_path))
    real_run, compiles = library.subprocess.run, []

    def run(args, **kw):
        compiles.extend([args] if "-shared" in args else [])
        return real_run(args, **kw)

    monkeypatch.setattr(library.subprocess, "run", run)
    library.load.cache_clear()
    assert library.load() is not None and len(compiles) == 1
    assert len(list(tmp_path.glob("native/kernels-*.so"))) == 1
    library.load.cache_clear()  # a new process on the same machine: loads the kept build
    assert library.load() is not None and len(compiles) == 1
