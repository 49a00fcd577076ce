"""A tiny target / Mamba drafter pair that agree often, saved to a tmp dir with a 128-word tokenizer.

Random tiny models almost never agree, which would leave the accepted paths and the drafter's commit over the wire
untested. Here both models share one embedding table and an output head built from a "bigram" successor table, so
the drafter proposes what the target mostly predicts; the target's attention and MLP (scaled up) make it depart from
the bigram in a context-dependent way, so rounds see full, partial and no acceptance, and the target's KV cache
matters. The successor table is a permutation of the word tokens (long cycles: varied text; never <eos> or <unk>), so
generations run to max_tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import MambaConfig, MambaForCausalLM, PreTrainedModel

from ray_specdec.defaults import CHAT_TEMPLATE
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.target.model import TargetModel
from tests.helpers.models import tiny_gpt_neox, tiny_tokenizer
from tests.helpers.reference import greedy_margin

VOCAB, HIDDEN = 128, 64
WORDS = [f"w{i}" for i in range(VOCAB - 2)]  # + <eos> (id 0, the target's EOS) and <unk>: 128 ids
PROMPTS = ["w3 w14 w15 w92 w65", "w35 w89 w79 w32 w38 w46", "w26 w43 w38", "w32 w79 w50 w28 w84 w19 w71"]
LOGIT_GAIN = 16.0  # scale of the bigram logits: larger margins between the top tokens
MIX_GAIN = 1.5  # scale of every attention / MLP / mixer output: how far the models stray from the bigram
# Streams a Serve test kills a replica under: long enough that they still run while the test reads which replica
# holds which (a 150-token stream of the pair ends within about a second), and the target's context widened to hold
# them (save_bigram_pair's max_positions).
LONG_TOKENS, LONG_CONTEXT = 1000, 1100


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
                                                                  *layer.mlp.dense_4h_to_h.parameters())]  # fmt: skip
        outputs += [layer.mixer.out_proj.weight for layer in drafter.backbone.layers]
        for p in outputs:
            p.mul_(MIX_GAIN)
    return target, drafter


def word_tokenizer():
    tokenizer = tiny_tokenizer([" ".join(WORDS)])
    tokenizer.chat_template = CHAT_TEMPLATE  # the shipped models' (their role markers encode to <unk> words here)
    return tokenizer


def agreeing_pair(dtype: torch.dtype, max_positions: int) -> tuple[TargetModel, MambaDrafter]:
    """A tiny target and a Mamba drafter that agree often (bigram_pair), with a long context."""
    target, drafter = bigram_pair()
    target.config.max_position_embeddings = max_positions
    return TargetModel(target.to(dtype)), MambaDrafter(drafter.to(dtype).eval())


def save_bigram_pair(root: Path, max_positions: int | None = None) -> tuple[Path, Path]:
    """The bigram pair saved under root (the target with its tokenizer), its target's context widened to
    max_positions if given -> (target dir, drafter dir)."""
    target, drafter = bigram_pair()
    if max_positions is not None:
        target.config.max_position_embeddings = max_positions
    tokenizer = word_tokenizer()
    assert len(tokenizer) == VOCAB
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    # as the shipped models' config says: decode greedily unless a request sets a temperature (the app's default)
    (root / "target" / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 0}))
    drafter.save_pretrained(root / "drafter")
    return root / "target", root / "drafter"


def greedy_reference(engine: SpeculativeEngine, max_tokens: int) -> dict[str, list[int]]:
    """Target-alone greedy ids of each of PROMPTS, checked to sit on paths without float32 near-ties."""
    from ray_specdec.config import SamplingParams

    alone = SpeculativeEngine(engine.target, None)
    out = {}
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        out[prompt] = alone.generate(ids, SamplingParams(max_new_tokens=max_tokens)).token_ids
        assert greedy_margin(engine.target.model, ids, out[prompt]) > 1e-3
    return out
