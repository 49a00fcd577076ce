"""The CLI contract: `generate --json` prints one JSON object; bad input is one line on stderr and exit code 2."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM

from ray_specdec.cli import main
from ray_specdec.config import SamplingParams
from ray_specdec.engine import SpeculativeEngine
from ray_specdec.models.target import TargetModel
from tests.tiny_models import tiny_gpt_neox, tiny_tokenizer

WORDS = "the quick brown fox jumps over the lazy dog a tree of tokens is verified in one pass".split()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tok = tiny_tokenizer()
    vocab = len(tok)
    target = tiny_gpt_neox(vocab=vocab)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drafter = MambaForCausalLM(MambaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, state_size=8))
    drafter.save_pretrained(root / "drafter")
    return root / "target", root / "drafter"


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_contract(model_dirs, capsys):
    target_dir, drafter_dir = model_dirs
    code, out, err = run(["generate", "--prompt", "the quick brown", "--target", str(target_dir), "--drafter",
                          str(drafter_dir), "--tree", "2,1", "--max-new-tokens", "9", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert set(result) >= {"text", "token_ids", "stats"}
    assert {"rounds", "mean_accepted_length", "tokens_per_s"} <= set(result["stats"])
    target = TargetModel.from_pretrained(str(target_dir))
    expected = SpeculativeEngine(target, None).generate("the quick brown", SamplingParams(max_new_tokens=9))
    assert result["token_ids"] == expected.token_ids
    assert result["text"] == expected.text
    assert result["stats"]["rounds"] >= 1


def test_drafter_none_is_plain_decoding(model_dirs, capsys):
    target_dir, _ = model_dirs
    code, out, _ = run(["generate", "--prompt", "a tree", "--target", str(target_dir), "--drafter", "none",
                        "--max-new-tokens", "5", "--json"], capsys)
    assert code == 0
    stats = json.loads(out)["stats"]
    assert stats["mean_accepted_length"] == 1.0


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "", "--target", "T", "--drafter", "none"],
        ["generate", "--prompt", "x", "--target", "T", "--tree", "a,b"],
        ["generate", "--prompt", "x", "--target", "T", "--temperature", "-1"],
        ["generate", "--prompt", "x", "--target", "T", "--max-new-tokens", "0"],
        ["generate", "--prompt", "x", "--target", "T", "--top-p", "2"],
        ["generate", "--prompt", "x", "--target", "/nonexistent/model/dir", "--drafter", "none"],
        ["generate", "--prompt", "x", "--target", "T", "--drafter", "/nonexistent/drafter"],
        ["generate", "--prompt", "x", "--target", "T", "--device", "tpu"],
        ["generate", "--prompt", "x", "--target", "T", "--dtype", "float7"],
        ["generate", "--bogus"],
        ["frobnicate"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, model_dirs, capsys):
    argv = [str(model_dirs[0]) if a == "T" else a for a in argv]
    code, out, err = run(argv, capsys)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_module_entry_point_exit_code(model_dirs):
    proc = subprocess.run([sys.executable, "-m", "ray_specdec", "generate", "--prompt", "x", "--target",
                           "/nonexistent", "--drafter", "none"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: cannot load target")
    assert len(proc.stderr.strip().splitlines()) == 1
