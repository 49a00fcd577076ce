"""POST /v1/chat/completions without Ray: the request model and OpenAI's chat bodies (on api.py's shared pieces).

Messages are rendered by the target tokenizer's own chat template (the shipped models carry defaults.CHAT_TEMPLATE).
Fields for tools, structured output, audio and the like are refused by name (HTTP 400, `api.validation_error`) until
they are supported; hints that do not change the output (user, prompt_cache_key, metadata ...) are accepted.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ray_specdec.config import MAX_LOGPROBS, SamplingParams
from ray_specdec.engine.outputs import Generation, StreamChunk
from ray_specdec.serving.api import (SamplingRequest, cached_tokens, finite, new_completion_id, response_body,
                                     speculative_block, unsupported, usage_block)
from ray_specdec.serving.token_bytes import token_bytes
from ray_specdec.speculation.logits_processing import TokenLogprob

# Refused when set (to anything but the value that means "plain text"), each by name.
UNSUPPORTED_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "response_format",
                      "audio", "modalities", "prediction", "web_search_options", "reasoning_effort", "verbosity",
                      "moderation", "store")  # fmt: skip
PLAIN_TEXT = {"response_format": {"type": "text"}, "modalities": ["text"], "store": False}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    refusal: str | None = None  # an earlier assistant turn's, sent back by clients; not part of the prompt
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    audio: Any = None
    annotations: list[Any] | None = None  # an earlier assistant turn's citations, sent back as given; ignored

    @field_validator("role")
    @classmethod
    def _check_role(cls, role: str) -> str:
        if role in ("tool", "function"):
            raise unsupported(f"the {role!r} role", " (tool calls)")
        return role

    @field_validator("content")
    @classmethod
    def _check_content(cls, content: str | list[dict[str, Any]] | None) -> str:
        """Text parts are joined into one string, the form every chat template takes."""
        if not isinstance(content, list):
            return content or ""
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise unsupported(f"content part type {part.get('type')!r}", "; only text parts are")
        return "".join(part["text"] for part in content)

    @field_validator("tool_calls", "tool_call_id", "function_call", "audio")
    @classmethod
    def _refuse(cls, value: Any, info: ValidationInfo) -> None:
        if value is not None:
            raise unsupported(f"messages' {info.field_name}")


class ChatCompletionRequest(SamplingRequest):
    """Body of POST /v1/chat/completions: OpenAI's chat API plus the extensions of api.SamplingRequest."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # accepted, without effect on the output
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # refused when set
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    moderation: Any = None
    store: Any = None

    @field_validator(*UNSUPPORTED_FIELDS)
    @classmethod
    def _refuse(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and value != PLAIN_TEXT.get(info.field_name):
            raise unsupported(info.field_name)
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    def render(self, tokenizer) -> list[int]:
        """The prompt's token ids: the messages through the tokenizer's chat template, with the generation prompt
        (tokenized as apply_chat_template does: the template writes any special tokens itself)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("messages: the model's tokenizer has no chat template; use /v1/completions")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.content}
                    | ({"name": m.name} if m.name else {}) for m in self.messages]  # fmt: skip
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template's own raise_exception, or a role it cannot render
            raise ValueError(f"messages: the chat template refused them: {exc}") from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def sampling_params(self, room: int, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """room: the context left after the rendered prompt, the max_tokens of a request that sets none (OpenAI's
        default) unless the model's defaults (api.generation_defaults) set one."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, defaults, room)


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[TokenLogprob]) -> dict:
    """Chat's logprobs format: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""

    read = token_bytes(tokenizer)  # a part of a character keeps its own bytes (not U+FFFD's)

    def entry(token_id: int, logprob: float) -> dict:
        text, raw = read(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(raw)}

    return {"content": [entry(t, lp.logprob) | {"top_logprobs": [entry(a, alp) for a, alp in lp.top]}
                        for t, lp in zip(token_ids, logprobs)], "refusal": None}  # fmt: skip


def chat_body(request: ChatCompletionRequest, tokenizer, model: str, generations: Sequence[Generation]) -> dict:
    """The non-stream body; one choice per sample."""
    cid, created = new_completion_id("chatcmpl")
    choices = [{"index": i, "message": {"role": "assistant", "content": gen.text, "refusal": None},
                "logprobs": chat_logprobs(tokenizer, gen.token_ids, gen.logprobs or []) if request.logprobs else None,
                "finish_reason": gen.finish_reason, "token_ids": gen.token_ids}
               for i, gen in enumerate(generations)]  # fmt: skip
    prompt_tokens = generations[0].prompt_tokens if generations else 0
    return response_body(cid, created, "chat.completion", model, choices, prompt_tokens, generations, request.n)


class ChatStream:
    """The chunk bodies of one streamed chat completion: `chunks(index, chunk)` for each engine chunk of choice
    `index` (the choice's first also sends the assistant role, its last a finish chunk with an empty delta), then
    `end()` (the usage-only chunk when stream_options.include_usage), then the router sends [DONE]."""

    def __init__(self, request: ChatCompletionRequest, tokenizer, model: str, prompt_tokens: int):
        self.request, self.tokenizer, self.model, self.prompt_tokens = request, tokenizer, model, prompt_tokens
        self.id, self.created = new_completion_id("chatcmpl")
        self.started: set[int] = set()
        self.completion_tokens = 0
        self.cached: dict[int, int] = {}  # choice -> the prompt's tokens found in the prefix cache

    def _body(self, index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
        if self.request.include_usage:
            body["usage"] = None  # as OpenAI: null on every chunk but the last
        return body

    def chunks(self, index: int, chunk: StreamChunk) -> list[dict]:
        bodies = []
        if index not in self.started:
            self.started.add(index)
            bodies.append(self._body(index, {"role": "assistant", "content": ""}))
        if chunk.token_ids or chunk.text:
            logprobs = (chat_logprobs(self.tokenizer, chunk.token_ids, chunk.logprobs or [])
                        if self.request.logprobs else None)  # fmt: skip
            bodies.append(self._body(index, {"content": chunk.text}, logprobs))
            bodies[-1]["choices"][0]["token_ids"] = chunk.token_ids
        self.completion_tokens += len(chunk.token_ids)
        if chunk.stats is not None:  # the last chunk of a choice has them (EngineReplica.generate)
            self.cached[index] = chunk.stats.cached_tokens
        if chunk.finish_reason is not None:
            bodies.append(self._body(index, {}, finish_reason=chunk.finish_reason)
                          | {"speculative": speculative_block(chunk.stats)})  # fmt: skip
        return bodies

    def end(self) -> list[dict]:
        if not self.request.include_usage:
            return []
        cached = cached_tokens(self.cached, self.request.n)
        body = self._body(0, {}) | {"usage": usage_block(self.prompt_tokens, self.completion_tokens, cached)}
        return [body | {"choices": []}]
