"""The benchmark's contract on tiny models: JSON fields, greedy identity check, Markdown and PNG outputs."""

import json
from dataclasses import asdict, fields

import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM

from ray_specdec.engine.config import EngineConfig
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.settings import flag
from ray_specdec.speculation.controller import SpeculationConfig
from ray_specdec.models.native import library
from ray_specdec.tools.bench import main, parse_args
from tests.helpers.models import tiny_gpt_neox, tiny_mamba_lm, tiny_tokenizer


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_models")
    tok = tiny_tokenizer()
    vocab = len(tok)
    for name, model in (("target", tiny_gpt_neox(vocab=vocab, max_positions=1024)),
                        ("tf", tiny_gpt_neox(vocab=vocab, hidden=32, layers=1, max_positions=1024, seed=1))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        MambaForCausalLM(MambaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, state_size=8)
                         ).save_pretrained(root / "mamba")
    return root


def test_bench_json_report_and_plots(model_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["--target", str(model_dirs / "target"), "--drafter", str(model_dirs / "mamba"),
                 "--tf-drafter", str(model_dirs / "tf"), "--prompts", "2", "--long-prompts", "0",
                 "--qa-prompts", "1", "--qa-buckets", "200",
                 "--max-new-tokens", "12", "--trees", "1,1,1;2,1+L4", "--temperatures", "0,1",
                 "--contexts", "64,256", "--json", str(tmp_path / "bench.json"), "--out", str(out),
                 "--max-running", "4", "--step-tokens", "256", "--prefill-chunk", "64", "--lookup", "4"])
    assert code == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    # what the bandit ran: the engine's defaults but the prefix cache, off in bench (methods share prompts)
    ran = EngineConfig().with_fields(max_running=4, step_tokens=256, prefill_chunk=64, lookup=4, prefix_cache=False)
    assert report["settings"]["scheduler"] == asdict(ran.scheduler)
    assert report["settings"]["speculation"] == asdict(ran.speculation)
    names = {m["name"] for m in report["methods"]}
    assert {"hf_generate", "hf_assisted", "hf_prompt_lookup", "ours_target_only",
            "ours_mamba_chain_1,1,1", "ours_mamba_tree_2,1+L4", "ours_mamba_bandit"} <= names
    assert report["settings"]["bandit_pulls"].keys() == {"1,1,1", "2,1", "none"}  # arms: trees without lookup
    share = report["settings"]["bandit_undrafted_share"]
    assert share is None or 0.0 <= share <= 1.0
    for m in report["methods"]:
        assert {"name", "temperature", "tokens_per_s", "speedup_vs_hf_generate", "mean_accepted_length",
                "identical_to_target"} <= set(m)
        assert m["tokens_per_s"] > 0
        if m["temperature"] == 0 and m["name"].startswith("ours"):
            assert m["identical_to_target"] is True, m["name"]  # float32 tiny models: exact greedy ids
        if m["temperature"] == 1:
            assert m["identical_to_target"] is None
    assert [r["context_tokens"] for r in report["context_sweep"]] == [64, 256]
    sweep = report["context_sweep"]
    assert sweep[0]["mamba_state_bytes"] == sweep[1]["mamba_state_bytes"]  # flat in context length
    assert sweep[1]["transformer_kv_bytes"] > 3 * sweep[0]["transformer_kv_bytes"]  # grows with context
    for png in ("speedup.png", "acceptance_per_depth.png", "memory_vs_context.png"):
        assert (out / png).stat().st_size > 1000
    markdown = (out / "bench.md").read_text()
    assert "| hf_generate |" in markdown and "Bandit vs the best fixed setting in hindsight at T=1" in markdown
    assert "greedy outputs identical" in capsys.readouterr().out
    groups = report["groups"]
    assert {(g["group"], g["prompts"]) for g in groups} == {("short", 2), ("qa", 1)}
    assert {(g["name"], g["temperature"]) for g in groups if g["group"] == "qa"} == {
        (m["name"], m["temperature"]) for m in report["methods"]}
    assert all(g["speedup_vs_hf_generate"] == 1.0 for g in groups if g["name"] == "hf_generate")
    for m in report["methods"]:  # the groups partition the prompts: tokens and seconds add up to the method's
        parts = [g for g in groups if (g["name"], g["temperature"]) == (m["name"], m["temperature"])]
        assert len(parts) == 2 and sum(g["new_tokens"] for g in parts) == m["new_tokens"]
        assert sum(g["seconds"] for g in parts) == pytest.approx(m["seconds"], abs=2e-3)
    assert "| method | T | short (n=2) | qa (n=1) |" in markdown
    assert "Bandit vs the best fixed setting in hindsight at T=0 (qa prompts):" in markdown
    hardware = report["hardware"]  # how the drafter stepped, said in the report
    assert hardware["drafter_cuda_graphs"] is (hardware["device"].startswith("cuda"))
    if hardware["drafter_cuda_graphs"]:
        assert "Mamba drafter steps and catch-ups: CUDA graphs" in markdown
    else:
        assert "Mamba drafter steps and scans: " in markdown
    assert hardware["target_lean_forward"] is (hardware["device"] == "cpu")  # tiny GPTNeoX target: lean on CPU
    assert "Our engine's verify forward: " + ("lean loop" if hardware["target_lean_forward"] else "HF's") in markdown
    native_layers = hardware["target_native_decoder_why"] is None  # the tiny GPTNeoX's layers in one C call on CPU
    assert native_layers is (hardware["device"] == "cpu" and library.load() is not None)
    said = "one native call" if native_layers else "torch ops"
    assert "Our engine's verify rows' decoder layers: " + said in markdown


