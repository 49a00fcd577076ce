"""The HTTP side's settings (`ServingConfig`): what the OpenAI server (serving/openai_server.py) and the router
(serving/router.py) do with a request beyond generating it."""

from __future__ import annotations

from dataclasses import dataclass

from ray_specdec.settings import bounded, check_bounds


@dataclass(frozen=True)
class ServingConfig:
    """The HTTP side's settings: part of `engine.config.EngineConfig`, arguments of the app (deployments/app.py)."""

    request_timeout_s: float = bounded(600.0, gt=0)  # a request still running after this gets 504 (streams: an error)
    retry_s: float = bounded(60.0, ge=0)  # how long a request whose engine replica died waits for another
    # when set (or RAY_SPECDEC_API_KEY is), /v1/* needs "Authorization: Bearer <api_key>" (401 otherwise); /health
    # stays open
    api_key: str | None = None
    # streamed responses send a chunk at most this often after the first token (the rounds in between are merged):
    # each chunk costs CPU in the engine, router and HTTP proxy processes (docs/BENCHMARKS.md); 0: one per round
    stream_interval_s: float = bounded(0.2, ge=0)

    def __post_init__(self) -> None:
        check_bounds(self)
