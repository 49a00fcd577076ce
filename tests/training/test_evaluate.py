"""Chain acceptance by teacher forcing: literal cases."""

from __future__ import annotations

import pytest

from ray_specdec.training.evaluate import chain_accepted_lengths


@pytest.mark.parametrize("target, draft, gamma, expected", [
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 4, [5, 5]),     # all accepted, then bonus
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0], 4, [1] * 6),  # stops when < gamma left
    ([1, 2, 3, 4, 5, 6, 7, 8], [1, 0, 3, 4, 5, 6, 7, 8], 2, [2, 3, 3]),  # the bonus position is never drafted
    ([5, 5, 5, 5, 5, 5, 5], [5, 9, 5, 5, 5, 5, 5], 3, [2, 4]),
])
def test_chain_accepted_lengths(target, draft, gamma, expected):
    assert chain_accepted_lengths(target, draft, gamma) == expected


def test_evaluate_reports_every_present_model_and_pair(tmp_path, small_tokenizer_dir):
    import torch
    from transformers import GPTNeoXConfig, MambaConfig

    from ray_specdec.training.evaluate import evaluate, results_markdown, write_results
    from ray_specdec.training.export import export
    from ray_specdec.training.models import build_model
    from ray_specdec.training.train import TrainSettings, make_optimizer, save_checkpoint

    configs = {
        "target-neox": GPTNeoXConfig(vocab_size=512, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, eos_token_id=0, bos_token_id=0),
        "drafter-mamba": MambaConfig(vocab_size=512, hidden_size=32, num_hidden_layers=1, state_size=4,
                                     eos_token_id=0, bos_token_id=0, pad_token_id=0),
    }
    for name, config in configs.items():
        torch.manual_seed(0)
        model = build_model(config)
        settings = TrainSettings(arch=name, name=name, tokenizer=str(small_tokenizer_dir))
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        save_checkpoint(run / "ckpt.pt", model, make_optimizer(model, settings), 1, 6.0, 10, settings,
                        torch.Generator())
        export(run, tmp_path / "models" / name, small_tokenizer_dir)
    results = evaluate(tmp_path / "models", gamma=2, n_prompts=2, prompt_len=8, new_tokens=8, ppl_windows=2,
                       seq_len=16)
    assert set(results["heldout_perplexity"]) == set(configs)
    assert all(1 < ppl < 2 * 512 for ppl in results["heldout_perplexity"].values())
    assert list(results["mean_accepted_length"]) == ["target-neox + drafter-mamba"]
    assert 1 <= results["mean_accepted_length"]["target-neox + drafter-mamba"] <= 3
    doc = tmp_path / "MODELS.md"
    doc.write_text("# intro\n")
    write_results(doc, results)
    write_results(doc, results)
    assert doc.read_text() == "# intro\n\n" + results_markdown(results) + "\n"
