"""Costs timed apart from their step wait for the device at both ends (device_clock): on CUDA a call returns once its
kernels are queued, and timing the launches priced drafter prefills and drafter steps near zero. The device is
emulated: a synchronize that takes as long as the work it waits for."""

from __future__ import annotations

import time

import torch

from ray_specdec.models import device_clock
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_mamba

QUEUED_S = 0.05  # the device time still queued when the host returns from a call


class QueuedDevice:
    """Stands in for device_clock.synchronize: every call after `armed` waits QUEUED_S for work still running."""

    def __init__(self):
        self.calls, self.armed = [], False

    def __call__(self, device):
        self.calls.append(torch.device(device))
        if self.armed:
            time.sleep(QUEUED_S)


def test_synchronize_waits_only_for_cuda_devices(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(torch.device(device)))
    device_clock.synchronize("cpu")
    assert waited == []
    before = time.perf_counter()
    reading = device_clock.now("cuda:1")
    assert waited == [torch.device("cuda:1")] and reading >= before
    device_clock.settle([None, torch.zeros(1)])
    assert waited == [torch.device("cuda:1")]


def test_a_drafter_prefill_is_timed_to_the_end_of_its_device_work(monkeypatch):
    """The seconds `ready` reports hold what the device still had to do when the prefill's calls returned."""
    from ray_specdec.speculation.drafter_sessions import LazyDrafter

    device = QueuedDevice()
    monkeypatch.setattr(device_clock, "synchronize", device)
    drafter = tiny_mamba(vocab=32)
    lazy = LazyDrafter(drafter, vocab_size=32)
    device.armed = True
    prefill_s = lazy.ready(random_prompt(12, seed=5, vocab=32))
    assert prefill_s >= QUEUED_S  # the closing wait is inside the timing (the opening one is not: at most 2x)
    assert prefill_s < 2 * QUEUED_S + 1.0
    assert device.calls == [drafter.device, drafter.device]
    assert lazy.ready(random_prompt(13, seed=5, vocab=32)) == 0.0  # later rounds only catch up: no prefill


def test_the_cost_models_prior_times_device_work_not_launches(monkeypatch):
    """measure_prior's drafter steps and target forwards include the device's queued time."""
    from ray_specdec.speculation.controller import _time_drafter

    device = QueuedDevice()
    monkeypatch.setattr(device_clock, "synchronize", device)
    drafter = tiny_mamba(vocab=32)
    device.armed = True
    for kind in (1, 16, "extend", "prefill"):
        assert _time_drafter(drafter, kind) >= QUEUED_S
    device.calls.clear()
    device_clock.settle([torch.zeros(2), None, torch.zeros(3)])
    assert device.calls == [torch.device("cpu")]  # one wait per device that holds an output
