"""Long-context QA traffic: facts from `ast`, prompts that fit their bucket and contain the answer, reproducibility."""

from __future__ import annotations

import json
import re

import pytest

from ray_specdec.tools import qa_traffic
from ray_specdec.tools.qa_traffic import extract_facts, generate, main, token_counter

WORDS = re.compile(r"\w+|[^\w\s]")


def count_words(text: str) -> int:
    return len(WORDS.findall(text))


SOURCE = '''\
LIMIT = 10
TWICE = 1
TWICE = 2
FLAG = True


def f(a, b=3, *, c="x", d=None):
    def inner():
        return 5

    return a + b


class K:
    def m(self, x=[1, 2]):
        if x:
            return 1
        return 2

    def g(self):
        return self.h

    def g(self, value):
        pass


def u(s="é", t="ü"):
    return s.upper(
    )
'''


def test_facts_are_exact_source_text_of_unambiguous_definitions():
    facts = [(fact.question, fact.answer, fact.first_line, fact.last_line) for fact in extract_facts(SOURCE)]
    assert facts == [
        ("what value is assigned to the module-level name `LIMIT`?", "10", 0, 0),  # TWICE: ambiguous, FLAG: trivial
        ("what expression does `f` return?", "a + b", 6, 10),  # inner's return is not f's
        ("what is the default value of the parameter `b` of `f`?", "3", 6, 6),
        ("what is the default value of the parameter `c` of `f`?", '"x"', 6, 6),  # d=None: trivial
        ("what expression does `f.inner` return?", "5", 7, 8),
        ("what is the default value of the parameter `x` of `K.m`?", "[1, 2]", 14, 14),  # two returns: no fact
        ("what is the default value of the parameter `s` of `u`?", '"é"', 26, 26),  # utf-8 column offsets
        ("what is the default value of the parameter `t` of `u`?", '"ü"', 26, 26),  # K.g twice, u's return 2 lines
    ]


@pytest.fixture(scope="module")
def items() -> list[dict]:
    return list(generate(count_words, buckets=(1024, 2048, 4096, 8192), per_bucket=3, seed=7))


def test_prompts_fill_their_bucket(items):
    assert [item["bucket"] for item in items] == [1024] * 3 + [2048] * 3 + [4096] * 3 + [8192] * 3
    for item in items:
        assert item["prompt_tokens"] == count_words(item["prompt"])
        assert 0.97 * item["bucket"] <= item["prompt_tokens"] <= item["bucket"], item["id"]


def test_answer_is_in_the_document_and_the_question_closes_the_prompt(items):
    for item in items:
        document, question = item["prompt"].rsplit("\n\nQ: ", 1)
        assert question == item["question"] + "\nA:"
        assert item["answer"] in document
        fact_file = re.match(r"In the file `([^`]+)` above", item["question"]).group(1)
        assert fact_file in item["source_files"]
        headers = re.findall(r"^### File: (.+)$", document, flags=re.M)
        assert list(dict.fromkeys(headers)) == item["source_files"]
    assert len({item["id"] for item in items}) == len(items)
    assert len({item["answer"] for item in items}) > len(items) // 2  # not the same question over and over


def test_generation_depends_only_on_seed_bucket_and_index(items):
    again = qa_traffic.QAGenerator(count_words, seed=7).item(4096, 1)
    assert again == items[7]
    other = list(generate(count_words, buckets=(1024, 2048, 4096, 8192), per_bucket=3, seed=8))
    assert all(a["prompt"] != b["prompt"] for a, b in zip(items, other))


def test_include_keeps_documents_and_fillers_to_the_accepted_files():
    from ray_specdec.training.corpus import is_heldout

    gen = qa_traffic.QAGenerator(count_words, seed=3, include=is_heldout)
    assert gen.files and all(is_heldout(f) for f in gen.files)
    assert len(gen.files) < len(qa_traffic.QAGenerator(count_words, seed=3).files)
    for i in range(3):
        item = gen.item(2048, i)
        assert item["source_files"] and all(is_heldout(f) for f in item["source_files"]), item["source_files"]
    with pytest.raises(ValueError, match="need at least two .py files"):
        qa_traffic.QAGenerator(count_words, include=lambda path: False)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A small byte-level BPE tokenizer saved like a model directory's (nothing is downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([SOURCE * 20], trainer=trainer)
    path = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=None).save_pretrained(path)
    return path


def test_cli_with_a_tokenizer_is_reproducible(bpe_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    args = ["--per-bucket", "2", "--buckets", "512,1024", "--tokenizer", str(bpe_dir)]
    paths = [tmp_path / name for name in ("a.jsonl", "b.jsonl", "c.jsonl")]
    assert main(["--out", str(paths[0]), "--seed", "1", *args]) == 0
    assert main(["--out", str(paths[1]), "--seed", "1", *args]) == 0
    assert main(["--out", str(paths[2]), "--seed", "2", *args]) == 0
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert paths[0].read_bytes() != paths[2].read_bytes()

    count = token_counter(AutoTokenizer.from_pretrained(bpe_dir))
    records = [json.loads(line) for line in paths[0].read_text().splitlines()]
    assert [r["bucket"] for r in records] == [512, 512, 1024, 1024]
    for r in records:
        assert set(r) == {"id", "bucket", "prompt_tokens", "prompt", "question", "answer", "source_files"}
        assert r["prompt_tokens"] == count(r["prompt"])
        assert 0.95 * r["bucket"] <= r["prompt_tokens"] <= r["bucket"]
    assert "wrote 4 prompts" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--buckets", "1k,2k"], "--buckets must be comma-separated"),
        (["--per-bucket", "0"], "--per-bucket must be >= 1"),
        (["--tokenizer", "/nonexistent/tok"], "cannot load a tokenizer"),
        (["--source-dir", "/nonexistent/src"], "is not a directory"),
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_cli_rejects_bad_input_with_one_line(argv, message, tmp_path, capsys):
    assert main(["--out", str(tmp_path / "x.jsonl"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_without_a_default_model_asks_for_a_tokenizer(tmp_path, monkeypatch, capsys):
    import ray_specdec.defaults

    monkeypatch.setattr(ray_specdec.defaults, "DEFAULT_TARGET", tmp_path / "no-model")
    assert main(["--out", str(tmp_path / "x.jsonl")]) == 2
    assert "cannot load a tokenizer" in capsys.readouterr().err
