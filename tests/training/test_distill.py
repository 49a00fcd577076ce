"""train-drafter: a drafter distilled from a tiny target on the test's own files drafts for it losslessly, resumes
exactly where its checkpoint stopped, and refuses bad input with one line."""

from __future__ import annotations

import json

import pytest
import torch

from ray_specdec.cli import main as cli_main
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.factory import load_drafter, load_engine
from ray_specdec.training.distill import data_files
from ray_specdec.models.drafter.mamba2 import Mamba2Drafter
from ray_specdec.training.models import DRAFTER_SIZES, build_model, mamba2_drafter_config, mamba_drafter_config
from tests.helpers.models import tiny_gpt_neox, tiny_tokenizer

TEXTS = ["the quick brown fox jumps over the lazy dog and the dog sleeps " * 20,
         "a tree of tokens is verified in one pass by the target model " * 20]
TINY = ["--hidden-size", "16", "--layers", "1", "--seq-len", "16", "--batch-size", "2", "--warmup-steps", "10"]


@pytest.fixture
def target_and_data(tmp_path):
    """A tiny target directory (word-level tokenizer of TEXTS, eos id 0) and the two text files."""
    data = [tmp_path / "fox.txt", tmp_path / "tree.md"]
    for path, text in zip(data, TEXTS):
        path.write_text(text)
    tiny_gpt_neox(torch.float32, vocab=128).save_pretrained(tmp_path / "target")
    tiny_tokenizer(TEXTS).save_pretrained(tmp_path / "target")
    return tmp_path / "target", data


def train_drafter(target, data, out, *flags) -> int:
    return cli_main(["train-drafter", "--target", str(target), "--data", *map(str, data), "--out", str(out), *TINY,
                     *flags])


