"""The shipped models' chat template: every shipped directory carries it, it renders system / user / assistant turns
and the generation prompt, and what it renders is plain text the shared tokenizer round-trips."""

from __future__ import annotations

import pytest
from jinja2.exceptions import TemplateError

from ray_specdec.defaults import CHAT_TEMPLATE, DEFAULT_MODEL_NAMES, DEFAULT_TARGET, default_model_path
from ray_specdec.models.loading import load_tokenizer

CHAT = [
    {"role": "system", "content": "Answer with code."},
    {"role": "user", "content": "Open a file."},
    {"role": "assistant", "content": "with open(path) as f:"},
    {"role": "user", "content": "And read it?"},
]
RENDERED = (
    "<|system|>\nAnswer with code.\n<|user|>\nOpen a file.\n<|assistant|>\nwith open(path) as f:\n"
    "<|user|>\nAnd read it?\n"
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_TARGET)


@pytest.mark.parametrize("name", DEFAULT_MODEL_NAMES)
def test_every_shipped_tokenizer_loads_with_the_template(name):
    assert load_tokenizer(default_model_path(name)).chat_template == CHAT_TEMPLATE


def test_renders_the_turns_and_the_generation_prompt(tokenizer):
    assert tokenizer.apply_chat_template(CHAT, tokenize=False) == RENDERED
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert prompt == RENDERED + "<|assistant|>\n"


def test_text_parts_render_as_their_text(tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Open "}, {"type": "text", "text": "a file."}]}]
    assert tokenizer.apply_chat_template(parts, add_generation_prompt=True, tokenize=False) == (
        "<|user|>\nOpen a file.\n<|assistant|>\n"
    )


def test_other_roles_are_refused(tokenizer):
    with pytest.raises(TemplateError, match="chat roles are system, user and assistant, got tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "42"}], tokenize=False)


def test_the_prompt_is_text_the_tokenizer_round_trips(tokenizer):
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt)
    assert tokenizer.decode(ids) == prompt and tokenizer.eos_token_id not in ids
