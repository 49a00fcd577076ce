"""A tiny target / Mamba drafter pair that agree often, saved to a tmp dir with a 128-word tokenizer.

Random tiny models almost never agree, which would leave the accepted paths and the drafter's commit over the wire
untested. Here both models share one embedding table and an output head built from a "bigram" successor table, so
the drafter proposes what the target mostly predicts; the target's attention and MLP (scaled up) make it depart from
the bigram in a context-dependent way, so rounds see full, partial and no acceptance, and the target's KV cache
matters. The successor table is a permutation of the word tokens (long cycles: varied text; never <eos> or <unk>), so
generations run to max_tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM, PreTrainedModel

from ray_specdec.engine import SpeculativeEngine
from ray_specdec.models.mamba_drafter import MambaDrafter
from ray_specdec.models.target import TargetModel
from tests.tiny_models import tiny_gpt_neox, tiny_tokenizer

VOCAB, HIDDEN = 128, 64
WORDS = [f"w{i}" for i in range(VOCAB - 2)]  # + <eos> (id 0, the target's EOS) and <unk>: 128 ids
PROMPTS = ["w3 w14 w15 w92 w65", "w35 w89 w79 w32 w38 w46", "w26 w43 w38", "w32 w79 w50 w28 w84 w19 w71"]
LOGIT_GAIN = 16.0  # scale of the bigram logits: larger margins between the top tokens
MIX_GAIN = 1.5  # scale of every attention / MLP / mixer output: how far the models stray from the bigram


def bigram_pair(seed: int = 0) -> tuple[PreTrainedModel, MambaForCausalLM]:
    """(GPTNeoX target, Mamba drafter), float32, sharing embeddings and a bigram output head."""
    g = torch.Generator().manual_seed(seed)
    target = tiny_gpt_neox(torch.float32, vocab=VOCAB, hidden=HIDDEN, seed=seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    embed -= embed.mean(dim=1, keepdim=True)  # zero-mean rows: LayerNorm and RMSNorm agree on them
    normed = embed / embed.pow(2).mean(dim=1, keepdim=True).sqrt()  # [V, H]
    successor = torch.cat([torch.randint(2, VOCAB, (2,), generator=g), 2 + torch.randperm(VOCAB - 2, generator=g)])
    head = torch.zeros(VOCAB, HIDDEN).index_add_(0, successor, normed) * (LOGIT_GAIN / HIDDEN)
    config = MambaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, state_size=8, expand=2,
                         conv_kernel=4, initializer_range=0.1, tie_word_embeddings=False, eos_token_id=0)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        drafter = MambaForCausalLM(config).eval()
    with torch.no_grad():
        target.get_input_embeddings().weight.copy_(embed)
        target.get_output_embeddings().weight.copy_(head)
        target.gpt_neox.final_layer_norm.weight.fill_(1.0)
        target.gpt_neox.final_layer_norm.bias.zero_()
        drafter.backbone.embeddings.weight.copy_(embed)
        drafter.lm_head.weight.copy_(head)
        drafter.backbone.norm_f.weight.fill_(1.0)
        outputs = [p for layer in target.gpt_neox.layers for p in (*layer.attention.dense.parameters(),
                                                                  *layer.mlp.dense_4h_to_h.parameters())]
        outputs += [layer.mixer.out_proj.weight for layer in drafter.backbone.layers]
        for p in outputs:
            p.mul_(MIX_GAIN)
    return target, drafter


def word_tokenizer():
    return tiny_tokenizer([" ".join(WORDS)])


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(target dir with tokenizer, drafter dir), saved once per test session."""
    root = tmp_path_factory.mktemp("models")
    target, drafter = bigram_pair()
    tokenizer = word_tokenizer()
    assert len(tokenizer) == VOCAB
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    drafter.save_pretrained(root / "drafter")
    return root / "target", root / "drafter"


@pytest.fixture(scope="session")
def engine(model_dirs) -> SpeculativeEngine:
    """The in-process engine over the saved models (the reference for serving outputs)."""
    target_dir, drafter_dir = model_dirs
    return SpeculativeEngine(TargetModel.from_pretrained(str(target_dir)), MambaDrafter.from_pretrained(str(drafter_dir)))


def greedy_margin(target: TargetModel, prompt_ids: list[int], generated: list[int]) -> float:
    """Smallest top-1 minus top-2 target logit along a greedy path: float32 tree and single-token forwards may
    disagree in the last bits, so exact-equality tests must not sit on a near-tie."""
    ids = torch.tensor(prompt_ids + generated)
    with torch.no_grad():
        logits = target.model(ids[None]).logits[0, len(prompt_ids) - 1 : -1]
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())