def test_distilled_drafter_loads_drafts_and_keeps_greedy_output(target_and_data, tmp_path):
    target, data = target_and_data
    out = tmp_path / "drafter"
    assert train_drafter(target, data, out, "--max-steps", "3") == 0
    info = json.loads((out / "training.json").read_text())
    assert (info["steps"], info["tokens"]) == (3, 3 * 2 * 16)
    assert info["target"] == str(target) and info["data"]["files"] == 2
    assert info["size"] == {"name": "custom", "hidden_size": 16, "layers": 1}
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["ray_specdec_prefill_window"]) == ("mamba", 128, 16)
    assert {"model.safetensors", "generation_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}

    drafter = load_drafter(str(out), dtype="float64")
    _, logits = drafter.prefill(torch.tensor([5, 6, 7]))
    assert logits.shape == (128,) and drafter.prefill_window == 16

    engine = load_engine(str(target), str(out), tree=TreeConfig((2, 1)), dtype="float64", device="cpu")
    prompt = [5, 9, 12, 7]
    result = engine.generate(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    expected = engine.target.model.generate(
        torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    assert result.token_ids == expected
    assert result.stats.rounds > 0


def test_a_mamba2_drafter_trains_exports_and_drafts_losslessly(target_and_data, tmp_path):
    target, data = target_and_data
    out = tmp_path / "drafter2"
    assert train_drafter(target, data, out, "--arch", "mamba2", "--max-steps", "3") == 0
    info = json.loads((out / "training.json").read_text())
    assert info["steps"] == 3 and info["settings"]["arch"] == "mamba2-16x1" and info["final_loss"] < 100
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["ray_specdec_prefill_window"]) == ("mamba2", 128, 16)
    assert isinstance(load_drafter(str(out), dtype="float64"), Mamba2Drafter)
    engine = load_engine(str(target), str(out), tree=TreeConfig((2, 1)), dtype="float64", device="cpu")
    prompt = [5, 9, 12, 7]
    result = engine.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    expected = engine.target.model.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    assert result.token_ids == expected and result.stats.rounds > 0


def test_resume_continues_the_checkpoint_exactly(target_and_data, tmp_path):
    target, data = target_and_data
    resumed = tmp_path / "resumed"
    assert train_drafter(target, data, tmp_path / "straight", "--max-steps", "5") == 0
    assert train_drafter(target, data, resumed, "--max-steps", "3") == 0
    assert train_drafter(target, data, resumed, "--max-steps", "5") == 2  # refused without --resume
    # a restart under seed 1 would draw other initial weights and windows: the checkpoint's RNG states decide
    assert train_drafter(target, data, resumed, "--max-steps", "5", "--seed", "1", "--resume") == 0
    info = json.loads((resumed / "training.json").read_text())
    assert (info["steps"], info["tokens"]) == (5, 5 * 2 * 16)
    # warmup covers every step, so the learning rates match: 3 + 2 resumed steps are the 5 straight ones
    straight_ckpt = torch.load(tmp_path / "straight/checkpoint/ckpt.pt", weights_only=False)["model"]
    resumed_ckpt = torch.load(resumed / "checkpoint/ckpt.pt", weights_only=False)["model"]
    for name, value in straight_ckpt.items():
        assert torch.equal(resumed_ckpt[name], value), name
    # nothing left to do: the directory is written again with the same steps and loss
    assert train_drafter(target, data, resumed, "--max-steps", "5", "--resume") == 0
    assert json.loads((resumed / "training.json").read_text())["final_loss"] == info["final_loss"] is not None


def test_errors_are_one_line(target_and_data, tmp_path, capsys):
    target, data = target_and_data
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n")
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "cat.png").write_bytes(b"\x89PNG")
    cases = [
        ([blank], target, "--data: no text in 1 file(s)"),
        (data, target, f"--data: {2 * (13 * 20 + 1)} tokens in 2 file(s); a training window needs 2050"),
        ([tmp_path / "missing.txt"], target, "no such file or directory"),
        ([tmp_path / "images"], target, "no text files"),
        (data, tmp_path / "no-such-model", "cannot load target"),
    ]
    for files, model, message in cases:
        capsys.readouterr()
        assert train_drafter(model, files, tmp_path / "out", "--seq-len", "2048") == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_data_directories_are_searched_for_text_files(tmp_path):
    for rel in ["b.py", "a.txt", "sub/c.md", "sub/image.png", ".git/config.txt", "__pycache__/x.txt"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    (tmp_path / "notes").write_text("x")
    found = data_files([tmp_path, tmp_path / "notes"])
    assert [p.relative_to(tmp_path).as_posix() for p in found] == ["a.txt", "b.py", "sub/c.md", "notes"]


def test_sizes_have_their_named_parameter_counts():
    counts = {name: sum(p.numel() for p in build_model(mamba_drafter_config(4096, 0, *dims)).parameters())
              for name, dims in DRAFTER_SIZES.items()}
    assert counts == {"0.7m": 757_632, "2.8m": 2_800_896, "11m": 10_573_824}  # 2.8m: the shipped drafter-mamba
    counts = {name: sum(p.numel() for p in build_model(mamba2_drafter_config(4096, 0, *dims)).parameters())
              for name, dims in DRAFTER_SIZES.items()}
    assert counts == {"0.7m": 759_448, "2.8m": 2_776_928, "11m": 10_367_344}


def test_target_continuations_are_the_targets_own_text():
    """--generate-tokens: prompts cut from the text, each continued by the target; the greedy batches are exactly
    HF generate's greedy continuations, the sampled ones differ from them, and pieces end with eos."""
    from ray_specdec.training.distill import target_continuations

    target = tiny_gpt_neox(torch.float32, vocab=128).eval()
    stream = torch.randint(1, 128, (400,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    out = target_continuations(target, stream, 2 * 4 * 6, prompt_len=5, new_tokens=6, eos=0, seed=1,
                               device=torch.device("cpu"), batch_size=4)
    pieces = out.view(2, 4, 5 + 6 + 1).long()  # [batch, row, prompt + continuation + eos]
    assert (pieces[..., -1] == 0).all()
    for batch, sampled in enumerate((False, True)):
        prompts = pieces[batch, :, :5]
        assert all(any(torch.equal(p.int(), stream[s : s + 5]) for s in range(len(stream) - 4)) for p in prompts)
        greedy = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=6,
                                 min_new_tokens=6, do_sample=False, pad_token_id=0)[:, 5:]
        assert torch.equal(pieces[batch, :, 5:11], greedy) != sampled


def test_init_from_and_generated_text_go_into_the_run(target_and_data, tmp_path):
    target, data = target_and_data
    first, second = tmp_path / "first", tmp_path / "second"
    assert train_drafter(target, data, first, "--max-steps", "2") == 0
    assert train_drafter(target, data, second, "--max-steps", "1", "--init-from", str(first), "--generate-tokens",
                         "64", "--prompt-tokens", "4", "--continuation-tokens", "8") == 0
    info = json.loads((second / "training.json").read_text())
    assert info["settings"]["init_from"] == str(first)
    assert info["generated"] == {"tokens": 64 // 8 * (4 + 8 + 1), "prompt_tokens": 4, "continuation_tokens": 8}
    assert info["data"]["tokens"] < 2000
