"""Logprobs name a token by its own bytes (token_bytes.py); a request's null fields take their defaults, and its seed
may be any int64, as OpenAI's API takes them."""

from __future__ import annotations

import json

import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from ray_specdec.defaults import DEFAULT_TARGET
from ray_specdec.engine.outputs import Generation
from ray_specdec.engine.stats import GenerationStats
from ray_specdec.models.loading import load_tokenizer
from ray_specdec.serving import api
from ray_specdec.serving.api import CompletionRequest, completion_body
from ray_specdec.serving.openai_chat import ChatCompletionRequest, chat_body
from ray_specdec.serving.token_bytes import TokenBytes, byte_level_alphabet, token_bytes
from ray_specdec.speculation.logits_processing import TokenLogprob

E_ACUTE = "\u00e9".encode("utf-8")  # C3 A9: one character, two bytes


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_TARGET)


def byte_token(tokenizer, byte: int) -> int:
    """The shipped (byte-level BPE) vocabulary's token for a lone byte."""
    return tokenizer.convert_tokens_to_ids(bytes_to_unicode()[byte])


def test_the_byte_level_alphabet_is_gpt2s():
    assert byte_level_alphabet() == {c: b for b, c in bytes_to_unicode().items()}
    assert set(byte_level_alphabet()) == set(pre_tokenizers.ByteLevel.alphabet())


def test_a_lone_byte_of_a_character_keeps_its_bytes(tokenizer):
    read = TokenBytes(tokenizer)
    first, second = byte_token(tokenizer, E_ACUTE[0]), byte_token(tokenizer, E_ACUTE[1])
    assert tokenizer.decode([first]) == tokenizer.decode([second]) == "\ufffd"  # what logprobs used to say
    assert read(first) == ("bytes:\\xc3", b"\xc3") and read(second) == ("bytes:\\xa9", b"\xa9")
    assert read(first)[1] + read(second)[1] == E_ACUTE  # a client rebuilds the character from them


def test_whole_tokens_keep_their_decoded_text(tokenizer):
    read = token_bytes(tokenizer)
    assert token_bytes(tokenizer) is read  # kept on the tokenizer
    for token_id in tokenizer(" def fibonacci(n):\n    return")["input_ids"]:
        text = tokenizer.decode([token_id])
        assert read(token_id) == (text, text.encode("utf-8"))
    eos = tokenizer.eos_token_id
    assert read.text(eos) == tokenizer.decode([eos])


def sentencepiece_like() -> PreTrainedTokenizerFast:
    """A byte-fallback vocabulary as Llama 2's and Mistral's: "<0xC3>" pieces, "▁" for a space."""
    vocab = {"<unk>": 0, "\u2581hi": 1, "<0xC3>": 2, "<0xA9>": 3, "\u00e9": 4}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_byte_fallback_pieces_are_read_as_their_bytes():
    read = TokenBytes(sentencepiece_like())
    assert read(2) == ("bytes:\\xc3", b"\xc3") and read(3) == ("bytes:\\xa9", b"\xa9")
    assert read(4) == ("\u00e9", E_ACUTE)
    assert read(1)[1] == read(1)[0].encode("utf-8") and read(1)[0].endswith("hi")


def test_completions_top_logprobs_keep_every_byte_token(tokenizer):
    """Two byte tokens used to share the one key "\ufffd" of the top_logprobs dict, so one of them was lost."""
    first, second = byte_token(tokenizer, E_ACUTE[0]), byte_token(tokenizer, E_ACUTE[1])
    lps = [TokenLogprob(-0.1, [(first, -0.1), (second, -2.0)]), TokenLogprob(-0.2, [(second, -0.2)])]
    gen = Generation([first, second], "\u00e9", "length", GenerationStats(), 3, lps)
    body = completion_body(CompletionRequest(prompt="w1", logprobs=2), tokenizer, "m", [gen])
    logprobs = Completion.model_validate(body).choices[0].logprobs
    assert logprobs.tokens == ["bytes:\\xc3", "bytes:\\xa9"]
    assert logprobs.top_logprobs[0] == {"bytes:\\xc3": -0.1, "bytes:\\xa9": -2.0}
    assert logprobs.text_offset == [0, 1]


def test_chat_logprobs_bytes_rebuild_the_text(tokenizer):
    first, second = byte_token(tokenizer, E_ACUTE[0]), byte_token(tokenizer, E_ACUTE[1])
    lps = [TokenLogprob(-0.1, [(first, -0.1)]), TokenLogprob(-0.2, [(second, -0.2)])]
    gen = Generation([first, second], "\u00e9", "length", GenerationStats(), 3, lps)
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "w1"}], logprobs=True, top_logprobs=1)
    content = ChatCompletion.model_validate(chat_body(request, tokenizer, "m", [gen])).choices[0].logprobs.content
    assert bytes(b for entry in content for b in entry.bytes).decode("utf-8") == gen.text
    assert [entry.top_logprobs[0].bytes for entry in content] == [[0xC3], [0xA9]]


@pytest.mark.parametrize("field", ["n", "presence_penalty", "frequency_penalty", "stream", "echo", "logprobs",
                                   "temperature", "stop", "seed", "max_tokens"])  # fmt: skip
def test_a_field_sent_as_null_takes_its_default(field):
    """OpenAI's API reads null as unset, and the openai client sends `n=None` as null (these were refused)."""
    request = CompletionRequest.model_validate(json.loads(f'{{"prompt": "w1", "{field}": null}}'))
    assert request == CompletionRequest(prompt="w1")
    if field != "echo":  # completions' own field
        messages = [{"role": "user", "content": "w1"}]
        chat = ChatCompletionRequest.model_validate({"messages": messages, field: None})
        assert chat == ChatCompletionRequest(messages=messages)


def test_null_does_not_hide_an_unknown_field_or_a_missing_prompt():
    for body, field in (({"prompt": "w1", "logprobz": None}, "logprobz"), ({"prompt": None}, "prompt")):
        with pytest.raises(Exception) as err:
            CompletionRequest.model_validate(body)
        status, answer = api.validation_error(err.value.errors())
        assert status == 400 and answer["error"]["param"] == field


def test_an_assistant_turn_sent_back_as_the_client_dumped_it_is_taken():
    """`message.model_dump()` of the openai client's ChatCompletionMessage carries annotations (and audio,
    function_call, tool_calls) as null; the annotations field was refused as unknown."""
    turn = {"role": "assistant", "content": "ok", "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "tool_calls": None}  # fmt: skip
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "w1"}, turn, {"role": "user", "content": "w2"}]})
    assert [m.content for m in request.messages] == ["w1", "ok", "w2"]


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1, 2**62 + 5])
def test_any_int64_seed_is_taken_and_seeds_the_generators(seed):
    """OpenAI takes any int64 seed; negative ones and those above 2**62 were refused."""
    from ray_specdec.speculation.sampling import make_generators

    params = CompletionRequest(prompt="w1", seed=seed).sampling_params()
    assert 0 <= params.seed < 2**63 and params.seed == CompletionRequest(prompt="w2", seed=seed).sampling_params().seed
    draft, target = make_generators(params.seed)
    assert torch.rand(1, generator=draft).item() != torch.rand(1, generator=target).item()
    with pytest.raises(Exception):
        CompletionRequest(prompt="w1", seed=2**63)
