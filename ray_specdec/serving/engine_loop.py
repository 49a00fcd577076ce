"""The scheduler behind an asyncio service: one thread steps it, requests stream their chunks back, without Ray.

`EngineLoop.generate(...)` is an async iterator of a request's `StreamChunk`s. One worker thread owns the scheduler:
it takes new requests and aborts from an inbox between steps, runs `Scheduler.step()` while any request is in flight
and hands each step's chunks to the requests' asyncio queues (merged to one per `interval_s`, one wake-up of the
event loop per step), so the event loop never waits for a step. A request
whose consumer goes away (client disconnect, cancellation, timeout) is aborted: its KV is freed with the next step.
So there is no per-request table with idle eviction or LRU (as the per-request drafter and target sessions of earlier
versions needed, and a cache library would give): a request's state lives in the scheduler exactly as long as the
request, and leaves it by finishing or by this abort.

Faults. A step that raises is a target fault (a tensor-parallel rank died, a GPU error). The loop asks `recover`
(restart the ranks; None when there is nothing to restart) and, once the target is back, moves every running request
back to prefill over its token ids (`Scheduler.reset_target`): they finish with the tokens they would have produced.
If recovery fails or takes longer than `recover_timeout_s`, every request in flight fails with `TargetUnavailable`
(HTTP 503 with Retry-After), and `healthy` stays False until a recovery succeeds.

Metrics. `metrics` (serving/metrics.py) records every request's arrival, admission, rounds and end, and the
scheduler's state after each step, on the loop's thread; the speculation controller's state and the target's KV pool
(where its caches are pooled) at most once per REPORT_S while steps run, and when the work runs out (also in
`stats()["speculation"]` and `stats()["kv_pool"]`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.outputs import StreamChunk
from ray_specdec.engine.request import QueueFull
from ray_specdec.engine.scheduler import Scheduler
from ray_specdec.serving.metrics import EngineMetrics
from ray_specdec.serving.thread_priority import ComputeFirst

logger = logging.getLogger(__name__)


# How often, at most, the controller's state and the KV pool's are copied out for the metrics and stats (the cost
# model's weights solve a small system, the pool's four numbers take its lock: cheap, but not for every step).
REPORT_S = 1.0


class TargetUnavailable(RuntimeError):
    """The target failed and did not come back in time (HTTP 503, retry later)."""


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    interval_s: float = 0.0
    due: float = -math.inf  # (the loop's thread) when the next chunk may go out
    held: StreamChunk | None = None  # (the loop's thread) rounds merged until the chunk is due


class EngineLoop:
    def __init__(
        self,
        scheduler: Scheduler | Callable[[], Scheduler],
        recover: Callable[[], None] | None = None,
        recover_timeout_s: float = 120.0,
        on_step: Callable[[Scheduler, float], None] | None = None,
        compute_first: bool = False,
    ):
        """scheduler: the scheduler, or a function that builds it on the loop's thread (the constructor waits for it
        and raises what it raised). Build the models there: on CPU, torch's intra-op (OpenMP) threads serve one
        thread well, the first to run parallel work; once a second thread runs some, both pay a wake-up for every
        parallel operation (measured here, 2 cores: an elementwise add 8 us -> 100 us on the second thread, a whole
        decode 230 -> 130 tokens/s). recover: brings a failed target back (raises if it cannot);
        on_step(scheduler, seconds): after each step (a hook for tests and tools). compute_first: the process's
        other threads at the lowest priority below the loop's and its OpenMP team's (serving/thread_priority.py;
        for a serving process whose target computes on this thread, on CPU)."""
        built: list = []
        ready = threading.Event()
        if isinstance(scheduler, Scheduler):
            built.append(scheduler)
            ready.set()
        self.recover = recover
        self.recover_timeout_s = recover_timeout_s
        self.on_step = on_step
        self.compute_first = compute_first
        self.priority: ComputeFirst | None = None  # set on the loop's thread when compute_first holds
        self.healthy = True
        self.metrics = EngineMetrics()
        self.faults = 0  # steps that raised
        self.recoveries = 0
        self.speculation_summary: dict | None = None  # the speculation controller's state as last copied out
        self._reported_at = -math.inf
        self._wake = threading.Condition()
        self._inbox: deque[tuple] = deque()
        self._streams: dict[str, _Stream] = {}  # read by the loop's thread, written by the event loop's
        self._stopped = False
        self._thread = threading.Thread(target=self._run, args=(scheduler, built, ready), name="engine-loop",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        ready.wait()
        if isinstance(built[0], BaseException):
            raise built[0]
        self.scheduler: Scheduler = built[0]  # the thread's own reference, set before it steps
        self._observe(time.monotonic())  # gauges from the start

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, tree: TreeConfig | None = None,
        interval_s: float = 0.0, resumed: int = 0,
    ) -> AsyncIterator[StreamChunk]:
        """The request's chunks; the last has finish_reason set. Raises the scheduler's RequestTooLarge / QueueFull
        before the first chunk, TargetUnavailable on a lost target.

        interval_s: after the first chunk, rounds are merged into one chunk per this many seconds (math.inf: only
        the last). Every chunk a server relays costs CPU in each process it crosses (here: engine, router, HTTP
        proxy), which on a small machine the target's forward would otherwise have; the first token is never held.
        resumed: the last this many prompt tokens were generated by this request before (Scheduler.add)."""
        arrival = time.monotonic()
        if not self.healthy:
            raise TargetUnavailable("the target is recovering from a fault; retry later")
        self.scheduler.check(len(prompt_ids) - resumed, params, tree)  # one that can never run fails here, at once
        # a full queue fails here, at once; a request still in the inbox is not counted (it may be an abort, or an
        # add that will run at once): scheduler.add, on the loop's thread, has the last word
        if self.scheduler.num_waiting >= self.scheduler.config.max_waiting > 0:
            raise QueueFull(f"{self.scheduler.num_waiting} requests are waiting (max_waiting); retry later")
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop(), interval_s)
        self._streams[request_id] = stream
        self._send(("add", request_id, list(prompt_ids), params, tree, arrival, resumed))
        try:
            while True:
                item = await _next(stream.queue)
                while item.finish_reason is None:  # a slow consumer: what came meanwhile goes out as one chunk
                    later = await _next(stream.queue, wait=False)
                    if later is None:
                        break
                    item = _merged(item, later)
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self._streams.pop(request_id, None)
            self._send(("abort", request_id))

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def _send(self, command: tuple) -> None:
        """Requests enter and leave the scheduler on the loop's thread, between steps (the event loop never waits
        for a step)."""
        with self._wake:
            self._inbox.append(command)
            self._wake.notify()

    def stats(self) -> dict:
        s = self.scheduler
        return {"running": s.num_running, "waiting": s.num_waiting, "kv_reserved": s.reserved,
                "kv_budget": s.config.kv_budget_tokens, "kv_waits": s.kv_waits, "kv_waited": s.kv_waited,
                "steps": s.steps, "faults": self.faults, "recoveries": self.recoveries, "healthy": self.healthy,
                "speculation": self.speculation_summary, "kv_pool": getattr(s.target, "kv_pool", None)}  # fmt: skip

    def _run(self, scheduler, built: list, ready: threading.Event) -> None:
        if not ready.is_set():
            try:
                built.append(scheduler())
            except BaseException as exc:
                built.append(exc)
                return
            finally:
                ready.set()
        self.scheduler = built[0]
        if self.compute_first:
            self.priority = ComputeFirst.start()
        while True:
            with self._wake:
                while not self._stopped and not self._inbox and not self.scheduler.has_work:
                    self._wake.wait()
                if self._stopped:
                    return
                commands, self._inbox = self._inbox, deque()
            for command in commands:
                try:
                    self._apply(command)
                except Exception as exc:  # an abort that freed its cache on a failed target
                    self._fault(exc)
            if commands:  # (else nothing changed since the last look, after the last step)
                self._observe(time.monotonic())
            if not self.scheduler.has_work:
                continue
            t0, start = time.perf_counter(), time.monotonic()
            try:
                outputs = self.scheduler.step()
            except Exception as exc:
                # rounds taken before the failure are in their requests' tokens: their chunks go out first (a
                # request that finished in them has left the scheduler, and nothing else would answer it)
                self._produced(getattr(exc, "step_outputs", []), time.monotonic())
                self._fault(exc)
                self._observe(time.monotonic())
                continue
            end = time.monotonic()
            self._observe(start)  # a step admits first
            self._produced(outputs, end)
            self._report(end)
            if self.priority is not None:
                self.priority.refresh()
            if self.on_step is not None:
                self.on_step(self.scheduler, time.perf_counter() - t0)

    def _produced(self, outputs, now: float) -> None:
        for out in outputs:
            chunk = out.chunk
            self.metrics.produced(out.request_id, len(chunk.token_ids), chunk.finish_reason, chunk.stats, now)
        self._hand_out(outputs, now)

    def _apply(self, command: tuple) -> None:
        if command[0] == "abort":
            if self.scheduler.abort(command[1]):
                self.metrics.ended(command[1], "abort", time.monotonic())
            return
        _, request_id, prompt_ids, params, tree, arrival, resumed = command
        if request_id not in self._streams:  # its consumer left before it was added
            return
        try:
            self.scheduler.add(request_id, prompt_ids, params, tree, resumed)
        except Exception as exc:  # validated before: only a race (a full queue) lands here
            self._deliver(request_id, exc)
            return
        self.metrics.arrived(request_id, len(prompt_ids), arrival)

    def _observe(self, admitted_at: float) -> None:
        """The scheduler's state, and the requests admitted since the last look (at `admitted_at`)."""
        s = self.scheduler
        self.metrics.admissions((r.request_id for r in s.waiting), admitted_at)
        self.metrics.scheduler_state(s.num_running, s.num_waiting, s.reserved, s.config.kv_budget_tokens, s.kv_waited)
        if s.prefix is not None:
            self.metrics.prefix_cache(s.prefix.queried_rows, s.prefix.hit_rows)

    def _report(self, now: float) -> None:
        """The speculation controller's state and the KV pool's to the metrics (the controller's to the stats too): at
        most once per REPORT_S, and when the work runs out (so an idle replica shows its last state)."""
        if now - self._reported_at < REPORT_S and self.scheduler.has_work:
            return
        self._reported_at = now
        self.speculation_summary = self.scheduler.controller.summary()
        self.metrics.speculation(self.speculation_summary)
        pool = getattr(self.scheduler.target, "kv_pool", None)
        if pool is not None:
            self.metrics.kv_pool(pool)

    def _hand_out(self, outputs, now: float) -> None:
        """A step's chunks to their streams: a round whose chunk is not due yet is held and merged with the next
        (the first chunk and the last are never held), and each event loop is woken once for all of its streams'
        chunks. An event loop woken per request and step would contend with this thread for the GIL every step."""
        due: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            item = out.chunk if stream.held is None else _merged(stream.held, out.chunk)
            if item.finish_reason is None and now < stream.due:
                stream.held = item
                continue
            stream.held, stream.due = None, now + stream.interval_s
            due.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in due.items():
            _wake(loop, _put_all, items)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            _wake(stream.loop, stream.queue.put_nowait, item)

    def _fault(self, exc: Exception) -> None:
        """Recover the target and re-prefill every running request, or fail them all (on the loop's thread)."""
        self.faults += 1
        self.healthy = False
        logger.error("a step failed (%s: %s)", type(exc).__name__, exc)
        deadline = time.monotonic() + self.recover_timeout_s
        while self.recover is not None and time.monotonic() < deadline:
            try:
                self.recover()
                self.scheduler.reset_target()  # (a restarted rank may fail again here: recovered anew, or given up)
            except Exception as again:
                logger.error("target recovery failed (%s: %s)", type(again).__name__, again)
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                continue
            self.recoveries += 1
            self.healthy = True
            logger.warning("the target recovered; %d requests are prefilled again", self.scheduler.num_running)
            return
        error = TargetUnavailable(f"the target failed ({type(exc).__name__}: {exc}) and did not recover")
        doomed = list(self.scheduler.running) + [r.request_id for r in self.scheduler.waiting]
        for request_id in doomed:
            self._deliver(request_id, error)
            self.metrics.ended(request_id, "error", time.monotonic())
        try:  # every request leaves the scheduler before its caches are released on the failed target, which may fail
            for request_id in doomed:
                self.scheduler.abort(request_id)
            self.scheduler.reset_target()
        except Exception as again:
            logger.error("the failed target's caches were not released (%s: %s)", type(again).__name__, again)
        self.healthy = self.recover is None  # nothing to restart: the next request tries again


def _wake(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """callback(*args) on `loop`, from the loop's thread. A caller's event loop that closed under its stream (an
    offline caller's asyncio.run ending: its stream's abort is on its way) gets nothing: raising here would end the
    thread that steps every request."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # "Event loop is closed"
        logger.debug("a chunk for a closed event loop was dropped")


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _merged(first: StreamChunk, then: StreamChunk) -> StreamChunk:
    """Two consecutive chunks of a request as one."""
    logprobs = None if first.logprobs is None else [*first.logprobs, *then.logprobs]
    return StreamChunk(first.token_ids + then.token_ids, first.text + then.text, then.finish_reason, then.stats,
                       logprobs)


async def _next(queue: asyncio.Queue, wait: bool = True) -> StreamChunk | None:
    """The next chunk (raising what the loop delivered instead); without `wait`, only one already there, else
    None."""
    if not wait and queue.empty():
        return None
    item = await queue.get() if wait else queue.get_nowait()
    if isinstance(item, BaseException):
        raise item
    return item
