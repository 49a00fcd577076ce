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
