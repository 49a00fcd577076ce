"""The OpenAI edge without Ray: every request field parses or is refused by name; every body validates against
the `openai` package's own response types (the compatibility proof)."""

import json
import math

import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.defaults import DEFAULT_TARGET
from ray_specdec.engine.outputs import Generation, StreamChunk
from ray_specdec.engine.stats import GenerationStats
from ray_specdec.models.loading import load_tokenizer
from ray_specdec.serving import api
from ray_specdec.serving.api import CompletionRequest, CompletionStream
from ray_specdec.serving.openai_chat import ChatCompletionRequest, ChatStream, chat_body
from ray_specdec.speculation.logits_processing import TokenLogprob


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_TARGET)


def stats(rounds: int, accepted: int) -> GenerationStats:
    s = GenerationStats()
    for _ in range(rounds):
        s.record_round("2,1", 2, accepted, 3)
    return s


def generation(tokenizer, text: str, prompt_tokens: int = 3, finish: str = "length", logprobs=False) -> Generation:
    ids = tokenizer(text)["input_ids"]
    lps = [TokenLogprob(-0.5, [(t, -0.5), (7, -1.5), (8, -math.inf)]) for t in ids] if logprobs else None
    return Generation(ids, text, finish, stats(2, 1), prompt_tokens, lps)


def refused(model, body: dict) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return info.value


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "w1", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "w1", "temperature": -1}, "temperature"),
        ({"prompt": "w1", "top_p": 0}, "top_p"),
        ({"prompt": "w1", "top_k": -2}, "top_k"),
        ({"prompt": "w1", "n": 0}, "n"),
        ({"prompt": "w1", "n": 17}, "n"),
        ({"prompt": "w1", "stop": ["a", ""]}, "stop"),
        ({"prompt": "w1", "tree": "3,x"}, "tree"),
        ({"prompt": "w1", "tree": "8,8,8"}, "tree"),
        ({"prompt": "w1", "stream": "maybe"}, "stream"),
        ({"prompt": "w1", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "w1", "stream": True, "stream_options": {"usage": True}}, "stream_options"),
        ({"prompt": "w1", "logprobs": 21}, "logprobs"),
        ({"prompt": "w1", "logprobs": -1}, "logprobs"),
        ({"prompt": "w1", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "w1", "frequency_penalty": -3}, "frequency_penalty"),
        ({"prompt": "w1", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "w1", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "w1", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "w1", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "w1", "stop_token_ids": [-3]}, "stop_token_ids"),
        ({"prompt": "w1", "seed": 2**63}, "seed"),
        ({"prompt": "w1", "user": 5}, "user"),
        ({"prompt": "w1", "best_of": 3}, "best_of"),
        ({"prompt": "w1", "suffix": "end"}, "suffix"),
        ({"prompt": "w1", "logprobs": 2, "echo": True}, "echo"),
        ({"prompt": "w1", "frobnicate": 1}, "frobnicate"),
    ],
)
def test_completion_request_refusals(body, field):
    err = refused(CompletionRequest, body)
    assert err.errors()[0]["loc"][0] == field
    message, param = api.validation_message(err.errors())
    assert message.startswith(field) and param.split(".")[0] == field


@pytest.mark.parametrize("raw, where", [
    ('{"prompt": "w1 \\ud800"}', "prompt"),
    ('{"prompt": ["w1", "\\udfff w2"]}', "prompt.1"),
    ('{"prompt": "w1", "stop": ["\\ud83d"]}', "stop.0"),
    ('{"prompt": "w1", "user": "\\udc00"}', "user"),
    ('{"prompt": "w1", "\\ud800": 1}', "body"),
])
def test_text_that_utf8_cannot_encode_is_refused_by_name(raw, where):
    """JSON's surrogate escapes decode to lone surrogates, which the tokenizer and the response cannot take (an
    unguarded prompt was a 500): 400 naming the field, before any field is read."""
    err = refused(CompletionRequest, json.loads(raw))
    status, body = api.validation_error(err.errors())
    assert status == 400
    assert f"{where} is not valid Unicode text" in body["error"]["message"]
    body["error"]["message"].encode("utf-8")  # the answer itself encodes


def test_chat_text_that_utf8_cannot_encode_is_refused_by_name():
    raw = '{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi \\udc00"}]}]}'
    err = refused(ChatCompletionRequest, json.loads(raw))
    assert "messages.0.content.0.text is not valid Unicode text" in api.validation_error(err.errors())[1]["error"][
        "message"]


