"""Drafter workers in this process behind a `DrafterTransport`, with the faults a Serve deployment can have: a call
that fails, a worker that loses every session, a worker replaced by a fresh one."""

from __future__ import annotations

import pickle

from ray_specdec.speculation.drafter_worker import DraftCall, DrafterWorker


class InProcessTransport:
    """Workers by name; a shard goes to the next worker in turn the first time it is sent (as Serve places a
    multiplexed model id), then stays there. Calls and replies go through pickle, as over Ray."""

    def __init__(self, workers: dict[str, DrafterWorker]):
        self.workers = workers
        self.placed: dict[int, str] = {}
        self.fail: set[str] = set()  # workers whose calls fail (until removed)
        self.refuse: set[str] = set()  # workers to which a call cannot be sent: submit raises
        self.steps: list[list[tuple[str, bool]]] = []  # per collect: (worker, whether its shard was placed before)
        self._submitted: list[tuple[str, bool]] = []
        self.drafted: list[int] = []  # per collect: requests that got a draft
        self.served: dict[int, int] = {}  # id of a worker -> drafts it gave
        self._drafted = 0
        self.before_call = None  # called with the number of collects so far, before each submit (fault injection)

    def submit(self, shard: int, call: DraftCall):
        if self.before_call is not None:
            self.before_call(len(self.steps))
        placed = shard in self.placed
        if not placed:
            self.placed[shard] = list(self.workers)[len(self.placed) % len(self.workers)]
        name = self.placed[shard]
        self._submitted.append((name, placed))
        if name in self.refuse:
            raise RuntimeError(f"no route to drafter worker {name}")
        if name in self.fail:
            return ConnectionError(f"drafter worker {name} is gone")
        replies = self.workers[name].draft(pickle.loads(pickle.dumps(call)))
        drafts = sum(reply.draft is not None for reply in replies)
        self._drafted += drafts
        self.served[id(self.workers[name])] = self.served.get(id(self.workers[name]), 0) + drafts
        return name, pickle.loads(pickle.dumps(replies))

    def collect(self, pending, timeout_s: float):
        self.steps.append(self._submitted)
        self._submitted = []
        self.drafted.append(self._drafted)
        self._drafted = 0
        return list(pending)

    def timings(self, timeout_s: float):
        return next(iter(self.workers.values())).timings()
