"""The OpenAI API's edge, without Ray: request models (pydantic, extra="forbid") and response bodies.

`POST /v1/completions` takes `CompletionRequest`; the response is `completion_body`, or with stream=true the bodies
of a `CompletionStream` as server-sent events (`sse`) closed by `data: [DONE]`. Chat lives in openai_chat.py on the
same pieces. Choices are numbered prompt-major: prompt p, sample j of n -> index p * n + j. Bodies add this
project's `speculative` block (rounds, mean accepted length, acceptance per depth, trees used) to non-stream bodies
and to each choice's last chunk, and `token_ids` to each choice.

Responses are plain dicts in OpenAI's shapes, and the tests validate every one against the `openai` package's own
types (`Completion`, `ChatCompletion`, `ChatCompletionChunk`, `Model`). Building them from those types instead would
make a client SDK a server dependency and cannot express what OpenAI itself streams: its `Completion` requires a
`finish_reason`, while every streamed completions chunk but the last has none.

SSE framing stays `sse` (two lines): Starlette's StreamingResponse already sends the bytes, and an SSE library's
event/id/retry fields are not part of OpenAI's stream.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections import defaultdict
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ray_specdec.config import MAX_LOGPROBS, SamplingParams, TreeConfig
from ray_specdec.engine.outputs import Generation, StreamChunk
from ray_specdec.engine.stats import GenerationStats
from ray_specdec.serving.token_bytes import token_bytes
from ray_specdec.speculation.logits_processing import TokenLogprob

MAX_STOP_STRINGS = 8
MAX_TREE_NODES = 256  # a client may pick a tree per request, but not one that makes every verify huge
MAX_N = 16
MAX_PROMPTS = 32
MIN_LOGPROB = -9999.0  # JSON has no -inf: a masked alternative's logprob is sent as this (vLLM does the same)
UNSUPPORTED = "unsupported"  # the pydantic error type of a field this server refuses ("... is not supported yet")

# OpenAI's defaults where a request leaves a field out; a model's generation config overrides them
# (`generation_defaults`). Chat's max_tokens default is the room left in the context instead.
OPENAI_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0,
                                   "max_tokens": 16}  # fmt: skip


def unsupported(field: str, detail: str = "") -> PydanticCustomError:
    return PydanticCustomError(UNSUPPORTED, "{field} is not supported yet{detail}", {"field": field, "detail": detail})


def unencodable_text(value: Any) -> str | None:
    """The path (`messages.0.content`) of the first string in a parsed JSON value that UTF-8 cannot encode, else
    None."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(item, dict):
            stack += [(f"{path}.{key}" if path else str(key), v) for key, v in reversed(item.items())]
            stack += [(path, key) for key in item if isinstance(key, str)]
        elif isinstance(item, list):
            stack += [(f"{path}.{i}" if path else str(i), v) for i, v in reversed(list(enumerate(item)))]
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool = True  # random padding against length side channels; nothing to pad here