def test_valid_unicode_passes_the_text_check():
    req = CompletionRequest.model_validate(json.loads('{"prompt": "h\\u00e9 \\ud83d\\ude00 \\u0000 \\u4e16"}'))
    assert req.prompt == "h\u00e9 \U0001F600 \x00 \u4e16"
    assert api.unencodable_text({"a": ["x", {"b": "\u00e9"}]}) is None


def test_unsupported_fields_are_400_and_named():
    status, body = api.validation_error(refused(CompletionRequest, {"prompt": "w1", "suffix": "x"}).errors())
    assert status == 400 and body["error"]["param"] == "suffix"
    assert "suffix is not supported" in body["error"]["message"]
    status, body = api.validation_error(refused(CompletionRequest, {"prompt": "w1", "n": 0}).errors())
    assert status == 400 and body["error"]["param"] == "n"
    status, body = api.validation_error([{"type": "json_invalid", "loc": ("body", 3), "msg": "bad"}])
    assert status == 400 and "not valid JSON" in body["error"]["message"]


def test_completion_request_to_params():
    req = CompletionRequest.model_validate(
        {"model": "m", "prompt": "w1 w2", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "seed": 5,
         "stop": "w9", "tree": "(3, 2)", "presence_penalty": 0.5, "frequency_penalty": -0.25,
         "logit_bias": {"50": -100, "7": 2.5}, "repetition_penalty": 1.2, "min_tokens": 2, "stop_token_ids": [0],
         "logprobs": 3, "n": 2, "best_of": 2, "user": "u", "echo": False, "suffix": None,
         "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    assert req.sampling_params() == SamplingParams(
        0.5, 3, 0.9, 5, 7, ("w9",), presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2,
        logit_bias=((7, 2.5), (50, -100.0)), min_tokens=2, stop_token_ids=(0,), logprobs=3)  # fmt: skip
    assert req.tree_config() == TreeConfig((3, 2)) and req.tree == "3,2" and req.include_usage


def test_completion_defaults():
    params = CompletionRequest(prompt="w1").sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.max_new_tokens, params.logprobs) == (1.0, 1.0, 0, 16,
                                                                                                         None)
    defaults = api.generation_defaults({"temperature": 0.0, "top_k": 50, "max_new_tokens": 64, "do_sample": False})
    assert defaults == {"temperature": 0.0, "top_k": 50, "max_tokens": 64}
    params = CompletionRequest(prompt="w1", top_k=-1).sampling_params(defaults)
    assert (params.temperature, params.top_k, params.max_new_tokens) == (0.0, 0, 64)
    params = CompletionRequest(prompt="w1", temperature=0.7, max_tokens=5).sampling_params(defaults)
    assert (params.temperature, params.max_new_tokens) == (0.7, 5)
    with pytest.raises(ValueError, match="min_tokens"):
        CompletionRequest(prompt="w1", min_tokens=20).sampling_params()


def test_prompt_shapes(tokenizer):
    hi = tokenizer("hi there")["input_ids"]
    assert CompletionRequest(prompt="hi there").prompts(tokenizer) == [hi]
    assert CompletionRequest(prompt=["hi there", "w1"]).prompts(tokenizer) == [hi, tokenizer("w1")["input_ids"]]
    assert CompletionRequest(prompt=[5, 6]).prompts(tokenizer) == [[5, 6]]
    assert CompletionRequest(prompt=[[5, 6], [7]]).prompts(tokenizer) == [[5, 6], [7]]
    assert CompletionRequest(prompt=[[5, 6], [7]]).prompt_texts(tokenizer) == [tokenizer.decode([5, 6]),
                                                                               tokenizer.decode([7])]
    with pytest.raises(ValueError, match="prompt token ids must be below the vocabulary size"):
        CompletionRequest(prompt=[len(tokenizer)]).prompts(tokenizer)


