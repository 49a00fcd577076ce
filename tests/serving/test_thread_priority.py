"""Compute threads first (serving/thread_priority.py): an EngineLoop with compute_first leaves its own thread and its
OpenMP team at the process's niceness and lowers every other thread of the process to 19, threads started later
too; the team it found is the one that runs torch's parallel work. Run in a child process, whose threads the test may
lower."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ray_specdec.models.native import library

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import asyncio, json, os, threading
    import torch
    from ray_specdec.config import SamplingParams, TreeConfig
    from ray_specdec.engine.scheduler import Scheduler
    from ray_specdec.engine.scheduler_config import SchedulerConfig
    from ray_specdec.engine.target_backend import LocalTarget
    from ray_specdec.models.target.model import TargetModel
    from ray_specdec.serving.engine_loop import EngineLoop
    from tests.helpers.inputs import random_prompt
    from tests.helpers.models import tiny_gpt_neox, tiny_mamba

    def nice(tid):
        return os.getpriority(os.PRIO_PROCESS, tid)

    def cpu_ticks(tid):
        fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    start_nice = nice(threading.get_native_id())
    torch.set_num_threads(2)
    stop = threading.Event()
    idle = [threading.Thread(target=stop.wait, daemon=True) for _ in range(2)]
    for t in idle:
        t.start()
    ticks = {}

    def parallel_work(scheduler, seconds):  # on the loop's thread, after its first step: who runs torch's work?
        if ticks:
            return
        x = torch.randn(3000, 3000)
        before = {t: cpu_ticks(t) for t in loop.priority.compute}
        for _ in range(40):
            (x * 1.5).exp_()
        ticks.update({str(t): cpu_ticks(t) - before[t] for t in loop.priority.compute})

    target = TargetModel(tiny_gpt_neox(torch.float32))
    scheduler = Scheduler(LocalTarget(target), tiny_mamba(torch.float32), None, TreeConfig((2, 1)), SchedulerConfig())
    loop = EngineLoop(scheduler, compute_first=True, on_step=parallel_work)

    async def one():
        out = []
        async for chunk in loop.generate("a", random_prompt(20, seed=1), SamplingParams(max_new_tokens=8)):
            out += chunk.token_ids
        return out

    tokens = asyncio.run(one())
    later = threading.Thread(target=stop.wait, daemon=True)
    later.start()
    loop.priority.refresh(force=True)
    compute = loop.priority.compute
    print(json.dumps({
        "tokens": len(tokens),
        "loop": loop._thread.native_id,
        "compute": sorted(compute),
        "compute_nice": [nice(t) for t in compute],
        "others": {t: nice(int(t)) for t in os.listdir("/proc/self/task") if int(t) not in compute},
        "idle": [t.native_id for t in idle] + [later.native_id],
        "start_nice": start_nice,
        "ticks": ticks,
    }))
    stop.set()
    loop.stop()
""")


@pytest.mark.skipif(sys.platform != "linux", reason="thread niceness per thread is Linux's")
def test_compute_first_lowers_every_other_thread_and_keeps_the_loops_team():
    if library.load() is None:
        pytest.skip(f"native kernels unavailable: {library.why_unavailable()}")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["tokens"] == 8
    assert got["loop"] in got["compute"] and len(got["compute"]) == 2  # the loop's thread and one OpenMP worker
    assert set(got["compute_nice"]) == {got["start_nice"]}
    assert got["others"] and all(value == 19 for value in got["others"].values())
    assert {str(t) for t in got["idle"]} <= set(got["others"])  # started before and after: both lowered
    assert all(spent > 0 for spent in got["ticks"].values()), got["ticks"]  # the team runs the loop's torch work
