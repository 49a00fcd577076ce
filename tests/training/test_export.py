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