class SamplingRequest(BaseModel):
    """The fields completions and chat share: OpenAI's, then this project's extensions (top_k ... tree)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # OpenAI's: any int64
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = None  # OpenAI sends token ids as strings: {"50256": -100}
    user: str | None = None  # accepted for compatibility; nothing is tracked per user
    top_k: int | None = Field(None, ge=-1)  # -1 (vLLM) or 0: off
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    tree: str | None = None  # "3,2,2,1,1" fixes this request's tree; "none" turns drafting off

    @model_validator(mode="before")
    @classmethod
    def _check_text(cls, data: Any) -> Any:
        """JSON's "\\ud800" escapes decode to lone surrogates, which neither a tokenizer nor a UTF-8 response can
        take: such a request is refused (400) naming the field, before anything reads it. A known field sent as
        null takes its default, as OpenAI's API reads it (the openai client sends `n=None` as null)."""
        where = unencodable_text(data)
        if where is not None:
            raise ValueError(f"{where or 'body'} is not valid Unicode text (a lone surrogate such as \\ud800)")
        if isinstance(data, dict) and None in data.values():
            data = {key: value for key, value in data.items() if value is not None or key not in cls.model_fields}
        return data

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings")
        return stops

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, seed: int | None) -> int | None:
        """An int64, negative ones too (as OpenAI takes them), onto the non-negative seeds torch's generators take."""
        return None if seed is None else seed % 2**63

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[int, float] | None) -> dict[int, float] | None:
        for token, value in (bias or {}).items():
            if token < 0 or not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {token}: {value}")
        return bias

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, ids: list[int] | None) -> list[int] | None:
        if any(t < 0 for t in ids or []):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {ids}")
        return ids

    @field_validator("tree")
    @classmethod
    def _check_tree(cls, tree: str | None) -> str | None:
        if tree is None:
            return None
        config = TreeConfig.parse(tree)  # ValueError -> 400 with its message
        if config.num_nodes > MAX_TREE_NODES:
            raise ValueError(f"tree {config} has {config.num_nodes} nodes (max {MAX_TREE_NODES} per request)")
        return str(config)

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return options

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def tree_config(self) -> TreeConfig | None:
        return None if self.tree is None else TreeConfig.parse(self.tree)

    def _params(self, max_tokens: int | None, logprobs: int | None, defaults: Mapping[str, Any] | None,
                room: int | None = None) -> SamplingParams:
        """room: the context left after the prompt, chat's max_tokens when neither the request nor defaults set one."""
        pick = {**OPENAI_DEFAULTS, **(defaults or {})}
        if room is not None and "max_tokens" not in (defaults or {}):
            pick["max_tokens"] = room
        max_tokens = pick["max_tokens"] if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise ValueError(f"max_tokens: the prompt leaves no room in the context ({max_tokens} tokens)")
        top_k = pick["top_k"] if self.top_k is None else self.top_k
        return SamplingParams(
            temperature=pick["temperature"] if self.temperature is None else self.temperature,
            top_k=max(top_k, 0),
            top_p=pick["top_p"] if self.top_p is None else self.top_p,
            seed=self.seed,
            max_new_tokens=max_tokens,
            stop=tuple(self.stop),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick["repetition_penalty"] if self.repetition_penalty is None
            else self.repetition_penalty,  # fmt: skip
            logit_bias=tuple((self.logit_bias or {}).items()),
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            logprobs=logprobs,
        )


def generation_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults a model's generation config sets (its `generation_config.json` or `to_diff_dict()`), as vLLM
    takes them: only the keys it names; everything else keeps OpenAI's default."""
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}  # fmt: skip
    defaults = {names[k]: v for k, v in config.items() if k in names and v is not None}
    if config.get("do_sample") is False:  # a model whose config decodes greedily (the shipped ones) stays greedy
        defaults["temperature"] = 0.0
    return defaults


