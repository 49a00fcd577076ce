"""Driving an EngineLoop from a test: a request's tokens from its stream, a bounded asyncio.run, and polling for what
the loop's thread changes."""

from __future__ import annotations

import asyncio
import time

from ray_specdec.serving.engine_loop import EngineLoop


async def collect(loop: EngineLoop, request_id: str, prompt, params, tree=None) -> list[int]:
    tokens = []
    async for chunk in loop.generate(request_id, prompt, params, tree):
        tokens += chunk.token_ids
    assert chunk.finish_reason == "length"
    return tokens


def run(coro):
    """asyncio.run with a generous bound, so that a hung stream fails the test instead of hanging it."""
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


def wait_until(condition, timeout_s: float = 30.0) -> None:
    """Poll (the loop's thread changes what `condition` reads); fail after a generous timeout."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