def test_bench_bad_arguments_exit_2(capsys):
    assert main(["--trees", "x,y"]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_bench_bad_device_and_dtype_exit_2(capsys):
    assert main(["--dtype", "fp99"]) == 2
    assert "unknown dtype 'fp99'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["--device", "cuda"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err
    assert main(["--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err


def test_bench_refuses_an_ssm_target_in_one_line(tmp_path, capsys):
    """The benchmark compares against HF's assisted generation, which takes attention targets only."""
    tiny_mamba_lm().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    assert main(["--target", str(tmp_path), "--quick"]) == 2
    assert "attention targets only" in capsys.readouterr().err


def test_bench_help_has_every_scheduler_flag(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for f in fields(SchedulerConfig) + fields(SpeculationConfig):
        assert flag(f.name) in text
    assert "--kv-budget-gib" in text
    assert not parse_args([]).prefix_cache and parse_args(["--prefix-cache"]).prefix_cache


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lookup", "99"], "argument --lookup: must be in [0, 32], got 99"),
        (["--max-running", "0"], "argument --max-running: must be >= 1, got 0"),
        (["--prefill-chunk", "1.5"], "argument --prefill-chunk: expected an integer, got '1.5'"),
        (["--kv-budget-gib", "1", "--kv-budget-tokens", "64"],
         "argument --kv-budget-tokens: not allowed with argument --kv-budget-gib"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bench_bad_flags_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err == f"error: bad bench arguments: {message}\n"


def test_bandit_vs_best_fixed_line():
    from ray_specdec.tools.bench_report import bandit_vs_best_fixed

    methods = [{"name": n, "temperature": 0.0, "tokens_per_s": v, "speedup_vs_hf_generate": v / 100}
               for n, v in [("hf_generate", 100.0), ("ours_target_only", 90.0), ("ours_mamba_chain_1,1", 120.0),
                            ("ours_mamba_bandit", 110.0)]]
    assert bandit_vs_best_fixed(methods) == [
        "", "Bandit vs the best fixed setting in hindsight at T=0: 1.10x vs 1.20x (ours_mamba_chain_1,1), ratio 0.92"]


def _method(name, seconds, tokens=None):
    tokens = tokens or [10] * len(seconds)
    return {"name": name, "temperature": 0.0, "tokens_per_s": sum(tokens) / sum(seconds),
            "speedup_vs_hf_generate": 1.0, "per_prompt_tokens": tokens, "per_prompt_seconds": seconds}


def test_cross_fitted_best_arm_carries_no_selection_bias():
    from ray_specdec.tools.bench_report import cross_fitted

    # A is fast on the even prompts, B on the odd ones: picked on one half, each is timed where it is slow.
    a = _method("ours_a", [1.0, 2.0, 1.0, 2.0])
    b = _method("ours_b", [2.0, 1.0, 2.0, 1.0])
    bandit = _method("ours_mamba_bandit", [1.5] * 4)
    # even half picks A (2 s there vs 4 s), timed on the odd half: 20 tokens / 4 s; the other way round B: 20 / 4 s
    assert cross_fitted(bandit, [a, b]) == pytest.approx((40 / 6.0) / (40 / 8.0))
    # with one arm better everywhere, cross-fitting picks it both ways: the plain ratio
    c = _method("ours_c", [0.5] * 4)
    assert cross_fitted(bandit, [a, b, c]) == pytest.approx(0.5 / 1.5)


def test_paired_bootstrap_interval():
    from ray_specdec.tools.bench_report import bandit_vs_best_fixed, paired_bootstrap

    base = [1.0, 3.0, 0.5, 2.0, 1.5, 4.0]
    best = _method("ours_best", base)
    faster = _method("ours_mamba_bandit", [x / 1.25 for x in base])
    assert paired_bootstrap(faster, best) == pytest.approx((1.25, 1.25))  # the same ratio on every prompt
    noisy = _method("ours_mamba_bandit", [x * f for x, f in zip(base, [0.8, 1.1, 0.9, 1.3, 1.0, 0.95])])
    lo, hi = paired_bootstrap(noisy, best)
    assert lo < noisy["tokens_per_s"] / best["tokens_per_s"] < hi and lo < 1 < hi
    lines = bandit_vs_best_fixed([best, noisy])
    assert lines[1].startswith("Bandit vs the best fixed setting in hindsight at T=0: ")
    assert lines[2] == (f"  paired bootstrap over prompts, 90% interval of that ratio: [{lo:.2f}, {hi:.2f}]; "
                        f"cross-fitted (arm picked on one half of the prompts, timed on the other): ratio "
                        f"{noisy['tokens_per_s'] / best['tokens_per_s']:.2f}")


def test_warmup_prompts_follow_the_measured_mix():
    from ray_specdec.tools.bench import split_like

    assert split_like(8, (10, 3, 4)) == (5, 1, 2)  # 4.71, 1.41, 1.88: the largest remainders get the spare two
    assert split_like(7, (1, 1, 1)) == (3, 2, 2)
    assert split_like(1, (2, 0, 1)) == (1, 0, 0)
    assert split_like(0, (1, 1, 1)) == split_like(5, (0, 0, 0)) == (0, 0, 0)
    for n in range(12):
        assert sum(split_like(n, (10, 3, 4))) == n


def test_report_explains_low_precision_differences():
    """In bfloat16 no method's greedy text need equal HF generate's (HF's own assisted modes differ too): the report
    says why; in float32 a difference stays a plain NO without that excuse."""
    from ray_specdec.tools.bench_report import markdown

    def report(dtype):
        method = dict(name="ours_target_only", temperature=0, tokens_per_s=10.0, speedup_vs_hf_generate=1.0,
                      mean_accepted_length=1.0, acceptance_per_depth=[], identical_to_target=False, draft_s=0.0,
                      verify_s=1.0, other_s=0.0)
        return {"methods": [method], "groups": [], "context_sweep": [], "settings": {},
                "hardware": {"dtype": dtype}}

    assert "exactness is checked in float32 or float64" in markdown(report("bfloat16"))
    assert "exactness is checked" not in markdown(report("float32"))
