"""A contextual multi-armed bandit over tree configs, shared by all router replicas.

The engine only sees a `TreePolicy` (speculation/tree_policy.py: `select(context_len, load=...)`,
`record(tree, context_len, accepted_tokens, round_time_s, load=...)`).
`Bandit` implements it for one process and is the router-side client of a `BanditHub` (the shared side, one Ray actor
in deployments/); `BanditState` is the pure data that moves between them and is persisted to disk.
"""

from ray_specdec.speculation.bandit.client import (
    DEFAULT_ARMS,
    DEFAULT_BUCKET_EDGES,
    DEFAULT_LOAD_EDGES,
    Bandit,
    BanditConfig,
    BanditHub,
    summarize,
)
from ray_specdec.speculation.bandit.policies import UCB1, DiscountedUCB, GaussianThompson, PaperReward, ThroughputReward
from ray_specdec.speculation.bandit.state import BanditState, bucket_labels, load_labels

__all__ = [
    "DEFAULT_ARMS",
    "DEFAULT_BUCKET_EDGES",
    "DEFAULT_LOAD_EDGES",
    "Bandit",
    "BanditConfig",
    "BanditHub",
    "BanditState",
    "DiscountedUCB",
    "GaussianThompson",
    "PaperReward",
    "ThroughputReward",
    "UCB1",
    "bucket_labels",
    "load_labels",
    "summarize",
]
