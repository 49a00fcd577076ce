"""Fixtures of the model and kernel tests."""

import pytest

from ray_specdec.models.native import library


@pytest.fixture(params=library.available_isas())
def native_isa(request, monkeypatch):
    """Each instruction-set path of the native kernels this CPU runs (RAY_SPECDEC_NATIVE_ISA: the CPU's own, and on
    x86-64 the AVX-512, AVX2 and scalar builds it can run), so that a kernel's test checks the paths other CPUs take
    too, not only the one of the machine it was written on."""
    monkeypatch.setenv("RAY_SPECDEC_NATIVE_ISA", request.param)
    if library.load() is None:
        pytest.skip(library.why_unavailable())
    return request.param


@pytest.fixture
def fresh_native_loader():
    """The native library loaded anew for the test and after it: a test that sets RAY_SPECDEC_NATIVE_ISA (`native_isa`)
    gets that build, and the tests after it the machine's own."""
    library.load.cache_clear()
    yield
    library.load.cache_clear()
