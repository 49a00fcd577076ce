"""How the drafter pool scales (drafters=remote): on the share of its time each replica spends drafting.

Serve's default policy scales a deployment on the calls in flight per replica. An engine sends one call per drafter
replica per step however many requests it drafts there, so that count measures the drafting share of an engine's
step, not the load: the pool stays where it is while the clients grow.

Here each replica measures its own load (`BusyMeter`): over the last `window_s`, the seconds it spent drafting per
second (its busy fraction, 0 to 1: its calls run one at a time), and the requests and tree rows it drafted per
second. The `drafter` deployment's `record_autoscaling_stats` hands them to Serve's controller as custom autoscaling
metrics (`drafter_busy`, `drafter_requests_per_s`, `drafter_rows_per_s`), which it averages per replica over
`look_back_period_s`, and `DrafterBusyPolicy`, the pool's autoscaling policy, sizes the pool from the busy fractions:

- B = the replicas' busy fractions summed: the replicas' worth of drafting the load takes;
- up to ceil(B / target) where that is more than the pool's target count n (each replica busier than `target`);
- down to ceil(B / low) where that is less than n, low = target * (1 - band): a smaller pool must stay below `low`
  a replica, so that the step down does not call for a step up (the hysteresis);
- else n; always within the capacity-adjusted min_replicas and max_replicas, and n where no replica has reported yet.

Serve then applies its own upscale_delay_s and downscale_delay_s (and scaling factors) to the count returned. The
policy is a class so that its target and band come as the policy's `policy_kwargs`; Serve's controller unpickles it
by value, so this module imports neither torch nor the project.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any, Callable

BUSY = "drafter_busy"
REQUESTS_PER_S = "drafter_requests_per_s"
ROWS_PER_S = "drafter_rows_per_s"
# The policy's import path (AutoscalingPolicy.policy_function): the drafter pool's default under autoscaling.
POLICY = "deployments.drafter_scaling:DrafterBusyPolicy"


class BusyMeter:
    """A replica's drafting over the last `window_s`: busy fraction, requests and rows drafted per second. Spans do
    not overlap (the replica drafts one call at a time); `stats` may be read from another thread."""

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.clock = window_s, clock
        self.born = clock()
        self._spans: deque[tuple[float, float, int, int]] = deque()  # (start, end, requests, rows), oldest first
        self._open: float | None = None  # the start of the span under way
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            self._open = self.clock()

    def stop(self, requests: int, rows: int) -> None:
        """The span under way ended, having drafted `requests` requests, `rows` tree rows in all."""
        with self._lock:
            if self._open is not None:
                self._spans.append((self._open, self.clock(), requests, rows))
                self._open = None

    def stats(self) -> dict[str, float]:
        """{BUSY, REQUESTS_PER_S, ROWS_PER_S} over the window (or the replica's life, where shorter)."""
        with self._lock:
            now = self.clock()
            since = now - self.window_s
            while self._spans and self._spans[0][1] <= since:
                self._spans.popleft()
            busy = sum(end - max(start, since) for start, end, _, _ in self._spans)
            if self._open is not None:
                busy += now - max(self._open, since)
            elapsed = min(self.window_s, now - self.born)
            requests = sum(n for *_, n, _ in self._spans)
            rows = sum(r for *_, r in self._spans)
        if elapsed <= 0:
            return {BUSY: 0.0, REQUESTS_PER_S: 0.0, ROWS_PER_S: 0.0}
        return {BUSY: min(1.0, busy / elapsed), REQUESTS_PER_S: requests / elapsed, ROWS_PER_S: rows / elapsed}


def pool_size(busy: float, current: int, target: float, band: float) -> int:
    """The replicas for `busy` replicas' worth of drafting in a pool of `current` (the module docstring)."""
    up = math.ceil(busy / target - 1e-9)
    if up > current:
        return up
    down = math.ceil(busy / (target * (1.0 - band)) - 1e-9)
    return down if down < current else current


class DrafterBusyPolicy:
    """Serve's autoscaling policy for the `drafter` deployment: its replica count from their busy fractions (the
    module docstring). Called with Serve's AutoscalingContext -> (replicas, policy state)."""

    def __init__(self, target: float = 0.6, band: float = 0.25):
        """target: the busy fraction a replica should stay under (0 < target <= 1); band: how far below the target
        (a fraction of it) a smaller pool must stay before the pool shrinks (0 <= band < 1)."""
        if not 0.0 < target <= 1.0 or not 0.0 <= band < 1.0:
            raise ValueError(f"DrafterBusyPolicy needs 0 < target <= 1 and 0 <= band < 1, got {target}, {band}")
        self.target, self.band = target, band

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        current = ctx.target_num_replicas
        busy = (ctx.aggregated_metrics or {}).get(BUSY) or {}
        state: dict[str, Any] = {}
        if not busy:  # no replica has reported: the count stands
            desired = current
        else:
            total = sum(min(1.0, max(0.0, float(v))) for v in busy.values())
            desired = pool_size(total, current, self.target, self.band)
            state[BUSY] = total
        low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        return max(low, min(high, desired)), state
