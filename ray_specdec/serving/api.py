"""The HTTP API's request models (pydantic, extra="forbid") and OpenAI-style response bodies, without Ray.

`POST /v1/completions` takes `CompletionRequest`; the response is `completion_body`, or with stream=true a series
of `chunk_body` server-sent events closed by `data: [DONE]`. Every response carries `usage` and a `speculative`
block (rounds, mean accepted length, acceptance per depth, tree configs used).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.stats import GenerationStats

MAX_STOP_STRINGS = 8
MAX_TREE_NODES = 256  # a client may pick a tree per request, but not one that makes every verify huge


class CompletionRequest(BaseModel):
    """Body of POST /v1/completions (OpenAI's completions API, plus `tree`)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(64, ge=1, le=1_000_000)
    temperature: float = Field(0.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, le=2**62)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stream: bool = False
    tree: str | None = None  # "3,2,2,1,1" fixes this request's tree; "none" turns drafting off

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings")
        return stops

    @field_validator("tree")
    @classmethod
    def _check_tree(cls, tree: str | None) -> str | None:
        if tree is None:
            return None
        config = TreeConfig.parse(tree)  # ValueError -> 422 with its message
        if config.num_nodes > MAX_TREE_NODES:
            raise ValueError(f"tree {config} has {config.num_nodes} nodes (max {MAX_TREE_NODES} per request)")
        return str(config)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            max_new_tokens=self.max_tokens,
            stop=tuple(self.stop),
        )

    def tree_config(self) -> TreeConfig | None:
        return None if self.tree is None else TreeConfig.parse(self.tree)


def new_completion_id() -> tuple[str, int]:
    """(id, created): the OpenAI-style identity of one completion."""
    return f"cmpl-{uuid.uuid4().hex}", int(time.time())


def speculative_block(stats: GenerationStats) -> dict[str, Any]:
    return {
        "rounds": stats.rounds,
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "acceptance_per_depth": [round(a, 4) for a in stats.acceptance_per_depth],
        "trees": dict(stats.trees),
    }


def usage_block(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    completion_id: str,
    created: int,
    model: str,
    text: str,
    token_ids: list[int],
    finish_reason: str,
    prompt_tokens: int,
    stats: GenerationStats,
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "token_ids": token_ids}],
        "usage": usage_block(prompt_tokens, len(token_ids)),
        "speculative": speculative_block(stats),
    }


def chunk_body(
    completion_id: str,
    created: int,
    model: str,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    final: tuple[int, int, GenerationStats] | None = None,
) -> dict[str, Any]:
    """One streamed chunk; the last one (final = (prompt_tokens, completion_tokens, stats)) adds usage and stats."""
    body = {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "token_ids": token_ids}],
    }
    if final is not None:
        prompt_tokens, completion_tokens, stats = final
        body["usage"] = usage_block(prompt_tokens, completion_tokens)
        body["speculative"] = speculative_block(stats)
    return body


def sse(body: dict[str, Any] | str) -> str:
    """One server-sent event line pair."""
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Pydantic/FastAPI validation errors -> (one readable message, the first offending field)."""
    parts, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = ".".join(loc) or "body"
        param = param or (field if loc else None)
        msg = err.get("msg", "invalid value")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{field}: {msg}")
    return "; ".join(parts) or "invalid request", param
