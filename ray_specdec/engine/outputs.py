"""What the engine hands back: a streamed chunk per round (`StreamChunk`) and a finished generation (`Generation`).

The in-process engine, the CLI, the benchmark and the serving loop all produce or consume these.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_specdec.engine.stats import GenerationStats
from ray_specdec.speculation.logits_processing import TokenLogprob


@dataclass
class StreamChunk:
    token_ids: list[int]  # tokens kept this round
    text: str  # text delta
    finish_reason: str | None
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per kept token, when the request asks (params.logprobs)


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    prompt_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asks (params.logprobs)
