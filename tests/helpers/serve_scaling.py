"""A Serve autoscaling policy the test sets by hand: the replica count written in a file (imports nothing: Serve's
controller unpickles it by value)."""

from __future__ import annotations

from pathlib import Path


class ReplicasFromFile:
    """Serve's autoscaling policy (policy_kwargs {"path": ...}): the count in `path`, the context's own count where
    the file holds none."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, ctx) -> tuple[int, dict]:
        try:
            return int(Path(self.path).read_text()), {}
        except (OSError, ValueError):
            return ctx.target_num_replicas, {}