class BosTokenizer:
    """A tokenizer that adds BOS by default (as Llama's does) over the shipped one."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, text, add_special_tokens=True):
        ids = self.inner(text)["input_ids"]
        return {"input_ids": [1] + ids if add_special_tokens else ids}

    def __len__(self):
        return len(self.inner)


def test_prompts_encode_with_the_tokenizers_special_tokens(tokenizer):
    assert CompletionRequest(prompt="hi").prompts(BosTokenizer(tokenizer)) == [[1] + tokenizer("hi")["input_ids"]]


def test_logit_bias_keys_become_ints():
    req = CompletionRequest.model_validate_json('{"prompt": "w1", "logit_bias": {"50256": -100, "3": 1}}')
    assert req.logit_bias == {50256: -100.0, 3: 1.0}
    assert req.sampling_params().logit_bias == ((3, 1.0), (50256, -100.0))


def test_completion_body_validates(tokenizer):
    req = CompletionRequest(prompt=["a", "b"], n=2, logprobs=2)
    gens = [generation(tokenizer, f" w{i}", prompt_tokens=3 + i // 2, logprobs=True) for i in range(4)]
    body = api.completion_body(req, tokenizer, "m", gens)
    parsed = Completion.model_validate(json.loads(json.dumps(body, allow_nan=False)))
    assert [c.index for c in parsed.choices] == [0, 1, 2, 3] and parsed.choices[3].text == " w3"
    assert parsed.usage.prompt_tokens == 3 + 4 and parsed.usage.completion_tokens == sum(len(g.token_ids) for g in gens)
    lp = parsed.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in gens[0].token_ids] and lp.token_logprobs[0] == -0.5
    assert lp.text_offset[0] == 0 and min(lp.top_logprobs[0].values()) == api.MIN_LOGPROB
    assert body["speculative"]["rounds"] == 8 and body["speculative"]["mean_accepted_length"] == 2.0


def test_echo(tokenizer):
    body = api.completion_body(CompletionRequest(prompt="Hello", echo=True), tokenizer, "m",
                               [generation(tokenizer, " there")])  # fmt: skip
    assert Completion.model_validate(body).choices[0].text == "Hello there"


def test_usage_counts_each_prompts_cached_tokens_once(tokenizer):
    """Two prompts, two choices each: the choices of one prompt report its cached tokens once."""
    req = CompletionRequest(prompt=["Hi", "Yo"], n=2, stream=True, stream_options={"include_usage": True})
    stream = CompletionStream(req, tokenizer, "m", prompt_tokens=4)
    for index, cached in enumerate([3, 3, 1, 1]):
        s = stats(1, 0)
        s.cached_tokens = cached
        stream.chunks(index, StreamChunk([4], "b", None, None))  # a served choice's chunks but its last have no stats
        stream.chunks(index, StreamChunk([5], "a", "length", s))
    assert stream.end()[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3 + 1}
    assert api.cached_tokens({0: 3, 1: 3, 2: 1, 3: 1}, n=2) == 4 and api.cached_tokens({0: 9}, n=1) == 9


def test_completion_stream(tokenizer):
    req = CompletionRequest(prompt="Hi", n=2, stream=True, stream_options={"include_usage": True}, echo=True)
    stream = CompletionStream(req, tokenizer, "m", prompt_tokens=2)
    bodies = stream.chunks(1, StreamChunk([5], "a", None, stats(1, 0)))
    bodies += stream.chunks(0, StreamChunk([6, 7], "bc", "stop", stats(1, 1)))
    bodies += stream.chunks(1, StreamChunk([8], "d", "length", stats(1, 0)))
    bodies += stream.end()
    assert [b["choices"][0]["text"] for b in bodies[:3]] == ["Hia", "Hibc", "d"]
    assert bodies[0]["choices"][0]["finish_reason"] is None and bodies[0]["usage"] is None
    for body in bodies[1:]:
        Completion.model_validate(body)
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"] == api.usage_block(2, 4, cached_tokens=0)
    assert "speculative" in bodies[2] and "speculative" not in bodies[0]
    plain = CompletionStream(CompletionRequest(prompt="Hi", stream=True), tokenizer, "m", 2)
    assert "usage" not in plain.chunks(0, StreamChunk([5], "a", "stop", stats(1, 0)))[0] and plain.end() == []


def test_stream_logprob_offsets_continue(tokenizer):
    stream = CompletionStream(CompletionRequest(prompt="Hi", logprobs=1, stream=True), tokenizer, "m", 2)
    ids = tokenizer(" one two")["input_ids"]
    lps = [TokenLogprob(-1.0, [(t, -1.0)]) for t in ids]
    first = stream.chunks(0, StreamChunk(ids, " one two", None, stats(1, 0), lps))[0]
    second = stream.chunks(0, StreamChunk(ids, " one two", "stop", stats(1, 0), lps))[0]
    assert first["choices"][0]["logprobs"]["text_offset"][0] == 0
    assert second["choices"][0]["logprobs"]["text_offset"][0] == len(" one two")


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "c"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_chat_request_refusals(extra, field):
    err = refused(ChatCompletionRequest, {"messages": CHAT} | extra)
    assert err.errors()[0]["loc"][0] == field
    assert api.validation_message(err.errors())[0].startswith(field)


def test_plain_text_values_of_unsupported_fields_pass():
    req = ChatCompletionRequest(messages=CHAT, response_format={"type": "text"}, modalities=["text"], store=False,
                                user="u", metadata={"k": "v"}, prompt_cache_key="p", service_tier="auto")  # fmt: skip
    assert req.messages[1].content == "Hi"
    status, body = api.validation_error(refused(ChatCompletionRequest, {"messages": CHAT, "tools": []}).errors())
    assert status == 400 and body["error"]["message"] == "tools: tools is not supported yet"


def test_chat_render_and_params(tokenizer):
    req = ChatCompletionRequest(messages=CHAT, max_completion_tokens=9, logprobs=True, top_logprobs=3, seed=1)
    want = tokenizer("<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n", add_special_tokens=False)["input_ids"]
    assert req.render(tokenizer) == want
    params = req.sampling_params(room=100)
    assert (params.max_new_tokens, params.logprobs, params.seed, params.temperature) == (9, 3, 1, 1.0)
    assert ChatCompletionRequest(messages=CHAT, max_tokens=4).sampling_params(room=100).max_new_tokens == 4
    assert ChatCompletionRequest(messages=CHAT).sampling_params(room=100).max_new_tokens == 100
    assert ChatCompletionRequest(messages=CHAT, logprobs=True).sampling_params(room=9).logprobs == 0
    with pytest.raises(ValueError, match="max_tokens"):
        ChatCompletionRequest(messages=CHAT).sampling_params(room=0)
    developer = ChatCompletionRequest(messages=[{"role": "developer", "content": "Be brief."}, CHAT[1]])
    assert developer.render(tokenizer) == want


def test_chat_render_without_template(tokenizer):
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="messages: the model's tokenizer has no chat template"):
        ChatCompletionRequest(messages=CHAT).render(NoTemplate())


def test_chat_body_validates(tokenizer):
    req = ChatCompletionRequest(messages=CHAT, n=2, logprobs=True, top_logprobs=2)
    gens = [generation(tokenizer, " ok", prompt_tokens=12, finish="stop", logprobs=True) for _ in range(2)]
    body = chat_body(req, tokenizer, "m", gens)
    parsed = ChatCompletion.model_validate(json.loads(json.dumps(body, allow_nan=False)))
    assert parsed.object == "chat.completion" and parsed.choices[1].message.content == " ok"
    assert parsed.choices[0].message.role == "assistant" and parsed.choices[0].finish_reason == "stop"
    entry = parsed.choices[0].logprobs.content[0]
    assert entry.token == tokenizer.decode([gens[0].token_ids[0]]) and entry.bytes == list(entry.token.encode())
    assert [t.logprob for t in entry.top_logprobs] == [-0.5, -1.5, api.MIN_LOGPROB]
    assert parsed.usage.prompt_tokens == 12 and parsed.usage.completion_tokens == 2 * len(gens[0].token_ids)
    assert body["speculative"]["rounds"] == 4
    assert chat_body(ChatCompletionRequest(messages=CHAT), tokenizer, "m", gens[:1])["choices"][0]["logprobs"] is None


def test_chat_stream(tokenizer):
    req = ChatCompletionRequest(messages=CHAT, stream=True, stream_options={"include_usage": True}, logprobs=True)
    stream = ChatStream(req, tokenizer, "m", prompt_tokens=12)
    lp = [TokenLogprob(-0.1, [])]
    bodies = stream.chunks(0, StreamChunk([5], "a", None, stats(1, 0), lp))
    bodies += stream.chunks(0, StreamChunk([6], "b", "length", stats(1, 0), lp))
    bodies += stream.end()
    chunks = [ChatCompletionChunk.model_validate(b) for b in bodies]
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", None]
    assert [c.choices[0].delta.content for c in chunks[:4]] == ["", "a", "b", None]
    assert [c.choices[0].finish_reason for c in chunks[:4]] == [None, None, None, "length"]
    assert chunks[1].choices[0].logprobs.content[0].logprob == -0.1 and chunks[0].choices[0].logprobs is None
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 14 and chunks[0].usage is None
    assert "speculative" in bodies[3] and len(bodies) == 5
    assert ChatStream(ChatCompletionRequest(messages=CHAT), tokenizer, "m", 1).end() == []


def test_errors_and_models():
    assert api.error_body("bad", param="n") == {"error": {"message": "bad", "type": "invalid_request_error",
                                                          "param": "n", "code": None}}  # fmt: skip
    missing = api.model_not_found("gpt-9", "m")["error"]
    assert missing["code"] == "model_not_found" and missing["param"] == "model" and "gpt-9" in missing["message"]
    card = api.model_card("m", created=5, max_context=256)
    assert Model.model_validate(card).id == "m" and card["max_context"] == 256
    listing = api.model_list([card])
    assert listing["object"] == "list" and Model.model_validate(listing["data"][0]).created == 5


def test_sse_framing():
    assert api.sse({"a": 1}) == 'data: {"a":1}\n\n' and api.sse("[DONE]") == "data: [DONE]\n\n"