class CompletionRequest(SamplingRequest):
    """Body of POST /v1/completions: OpenAI's completions API plus the extensions of SamplingRequest."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)  # None: 16 (OpenAI's) or the model's default
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt):
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise ValueError(f"prompt must be 1 to {MAX_PROMPTS} prompts, got {len(prompts)}")
        for p in prompts:
            if not p or (not isinstance(p, str) and min(p) < 0):
                raise ValueError("prompt must be non-empty strings or lists of token ids >= 0")
        return prompt

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and best_of != info.data.get("n", 1):
            raise unsupported("best_of", " other than n: choices are independent samples, not the best of more")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, suffix: str | None) -> None:
        if suffix is not None:
            raise unsupported("suffix", " (insertion)")

    @field_validator("echo")
    @classmethod
    def _check_echo(cls, echo: bool, info: ValidationInfo) -> bool:
        if echo and info.data.get("logprobs") is not None:
            raise unsupported("echo", " together with logprobs (the prompt's logprobs are not computed)")
        return echo

    def _prompt_list(self) -> list[str] | list[list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else p

    def prompts(self, tokenizer) -> list[list[int]]:
        """Token ids per prompt: strings encoded as the tokenizer does by default (Llama's BOS included)."""
        out = []
        for p in self._prompt_list():
            ids = list(tokenizer(p)["input_ids"]) if isinstance(p, str) else list(p)
            if not ids:
                raise ValueError(f"prompt {p!r} encodes to no tokens")
            if max(ids) >= len(tokenizer):
                raise ValueError(f"prompt token ids must be below the vocabulary size {len(tokenizer)}")
            out.append(ids)
        return out

    def prompt_texts(self, tokenizer) -> list[str]:
        """What echo prepends per prompt: a string as given, token ids decoded."""
        return [p if isinstance(p, str) else tokenizer.decode(p) for p in self._prompt_list()]

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """defaults: the model's own (generation_defaults), for fields the request leaves out."""
        return self._params(self.max_tokens, self.logprobs, defaults)


def new_completion_id(prefix: str = "cmpl") -> tuple[str, int]:
    """(id, created): the OpenAI-style identity of one completion ("chatcmpl" for chat)."""
    return f"{prefix}-{uuid.uuid4().hex}", int(time.time())


def speculative_block(stats: GenerationStats | Sequence[GenerationStats | None]) -> dict[str, Any]:
    """Round statistics, summed over the choices when given several."""
    parts = [s for s in ([stats] if isinstance(stats, GenerationStats) else stats) if s is not None]
    total = GenerationStats()
    for s in parts:
        total.rounds += s.rounds
        total.accepted_lengths += s.accepted_lengths
        total.trees.update(s.trees)
        for mine, theirs in ((total.reached_depth, s.reached_depth), (total.offered_depth, s.offered_depth)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for d, count in enumerate(theirs):
                mine[d] += count
    return {
        "rounds": total.rounds,
        "mean_accepted_length": round(total.mean_accepted_length, 4),
        "acceptance_per_depth": [round(a, 4) for a in total.acceptance_per_depth],
        "trees": dict(total.trees),
    }


def usage_block(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens whose KV came from the prefix cache (engine/prefix_cache.py)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def cached_tokens(per_choice: dict[int, int], n: int) -> int:
    """Prompt tokens found cached, each prompt counted once (from its first choice) however many choices it has."""
    return sum(tokens for index, tokens in per_choice.items() if index % n == 0)


def finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB) if not math.isnan(logprob) else MIN_LOGPROB


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[TokenLogprob], offset: int = 0) -> dict:
    """Completions' logprobs format. top_logprobs holds the top k and the chosen token (OpenAI: up to k + 1);
    text_offset counts the characters of the tokens' own decoded strings from `offset`."""
    text = token_bytes(tokenizer).text  # a part of a character as "bytes:\\xc3" (OpenAI's form), not U+FFFD
    tokens = [text(t) for t in token_ids]
    offsets = []
    for t in token_ids:
        offsets.append(offset)
        offset += len(tokenizer.decode([t]))
    tops = [{text(t): finite(lp) for t, lp in [*lp.top, (tid, lp.logprob)]}
            for tid, lp in zip(token_ids, logprobs)]  # fmt: skip
    return {"tokens": tokens, "token_logprobs": [finite(lp.logprob) for lp in logprobs], "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


def completion_body(request: CompletionRequest, tokenizer, model: str, generations: Sequence[Generation]) -> dict:
    """The non-stream body; generations are numbered prompt-major (prompt p, sample j -> p * n + j)."""
    cid, created = new_completion_id()
    echo = request.prompt_texts(tokenizer) if request.echo else None
    choices = []
    for i, gen in enumerate(generations):
        choice = {"index": i, "text": (echo[i // request.n] if echo else "") + gen.text,
                  "logprobs": None, "finish_reason": gen.finish_reason, "token_ids": gen.token_ids}  # fmt: skip
        if request.logprobs is not None:
            choice["logprobs"] = completion_logprobs(tokenizer, gen.token_ids, gen.logprobs or [])
        choices.append(choice)
    prompt_tokens = sum(g.prompt_tokens for g in generations[:: request.n])
    return response_body(cid, created, "text_completion", model, choices, prompt_tokens, generations, request.n)


def response_body(cid: str, created: int, kind: str, model: str, choices: list[dict], prompt_tokens: int,
                  generations: Sequence[Generation], n: int) -> dict:
    """A whole (non-streamed) response of `kind` ("text_completion", "chat.completion"): choices, usage and the
    `speculative` block over every generation (n: choices per prompt)."""
    cached = cached_tokens({i: g.stats.cached_tokens for i, g in enumerate(generations)}, n)
    return {
        "id": cid,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_block(prompt_tokens, sum(len(g.token_ids) for g in generations), cached),
        "speculative": speculative_block([g.stats for g in generations]),
    }


class CompletionStream:
    """The chunk bodies of one streamed completion: `chunks(index, chunk)` for each engine chunk of choice `index`,
    then `end()` (the usage-only chunk when stream_options.include_usage), then the router sends [DONE]."""

    def __init__(self, request: CompletionRequest, tokenizer, model: str, prompt_tokens: int):
        """prompt_tokens: the prompts' tokens, each prompt counted once however many choices it has."""
        self.request, self.tokenizer, self.model, self.prompt_tokens = request, tokenizer, model, prompt_tokens
        self.id, self.created = new_completion_id()
        self.echo = request.prompt_texts(tokenizer) if request.echo else None
        self.offsets: dict[int, int] = defaultdict(int)  # choice -> characters streamed
        self.completion_tokens = 0
        self.cached: dict[int, int] = {}  # choice -> its prompt's tokens found in the prefix cache

    def _body(self, choices: list[dict]) -> dict:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip
        if self.request.include_usage:
            body["usage"] = None  # as OpenAI: null on every chunk but the last
        return body

    def chunks(self, index: int, chunk: StreamChunk) -> list[dict]:
        text = chunk.text
        if self.echo and index not in self.offsets:
            text = self.echo[index // self.request.n] + text
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": chunk.finish_reason,
                  "token_ids": chunk.token_ids}  # fmt: skip
        if self.request.logprobs is not None:
            choice["logprobs"] = completion_logprobs(self.tokenizer, chunk.token_ids, chunk.logprobs or [],
                                                     self.offsets[index])  # fmt: skip
        self.offsets[index] += len(text)
        self.completion_tokens += len(chunk.token_ids)
        if chunk.stats is not None:  # the last chunk of a choice has them (EngineReplica.generate)
            self.cached[index] = chunk.stats.cached_tokens
        body = self._body([choice])
        if chunk.finish_reason is not None:
            body["speculative"] = speculative_block(chunk.stats)
        return [body]

    def end(self) -> list[dict]:
        if not self.request.include_usage:
            return []
        cached = cached_tokens(self.cached, self.request.n)
        return [self._body([]) | {"usage": usage_block(self.prompt_tokens, self.completion_tokens, cached)}]


def sse(body: dict[str, Any] | str) -> str:
    """One server-sent event line pair."""
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_not_found(name: str | None, served: str) -> dict[str, Any]:
    """OpenAI's body for a request naming another model (HTTP 404)."""
    return error_body(f"The model {name!r} does not exist; this server has {served!r}", param="model",
                      code="model_not_found")  # fmt: skip


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


def validation_error(errors: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """(status, body) for a request that failed validation: a body that is not JSON, an unknown or unsupported
    field, a value out of range. Always 400, as OpenAI and vLLM answer (FastAPI's default is 422, which the openai
    client raises as UnprocessableEntityError, missed by code that catches BadRequestError)."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return 400, error_body(f"request body is not valid JSON: {errors[0].get('msg', '')}")
    message, param = validation_message(errors)
    return 400, error_body(message, param=param)


def model_card(model_id: str, created: int | None = None, owned_by: str = "ray_specdec", **extra: Any) -> dict:
    """One entry of GET /v1/models, and the body of GET /v1/models/{id}; extra: this server's facts
    (max_context, tp_size)."""
    return {"id": model_id, "object": "model", "created": int(time.time()) if created is None else created,
            "owned_by": owned_by, **extra}  # fmt: skip


def model_list(cards: Sequence[dict]) -> dict:
    return {"object": "list", "data": list(cards)}

