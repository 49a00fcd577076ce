"""native/philox_cpu.c: the keyed uniforms of coupled sampling against speculation/coupled.py's torch path, on every
instruction-set path this CPU runs: the same bits (torch.equal), for any seed, choice, position and vocabulary."""

from __future__ import annotations

import random

import pytest
import torch

from ray_specdec.models.native import library
from ray_specdec.speculation import coupled

EDGES = [(0, 0, 0), (2**63 - 1, 2**63 - 1, 2**32 - 1), (2**32 - 1, 2**32, 2**31), (2**32, 2**32 - 1, 1)]


@pytest.mark.parametrize("vocab", [1, 2, 7, 1001, 4096, 50257])
def test_native_uniforms_are_the_torch_paths_bits(native_isa, vocab):
    rng = random.Random(vocab)
    keys = EDGES + [(rng.randrange(2**63), rng.randrange(2**63), rng.randrange(2**32)) for _ in range(12)]
    table = torch.tensor(keys, dtype=torch.int64)
    out = torch.full((len(keys), vocab), -1.0, dtype=torch.float64)
    library.load().keyed_uniforms(table.data_ptr(), len(keys), vocab, out.data_ptr())
    assert torch.equal(out, coupled.torch_keyed_rows(table, vocab))


def test_keyed_rows_takes_the_native_path_on_cpu_and_torchs_without_it(monkeypatch):
    keys = [(12345, 2, p) for p in (7, 8, 9)]
    calls = []
    real = coupled.torch_keyed_rows
    monkeypatch.setattr(coupled, "torch_keyed_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    native = coupled.keyed_rows(keys, 1001)
    assert calls == ([] if library.load() is not None else [1])
    monkeypatch.setattr(coupled.native, "load", lambda: None)  # no compiler, or RAY_SPECDEC_NATIVE=0
    assert torch.equal(coupled.keyed_rows(keys, 1001), native) and calls[-1:] == [1]
