"""Export writes a standalone fp16 HF directory: model, generation config and tokenizer."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXConfig, MambaConfig

import pytest

from ray_specdec.defaults import CHAT_TEMPLATE
from ray_specdec.training.export import export
from ray_specdec.training.models import build_model
from ray_specdec.training.train import TrainSettings, make_optimizer, save_checkpoint


@pytest.mark.parametrize("config", [
    GPTNeoXConfig(vocab_size=512, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
    MambaConfig(vocab_size=512, hidden_size=32, num_hidden_layers=1, state_size=4),
], ids=["neox", "mamba"])
def test_export_writes_loadable_fp16_safetensors(tmp_path, small_tokenizer_dir, config):
    torch.manual_seed(0)
    model = build_model(config)
    settings = TrainSettings(arch="tiny", name="tiny", tokenizer=str(small_tokenizer_dir))
    save_checkpoint(tmp_path / "ckpt.pt", model, make_optimizer(model, settings), 7, 60.0, 1000, settings,
                    torch.Generator())
    out = tmp_path / "out"
    info = export(tmp_path, out, small_tokenizer_dir)
    assert info["steps"] == 7 and info["parameters"] == sum(p.numel() for p in model.parameters())
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, param in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], param.half().float())
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == loaded.config.vocab_size == 512
    assert tokenizer.chat_template == CHAT_TEMPLATE  # a fresh tokenizer gets the shipped models' template
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
    # a Mamba drafter names its training window as its prefill window; a target names none
    window = json.loads((out / "config.json").read_text()).get("ray_specdec_prefill_window")
    assert window == (settings.seq_len if config.model_type == "mamba" else None)


def test_export_reads_the_history_of_an_embedded_init_from(tmp_path, small_tokenizer_dir):
    """A run continued from an embedded model by name (`--init-from drafter-mamba`) keeps that model's rounds and
    its longest training window (512) as its prefill window, as from its directory."""
    from ray_specdec.defaults import embedded_model_path
    from ray_specdec.models.loading import PREFILL_WINDOW_KEY

    shipped = json.loads((embedded_model_path("drafter-mamba") / "training.json").read_text())
    torch.manual_seed(0)
    model = build_model(MambaConfig(vocab_size=512, hidden_size=32, num_hidden_layers=1, state_size=4))
    settings = TrainSettings(arch="tiny", name="tiny", tokenizer=str(small_tokenizer_dir), init_from="drafter-mamba",
                             seq_len=64)
    save_checkpoint(tmp_path / "ckpt.pt", model, make_optimizer(model, settings), 3, 60.0, 192, settings,
                    torch.Generator())
    info = export(tmp_path, tmp_path / "out", small_tokenizer_dir)
    assert len(info["previous_rounds"]) == len(shipped.get("previous_rounds", [])) + 1
    assert info["total_steps"] == shipped["total_steps"] + 3
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config[PREFILL_WINDOW_KEY] == 512
