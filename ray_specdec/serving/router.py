"""The router's side of a request, without Ray: hand it to an engine replica and stream its chunks back.

The round loop runs in the engine replicas (engine/scheduler.py behind serving/engine_loop.py); the router validates,
encodes and forwards. What it adds is fault tolerance across replicas: when the replica serving a request is lost
mid-stream (its process died), the request continues on another replica from every token it has streamed so far
(prompt + generated, with max_new_tokens reduced by what was generated), until `retry_s` has passed; then it fails
with `ServiceUnavailable` (HTTP 503 with Retry-After). Greedy continuations, and those of sampled requests drawn in
the coupled mode (seeded ones by default: speculation/coupled.py keys each token by its absolute position), are
exactly the tokens the lost replica would have produced; other sampled ones keep the target's distribution (a fresh
random stream from the cut on). A stop
string that spans the cut is not seen (each replica checks the text it generated), nor are the lost replica's
rounds in the final statistics.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import AsyncIterator, Callable, Protocol, Sequence

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.outputs import Generation, StreamChunk

logger = logging.getLogger(__name__)

# Between tries on another replica after a lost one (Serve needs a moment to route around it).
RETRY_PAUSE_S = 0.5


class RequestError(Exception):
    """The engine refused the request: `status` is the HTTP status (400, 503)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class ServiceUnavailable(RequestError):
    def __init__(self, message: str):
        super().__init__(503, message)


class EngineClient(Protocol):
    def generate(
        self, prompt_ids: list[int], params: SamplingParams, tree: TreeConfig | None, interval_s: float,
        resumed: int = 0,
    ) -> AsyncIterator[StreamChunk | dict]: ...


class Router:
    def __init__(self, engine: EngineClient, tokenizer, max_context: int,
                 lost: Callable[[BaseException], bool], retry_s: float = 60.0, stream_interval_s: float = 0.0):
        """lost(exc): whether an exception of the engine call means its replica is gone (then the request is
        continued elsewhere). stream_interval_s: streams get a chunk at most this often after the first (rounds
        in between are merged: every chunk costs CPU in each process it crosses); whole generations only one."""
        self.stream_interval_s = stream_interval_s
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.lost = lost
        self.retry_s = retry_s
        self.in_flight = 0
        self.continued = 0  # requests moved to another replica mid-stream

    def encode(self, prompt: str) -> list[int]:
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not ids:
            raise RequestError(400, "the prompt encodes to no tokens")
        return list(ids)

    def check_length(self, prompt_len: int, params: SamplingParams) -> None:
        if prompt_len + params.max_new_tokens > self.max_context:
            raise RequestError(400, f"prompt ({prompt_len} tokens) + max_tokens ({params.max_new_tokens}) exceeds "
                                    f"the model's context length of {self.max_context} tokens")  # fmt: skip

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       tree: TreeConfig | None = None) -> Generation:
        token_ids, text, chunk = [], [], None
        logprobs = None if params.logprobs is None else []
        async for chunk in self.stream(prompt_ids, params, tree, interval_s=math.inf):
            token_ids += chunk.token_ids
            text.append(chunk.text)
            if logprobs is not None:
                logprobs += chunk.logprobs or []
        return Generation(token_ids, "".join(text), chunk.finish_reason, chunk.stats, len(prompt_ids), logprobs)

    async def stream(self, prompt_ids: Sequence[int], params: SamplingParams, tree: TreeConfig | None = None,
                     interval_s: float | None = None) -> AsyncIterator[StreamChunk]:
        """The request's chunks (at most one per interval_s after the first; None: stream_interval_s); the last has
        finish_reason and the whole request's stats."""
        interval_s = self.stream_interval_s if interval_s is None else interval_s
        prompt = [int(t) for t in prompt_ids]
        self.check_length(len(prompt), params)
        generated: list[int] = []
        deadline = None
        self.in_flight += 1
        try:
            while True:
                before = len(generated)  # tokens streamed by replicas lost earlier: the next goes on from them
                try:
                    async for item in self.engine.generate(prompt + generated, params, tree, interval_s, before):
                        if isinstance(item, dict):
                            raise (ServiceUnavailable(item["message"]) if item["error"] == 503
                                   else RequestError(item["error"], item["message"]))  # fmt: skip
                        generated += item.token_ids
                        if item.finish_reason is not None and item.stats is not None:
                            item.stats.new_tokens += before
                        yield item
                        if item.finish_reason is not None:
                            return
                    raise RuntimeError("the engine's stream ended without a finish reason")
                except RequestError:
                    raise
                except Exception as exc:
                    if not self.lost(exc):
                        raise
                    deadline = deadline or time.monotonic() + self.retry_s
                    if time.monotonic() >= deadline:
                        raise ServiceUnavailable("the model's replicas are unavailable; retry later") from exc
                    self.continued += 1
                    logger.warning("a replica was lost mid-request (%s); continuing from %d generated tokens",
                                   type(exc).__name__, len(generated))  # fmt: skip
                    await asyncio.sleep(RETRY_PAUSE_S)
        finally:
            self.in_flight -= 1

