"""Run a kernel test file as a child process under Triton's interpreter.

TRITON_INTERPRET=1 is read when a kernel is defined, and another test file may already have imported the kernel
without it; so each kernel test file runs itself as a script (its `__main__` takes an input and an output path) in a
child with the variable set: the parent builds the inputs, the child runs the interpreted kernel, the parent compares.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(script: str, inputs, tmp: Path, timeout: float = 300) -> object:
    """`python script in.pt out.pt` under TRITON_INTERPRET=1 -> what the child saved. Skips where the installed
    Triton's interpreter cannot loop to a bound read at run time: Triton 3.6 turns it into an int through a
    1-element NumPy array, which NumPy 2.x refuses (seen on the GPU machine; 3.9's interpreter, which CI installs, runs
    it; compiled kernels always do)."""
    torch.save(inputs, tmp / "in.pt")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, script, str(tmp / "in.pt"), str(tmp / "out.pt")], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    if proc.returncode and "only 0-dimensional arrays can be converted" in proc.stderr:
        pytest.skip("this Triton's interpreter cannot loop to a bound read at run time")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(tmp / "out.pt")
