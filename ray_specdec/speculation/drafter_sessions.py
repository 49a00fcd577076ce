"""A request's drafter, paid for only in rounds that draft: its session (a prefill over the context) is built on the
request's first drafted round, and verdicts wait for the next draft (one sequence pass over their tokens)."""

from __future__ import annotations

from typing import Sequence

from ray_specdec.models.device_clock import now
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.drafter.mamba_state import StateSlots
from ray_specdec.speculation.acceptance import Verdict
from ray_specdec.speculation.drafter_cache import DrafterStates
from ray_specdec.speculation.drafting import DrafterSession, commit_many


class LazyDrafter:
    """One request's drafter, paid for only in rounds that draft.

    The `DrafterSession` is built (a prefill over every token so far) on the request's first drafted round, so a
    request whose rounds all go undrafted never runs the drafter. Verdicts wait until the next draft and go through
    the drafter in one `commit_all` (one sequence pass over their tokens).
    """

    def __init__(self, drafter: MambaDrafter, vocab_size: int, states: DrafterStates | None = None,
                 slots: StateSlots | None = None):
        """states: the drafter's prefix cache; slots: the slot pool its root state lives in (DrafterSession)."""
        self.drafter, self.vocab_size, self.states, self.slots = drafter, vocab_size, states, slots
        self.session: DrafterSession | None = None
        self.pending: list[Verdict] = []  # verdicts since the last draft, that draft's own first

    @property
    def started(self) -> bool:
        """Whether its session exists (else its next draft pays a prefill)."""
        return self.session is not None

    def ready(self, tokens: Sequence[int]) -> float:
        """Bring the session up to date before a draft: -> seconds spent on a first prefill (0 if none).

        The prefill is timed with the device idle at both ends (device_clock): on CUDA its kernels would otherwise
        be counted at their launch cost, the speculation controller would take drafter prefills for nearly free, and
        their device time would land in the step that next waits."""
        return ready_many([(self, tokens)])[0]

    def _start(self, tokens: Sequence[int]) -> float:
        device = self.drafter.device
        t0, hits = now(device), self.states.hits if self.states is not None else 0
        self.session = DrafterSession(self.drafter, tokens, self.vocab_size, self.states, self.slots)
        self.pending = []
        if self.states is not None and self.states.hits > hits:
            return 0.0  # a kept state, copied: no prefill to pay or to measure
        return now(device) - t0

    def commit(self, verdict: Verdict) -> None:
        if self.session is not None:
            self.pending.append(verdict)

    def close(self) -> None:
        """The request is done: its drafter slot is free at once."""
        if self.session is not None:
            self.session.close()


def ready_many(drafters: Sequence[tuple[LazyDrafter, Sequence[int]]]) -> list[float]:
    """`LazyDrafter.ready` of several requests' drafters (each at most once) -> seconds each spent on a first prefill.
    The verdicts waiting in those with a session go through the drafter together (drafting.commit_many: one native
    call for all of them)."""
    seconds = [lazy._start(tokens) if lazy.session is None else 0.0 for lazy, tokens in drafters]
    commit_many([(lazy.session, lazy.pending) for lazy, _ in drafters if lazy.pending])
    for lazy, _ in drafters:
        lazy.pending = []
    return seconds
