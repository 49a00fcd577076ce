"""A test drafter that agrees with the target: it proposes the target's own (optionally noised) choices."""

from __future__ import annotations

import torch


class EchoState:
    def __init__(self, rows):
        self.rows = rows

    def row_slice(self, start, stop):
        return EchoState(self.rows[start:stop] if isinstance(self.rows, list) else stop - start)

    @staticmethod
    def cat(states):
        if len(states) == 1:
            return states[0]
        if all(isinstance(s.rows, list) for s in states):
            return EchoState([row for s in states for row in s.rows])
        return EchoState(sum(s.rows for s in states))


class TargetEchoDrafter:
    """A test drafter with the MambaDrafter interface that proposes the target's own (optionally noised) choices.

    Random tiny Mamba drafters rarely agree with random tiny targets; this one agrees often, so deep acceptance,
    full-path acceptance and the leaf commit are exercised too.
    """

    def __init__(self, hf_model, noise: float):
        self.model, self.noise = hf_model, noise
        self.device, self.prefill_window = torch.device("cpu"), None
        self.vocab_size = hf_model.config.vocab_size

    @property
    def steps_row_invariant(self) -> bool:
        return False  # rows of different requests have different lengths: drafted one request at a time

    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """rows: equally long token lists (true at every drafting depth) -> logits [rows, V], one batched forward."""
        with torch.no_grad():
            logits = self.model(torch.tensor(rows)).logits[:, -1].double()
        if self.noise:
            noise = [torch.randn(logits.shape[-1], dtype=torch.float64,
                                 generator=torch.Generator().manual_seed(hash(tuple(r)) % (2**31))) for r in rows]
            logits = logits + self.noise * torch.stack(noise)
        return logits

    def prefill(self, ids):
        rows = [list(map(int, ids))]
        return EchoState(rows), self._logits(rows)[0]

    def copy_rows(self, state, index):
        return EchoState([list(state.rows[i]) for i in index.tolist()])

    def step(self, state, tokens):
        for row, t in zip(state.rows, tokens.tolist()):
            row.append(int(t))
        return self._logits(state.rows)

    def extend(self, state, ids):
        state.rows[0].extend(int(t) for t in ids.tolist())
        return self._logits(state.rows)[0]
