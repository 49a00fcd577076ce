"""`python -m ray_specdec bench`: our engine against what users would pick instead, side by side in one run.

Same held-out prompts, same target weights: HF `generate` (no drafter), HF assisted generation with the Transformer
drafter, HF prompt lookup, and our engine with the Mamba drafter as a chain and as fixed trees; greedy and
temperature 1. Speedups are ratios within this run; greedy outputs are checked token for token against HF `generate`.
Prompts come in groups (short and long held-out windows, long-context QA prompts over held-out files), reported
together and per group. A context sweep compares drafter memory and step time, Mamba vs Transformer, as prompts grow.

JSON (`--json`): {"methods": [{"name", "temperature", "tokens_per_s", "speedup_vs_hf_generate",
"mean_accepted_length", "identical_to_target", "acceptance_per_depth", "per_prompt_tokens", "per_prompt_seconds",
...}], "groups": [{"group", "prompts", "name", "temperature", "tokens_per_s", "speedup_vs_hf_generate", ...}],
"context_sweep": [...], "hardware": {...}, "settings": {...}, "greedy_outputs_identical"}.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ray_specdec.cli import OneLineParser, UsageError
from ray_specdec.config import NO_TREE, SamplingParams, TreeConfig
from ray_specdec.engine.kv_sizing import device_room, fitted_kv_budget
from ray_specdec.engine.config import EngineConfig, add_engine_arguments, engine_config_from_args
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.models.device_clock import synchronize
from ray_specdec.models.loading import prefill_window_arg

# Every method runs every prompt (and again at each temperature): with the prefix cache on, the methods after the
# first would find the prompt's KV cached and skip the prefill that HF generate pays each time.
BENCH_CONFIG = EngineConfig().with_fields(prefix_cache=False)


@dataclass
class MethodResult:
    name: str
    temperature: float
    new_tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)
    offered: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    state_bytes: int = 0  # drafter state + target KV cache of one request at the end of generation
    prompt_tokens: list[int] = field(default_factory=list)  # new tokens of each prompt, in prompt order
    prompt_seconds: list[float] = field(default_factory=list)  # and its seconds: paired comparisons per prompt

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def merge(self, other: "MethodResult") -> None:
        """Add another run of the same method (more prompts) to this one."""
        self.new_tokens += other.new_tokens
        self.seconds += other.seconds
        self.outputs += other.outputs
        self.prompt_tokens += other.prompt_tokens
        self.prompt_seconds += other.prompt_seconds
        self.state_bytes = max(self.state_bytes, other.state_bytes)
        self._add_rounds(other.accepted_lengths, other.reached, other.offered,
                         other.draft_s, other.verify_s, other.other_s)  # fmt: skip

    def add_prompt(self, new_tokens: int, seconds: float) -> None:
        self.new_tokens += new_tokens
        self.seconds += seconds
        self.prompt_tokens.append(new_tokens)
        self.prompt_seconds.append(seconds)

    def add_stats(self, stats) -> None:
        self._add_rounds(stats.accepted_lengths, stats.reached_depth, stats.offered_depth,
                         stats.draft_s, stats.verify_s, stats.other_s)  # fmt: skip

    def _add_rounds(self, accepted_lengths, reached, offered, draft_s, verify_s, other_s) -> None:
        self.accepted_lengths += accepted_lengths
        for mine, theirs in ((self.reached, reached), (self.offered, offered)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for d, v in enumerate(theirs):
                mine[d] += v
        self.draft_s += draft_s
        self.verify_s += verify_s
        self.other_s += other_s

    def to_dict(self, baseline: "MethodResult | None", reference: list[list[int]] | None, brief: bool = False) -> dict:
        """brief: name, temperature, tokens/s, speedup, mean accepted length, tokens and seconds only."""
        mean_len = sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else None
        head = {
            "name": self.name,
            "temperature": self.temperature,
            "tokens_per_s": round(self.tokens_per_s, 2),
            "speedup_vs_hf_generate": round(self.tokens_per_s / baseline.tokens_per_s, 3) if baseline else None,
            "mean_accepted_length": round(mean_len, 3) if mean_len is not None else None,
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 3),
        }
        if brief:
            return head
        return {
            **head,
            "acceptance_per_depth": [round(r / o, 3) for r, o in zip(self.reached, self.offered)] or None,
            "identical_to_target": (self.outputs == reference) if reference is not None else None,
            "per_prompt_tokens": self.prompt_tokens,
            "per_prompt_seconds": [round(x, 4) for x in self.prompt_seconds],
            "draft_s": round(self.draft_s, 3),
            "verify_s": round(self.verify_s, 3),
            "other_s": round(self.other_s, 3),
            "state_bytes": self.state_bytes,
        }


def hf_kwargs(temperature: float) -> dict:
    if temperature == 0:
        return {"do_sample": False}
    # top_k=0 / top_p=1: plain temperature sampling, the same distribution our engine reproduces
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def run_hf(name, model, prompts, max_new, temperature, seed, **extra) -> MethodResult:
    result = MethodResult(name, temperature)
    for i, ids in enumerate(prompts):
        torch.manual_seed(seed + i)
        inp = torch.tensor([ids], device=model.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new,
                                 pad_token_id=model.config.eos_token_id, **hf_kwargs(temperature), **extra)
        new = out[0, len(ids):].tolist()
        result.add_prompt(len(new), time.perf_counter() - t0)
        result.outputs.append(new)
    return result


def run_ours(name, engine: SpeculativeEngine, prompts, max_new, temperature, seed, tree) -> MethodResult:
    result = MethodResult(name, temperature)
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=temperature, seed=seed + i, max_new_tokens=max_new)
        t0 = time.perf_counter()
        gen = engine.generate(ids, params, tree)
        result.add_prompt(len(gen.token_ids), time.perf_counter() - t0)
        result.outputs.append(gen.token_ids)
        result.add_stats(gen.stats)
    if engine.drafter is not None:
        d = engine.drafter
        result.state_bytes = d.n_layers * d.d_inner * (d.d_conv + d.d_state) * d.dtype.itemsize
    return result


def split_like(n: int, counts: tuple[int, ...]) -> tuple[int, ...]:
    """n split in proportion to counts (largest remainders first), e.g. warm-up prompts in the measured mix."""
    total = sum(counts)
    if total == 0 or n <= 0:
        return tuple(0 for _ in counts)
    exact = [n * c / total for c in counts]
    parts = [int(x) for x in exact]
    for i in sorted(range(len(counts)), key=lambda i: exact[i] - parts[i], reverse=True)[: n - sum(parts)]:
        parts[i] += 1
    return tuple(parts)


def qa_prompts(tokenizer, n: int, buckets: list[int], seed: int) -> list[list[int]]:
    """n long-context QA prompts (qa_traffic) over held-out documents only, cycling through the token buckets."""
    from ray_specdec.tools.qa_traffic import QAGenerator, token_counter
    from ray_specdec.training.corpus import is_heldout

    if n <= 0:
        return []
    gen = QAGenerator(token_counter(tokenizer), seed=seed, include=is_heldout)
    items = [gen.item(buckets[i % len(buckets)], i // len(buckets)) for i in range(n)]
    return [tokenizer(item["prompt"], add_special_tokens=False)["input_ids"] for item in items]


def model_label(path: str) -> str:
    """How the report names a model: 'embedded:<name>' for the embedded models, by directory or name (no machine
    paths), else as given."""
    from ray_specdec.defaults import DEFAULT_MODELS_DIR, EMBEDDED_MODEL_NAMES

    resolved = Path(path).resolve()
    if path in EMBEDDED_MODEL_NAMES and not resolved.is_dir():
        return f"embedded:{path}"
    return f"embedded:{resolved.name}" if resolved.parent == DEFAULT_MODELS_DIR else path


def parse_tree_and_cut(text: str) -> tuple[TreeConfig, float]:
    """'3,2,2,1,1@0.06' -> (TreeConfig((3, 2, 2, 1, 1)), 0.06)."""
    tree, sep, cut = text.partition("@")
    if not sep or not 0 <= float(cut) < 1:
        raise ValueError(f"expected TREE@CUT with 0 <= CUT < 1, got {text!r}")
    return TreeConfig.parse(tree), float(cut)


def bandit_pulls(bandit) -> list[int]:
    """Pulls per arm, summed over context buckets (warm-up included)."""
    return bandit.state.raw[:, :, 0].sum(axis=0).astype(int).tolist()


def kv_bytes(past) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in past.layers)


def context_sweep(drafter, tf_drafter, stream: list[int], lengths, steps: int) -> list[dict]:
    """Per context length: drafter state bytes of one request and one draft step's time, Mamba vs Transformer."""
    rows = []
    for length in tqdm(lengths, desc="context sweep", leave=False):
        ids = stream[:length]
        state, _ = drafter.prefill(torch.tensor(ids))
        token = torch.tensor([ids[-1]], device=drafter.device)
        synchronize(drafter.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            drafter.step(state, token)
        synchronize(drafter.device)
        mamba_step = (time.perf_counter() - t0) / steps
        mamba_bytes = state.conv.numel() * state.conv.element_size() + state.ssm.numel() * state.ssm.element_size()
        with torch.inference_mode():
            out = tf_drafter(torch.tensor([ids], device=tf_drafter.device), use_cache=True)
            past = out.past_key_values
            synchronize(tf_drafter.device)
            t0 = time.perf_counter()
            for _ in range(steps):
                out = tf_drafter(token[None].to(tf_drafter.device), past_key_values=past, use_cache=True)
                past = out.past_key_values
            synchronize(tf_drafter.device)
            tf_step = (time.perf_counter() - t0) / steps
        rows.append({"context_tokens": length, "mamba_state_bytes": mamba_bytes, "mamba_step_ms": mamba_step * 1e3,
                     "transformer_kv_bytes": kv_bytes(past), "transformer_step_ms": tf_step * 1e3})
    return rows


# --paper's trees: chains (the paper's main table), the paper's trees (3,3,2,1), (3,2,2,1,1), (2,2,2,1,1,1) and a
# small one, and a chain with a prompt-lookup branch
PAPER_TREES = "1,1,1;1,1,1,1;1,1,1,1,1,1;2,1,1;2,2,1,1;3,3,2,1;3,2,2,1,1;2,2,2,1,1,1;1,1,1+L8"


def parse_args(argv):
    from ray_specdec.defaults import DEFAULT_DRAFTER, DEFAULT_TARGET, DEFAULT_TF_DRAFTER

    p = OneLineParser(prog="python -m ray_specdec bench", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(DEFAULT_TARGET))
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTER), help="Mamba drafter")
    p.add_argument("--tf-drafter", default=str(DEFAULT_TF_DRAFTER), help="Transformer drafter for HF assisted")
    p.add_argument("--trees", default="1,1,1,1;1,1,1,1+L8;2,2,1,1;3,2,2,1,1",
                   help="our tree configs, ';'-separated ('+L8': with a lookup branch of up to 8 tokens)")
    p.add_argument("--prompts", type=int, default=8, help="short held-out prompts")
    p.add_argument("--long-prompts", type=int, default=2, help="long-context (1-2k token) held-out prompts")
    p.add_argument("--qa-prompts", type=int, default=2,
                   help="long-context QA prompts (qa_traffic over held-out documents, cycling through --qa-buckets)")
    p.add_argument("--qa-buckets", default="1024,2048,4096", help="prompt token budgets of the QA prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--contexts", default="1024,2048,4096,8192", help="context sweep lengths")
    p.add_argument("--cut-trees", default="",
                   help="extra methods: trees with their own draft cut, 'TREE@CUT;...' e.g. '3,2,2,1,1@0.06'")
    p.add_argument("--drafter-prefill-window", type=prefill_window_arg, default="auto", metavar="N|auto|all",
                   help="our Mamba drafter's state starts from a request's last N tokens; auto (default): the window "
                        "the drafter's config names (the shipped drafter: 512), else all; all: every token")
    p.add_argument("--bandit-warmup", type=int, default=8,
                   help="held-out prompts (not the measured ones; short, long and QA in the measured run's mix) the "
                        "bandit learns from before it is measured, as a served bandit has learned from earlier "
                        "traffic; 0: it starts cold in the measured run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when there is one)")
    p.add_argument("--dtype", default="float32",
                   help="every model's dtype: float32 (default; greedy text comparable bit for bit across methods), "
                        "bfloat16 / float16 (what large models run in on GPUs; a batched tree forward and a one-token "
                        "forward round differently, so near-ties may flip and the identical-text check may say no), "
                        "float64")
    p.add_argument("--quick", action="store_true", help="small run for CI (under 5 minutes on 2 cores)")
    p.add_argument("--paper", action="store_true",
                   help="the Mamba-drafter paper's experiments in shape on the memory-bound target-neox-large: chains "
                        "and trees against the Transformer drafter and no drafter, greedy and T=1, short, long and QA "
                        "prompts, the bandit, and drafter memory from 1k to 8k tokens (--target etc. still apply)")
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="Markdown table and PNG plots go here")
    add_engine_arguments(p, BENCH_CONFIG, notes={
        "lookup": "the bandit's engine only (its arms are the trees without their own lookup, plus no drafting)",
        "prefix_cache": "off in bench: every method goes over the same prompts, and each pays its own prefill, as "
                        "HF generate's does"})
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.long_prompts, args.qa_prompts, args.max_new_tokens, args.bandit_warmup = 2, 0, 1, 24, 1
        args.trees, args.temperatures, args.contexts = "1,1,1,1;2,2,1,1+L8", "0,1", "1024,4096"
    if args.paper:
        given = {a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}
        if "--target" not in given:
            args.target = "target-neox-large"
        if "--trees" not in given:
            args.trees = PAPER_TREES
        args.qa_buckets = args.qa_buckets if "--qa-buckets" in given else "1024,2048,4096,8000"  # + 64 new in 8k
        args.qa_prompts = args.qa_prompts if "--qa-prompts" in given else 4
    return args


def gemm_panel_formats(target) -> list[str] | None:
    """The element formats of the native GEMM's packed weights for the target's Linear layers (None: no plan takes
    the native path)."""
    from ray_specdec.models.native import gemm

    if target.gemm_plan is None or gemm.NATIVE not in target.gemm_plan.paths:
        return None
    return sorted({str(gemm.exact_panel_dtype(m.weight.detach())).removeprefix("torch.")
                   for m in gemm.linear_layers(target.model)})


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    from ray_specdec.factory import resolve_device
    from ray_specdec.models.drafter.kinds import load_drafter_model
    from ray_specdec.models.loading import resolve_dtype, resolve_model_path
    from ray_specdec.models.native import attention
    from ray_specdec.models.target.kinds import UnsupportedTarget, target_kind
    from ray_specdec.models.target.model import ATTN_IMPLEMENTATION, TargetModel
    from ray_specdec.speculation.bandit import Bandit, BanditConfig
    from ray_specdec.tools.bench_report import write_report
    from ray_specdec.training.corpus import heldout_prompts

    try:
        args = parse_args(argv)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except UsageError as e:
        print(f"error: bad bench arguments: {e}", file=sys.stderr)
        return 2
    try:
        cut_trees = [parse_tree_and_cut(t) for t in (args.cut_trees or "").split(";") if t.strip()]
        trees = [TreeConfig.parse(t) for t in args.trees.split(";")]
        temperatures = [float(t) for t in args.temperatures.split(",")]
        contexts = [int(c) for c in args.contexts.split(",")]
        qa_buckets = [int(b) for b in args.qa_buckets.split(",")]
        if min(qa_buckets) < 64:
            raise ValueError(f"--qa-buckets must be >= 64 tokens, got {args.qa_buckets}")
        config = engine_config_from_args(args, BENCH_CONFIG)
    except ValueError as e:
        print(f"error: bad bench arguments: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        if target_kind(AutoConfig.from_pretrained(resolve_model_path(args.target))) != "attention":
            raise UnsupportedTarget("bench compares against HF's assisted generation, which takes attention targets "
                                    "only; measure SSM and hybrid targets with `generate` or benchmarks/")  # fmt: skip
        target = TargetModel.from_pretrained(args.target, dtype=dtype, device=device)
        # HF's methods run the target as transformers loads it (our engine's copy may take planned GEMM paths)
        hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.target), dtype=dtype,
                                                  attn_implementation=ATTN_IMPLEMENTATION).to(device).eval()
        drafter = load_drafter_model(args.drafter, dtype=dtype, device=device,
                                     prefill_window=args.drafter_prefill_window)
        tf_drafter = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.tf_drafter),
                                                          dtype=dtype).to(device).eval()
    except Exception as e:  # report, don't trace: a missing model is the user's input problem
        print(f"error: cannot load bench models: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
        return 2

    tok = target.tokenizer
    short = [p.token_ids for p in heldout_prompts(args.prompts, 64, 256, seed=args.seed, tokenizer=tok)]
    long = [p.token_ids for p in heldout_prompts(args.long_prompts, 1024, 2048, seed=args.seed + 1, tokenizer=tok)]
    qa = qa_prompts(tok, args.qa_prompts, qa_buckets, args.seed)
    groups = ["short"] * len(short) + ["long"] * len(long) + ["qa"] * len(qa)  # the group of each prompt
    prompts = short + long + qa
    try:
        config = config.with_fields(kv_budget_tokens=fitted_kv_budget(
            config.scheduler.kv_budget_tokens, args.kv_budget_gib, target.kv_bytes_per_token,
            device_room(target.device), given=config.scheduler.kv_budget_tokens != SchedulerConfig().kv_budget_tokens))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fixed = config.with_fields(lookup=0)  # the engines of fixed trees: each tree names its own lookup branch
    ours = SpeculativeEngine(target, drafter, trees[0], config=fixed)
    # our own plain decoding, the baseline of every speedup over it: no drafter and no prompt lookup
    plain = SpeculativeEngine(target, None, config=fixed.with_fields(plain_lookup=0))

    # Every method is a function (temperature, prompts, seed) -> MethodResult.
    methods = [("hf_generate", lambda t, ps, sd: run_hf("hf_generate", hf, ps, args.max_new_tokens, t, sd)),
               ("hf_assisted", lambda t, ps, sd: run_hf("hf_assisted", hf, ps, args.max_new_tokens, t, sd,
                                                        assistant_model=tf_drafter)),
               ("hf_prompt_lookup", lambda t, ps, sd: run_hf("hf_prompt_lookup", hf, ps, args.max_new_tokens, t, sd,
                                                             prompt_lookup_num_tokens=10)),
               ("ours_target_only", lambda t, ps, sd: run_ours("ours_target_only", plain, ps, args.max_new_tokens, t,
                                                               sd, None))]
    # undrafted rounds with prompt lookup (greedy requests only): the service's "none" arm
    if fixed.speculation.plain_lookup:
        looked_up = SpeculativeEngine(target, None, config=fixed)
        methods.append(("ours_prompt_lookup", lambda t, ps, sd: run_ours("ours_prompt_lookup", looked_up, ps,
                                                                         args.max_new_tokens, t, sd, None)))
    for tree in trees:
        name = f"ours_mamba_{'chain' if set(tree.branching) == {1} else 'tree'}_{tree}"
        methods.append((name, lambda t, ps, sd, tree=tree, name=name: run_ours(name, ours, ps, args.max_new_tokens,
                                                                                t, sd, tree)))

    for tree, tree_cut in cut_trees:  # the same trees with a draft cut of their own (not bandit arms)
        name = f"ours_mamba_{'chain' if set(tree.branching) == {1} else 'tree'}_{tree}_cut{tree_cut:g}"
        engine = SpeculativeEngine(target, drafter, tree, config=fixed.with_fields(min_path_prob=tree_cut))
        methods.append((name, lambda t, ps, sd, tree=tree, name=name, engine=engine: run_ours(
            name, engine, ps, args.max_new_tokens, t, sd, tree)))

    # The bandit's arms: the same fixed trees shown beside it, and no drafting (ours_target_only). It keeps learning
    # during the measured run, after a warm-up on other held-out prompts (a served bandit has seen earlier traffic).
    arms = tuple(dict.fromkeys(t.without_lookup() for t in trees))
    bandit = Bandit(BanditConfig(arms=(*arms, NO_TREE)), seed=args.seed)
    bandit_engine = SpeculativeEngine(target, drafter, bandit, config=config)
    n_short, n_long, n_qa = split_like(args.bandit_warmup, (len(short), len(long), len(qa)))
    warmup = ([p.token_ids for p in heldout_prompts(n_short, 64, 256, seed=args.seed + 3, tokenizer=tok)]
              + [p.token_ids for p in heldout_prompts(n_long, 1024, 2048, seed=args.seed + 4, tokenizer=tok)]
              + qa_prompts(tok, n_qa, qa_buckets, args.seed + 5))
    for i, ids in enumerate(tqdm(warmup, desc="bandit warm-up", leave=False)):
        for temperature in temperatures:
            bandit_engine.generate(ids, SamplingParams(temperature=temperature, seed=1000 + i,
                                                       max_new_tokens=args.max_new_tokens))
    methods.append(("ours_mamba_bandit", lambda t, ps, sd: run_ours("ours_mamba_bandit", bandit_engine, ps,
                                                                     args.max_new_tokens, t, sd, None)))

    run_hf("warmup", hf, prompts[:1], 4, 0.0, 0)  # first calls pay one-time costs; keep them out of the timings
    ours.generate(prompts[0], SamplingParams(max_new_tokens=4))
    bandit_engine.scheduler.prepare()  # its controller's calibration, once per engine (the app's before it serves)
    results, group_results = [], []
    for temperature in temperatures:
        # Interleaved: every prompt goes through every method (in a rotating order) before the next prompt, so a
        # machine that speeds up or slows down during the run shifts all methods alike.
        by_name = {name: MethodResult(name, temperature) for name, _ in methods}
        by_group = {(g, name): MethodResult(name, temperature) for g in dict.fromkeys(groups) for name, _ in methods}
        for i, ids in enumerate(tqdm(prompts, desc=f"prompts x {len(methods)} methods (temperature {temperature:g})")):
            for name, run in methods[i % len(methods):] + methods[: i % len(methods)]:
                result = run(temperature, [ids], args.seed + i)
                by_group[groups[i], name].merge(result)
                by_name[name].merge(result)
        baseline, reference = by_name["hf_generate"], by_name["hf_generate"].outputs if temperature == 0 else None
        results += [r.to_dict(baseline, reference) for r in by_name.values()]
        group_results += [{"group": g, "prompts": groups.count(g), **r.to_dict(by_group[g, "hf_generate"], None,
                                                                               brief=True)}
                          for (g, _), r in by_group.items()]

    stream = heldout_prompts(1, max(contexts), max(contexts), seed=args.seed + 2, tokenizer=tok)[0].token_ids
    sweep = context_sweep(drafter, tf_drafter, stream, contexts, steps=10 if args.quick else 30)
    report = {
        "methods": results,
        "groups": group_results,
        "context_sweep": sweep,
        "hardware": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                     "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                     "target_gemm_plan": target.gemm_plan.describe() if target.gemm_plan else None,
                     "target_native_attention": target.native_attention,
                     "target_native_attention_why": target.native_attention_why,
                     "target_native_attention_rows": [attention.MIN_ROWS, attention.MAX_ROWS],
                     "target_lean_forward": target.lean_why is None, "target_lean_forward_why": target.lean_why,
                     "target_batch_invariant": target.batch_invariant,
                     "target_batch_invariant_why": target.batch_invariant_why,
                     "target_native_decoder_why": target.native_decoder_why,
                     "target_gemm_panels": gemm_panel_formats(target),
                     "drafter_native": bool(drafter.native), "drafter_native_why": drafter.native_why,
                     "drafter_panels": getattr(drafter.native, "panel_formats", None),
                     "drafter_cuda_graphs": drafter.graphs is not None, "drafter_graphs_why": drafter.graphs_why,
                     "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                     "device": str(target.device), "dtype": str(dtype).removeprefix("torch.")},
        "settings": {"prompts": len(short), "long_prompts": len(long), "qa_prompts": len(qa),
                     "qa_buckets": qa_buckets, "max_new_tokens": args.max_new_tokens,
                     "trees": [str(t) for t in trees], "min_path_prob": config.speculation.min_path_prob,
                     "bandit_lookup": config.speculation.lookup, "scheduler": asdict(config.scheduler),
                     "speculation": asdict(config.speculation),
                     "drafter_prefill_window": drafter.prefill_window,
                     "cut_trees": [f"{t}@{c:g}" for t, c in cut_trees],
                     "bandit_warmup_prompts": args.bandit_warmup,
                     "bandit_pulls": {str(arm): int(n) for arm, n in zip(bandit.config.arms, bandit_pulls(bandit))},
                     # rounds (warm-up included) the bandit engine's controller ran undrafted, of all its rounds
                     "bandit_undrafted_share": _undrafted_share(bandit_engine.controller),
                     "target": model_label(args.target), "drafter": model_label(args.drafter),
                     "tf_drafter": model_label(args.tf_drafter), "quick": args.quick},
    }
    identical = [m["name"] for m in results if m["identical_to_target"] is False]
    report["greedy_outputs_identical"] = not identical
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    print(write_report(report, args.out))
    if not identical:
        print("greedy outputs identical to HF generate for every method")
    elif dtype in (torch.float16, torch.bfloat16):
        print(f"greedy outputs differ from HF generate for: {', '.join(identical)}. Expected in {dtype}: different "
              "batch shapes round differently and near-ties flip (HF's own assisted modes included); exactness "
              "is checked in float32 or float64 (--dtype float32)")
    else:
        print(f"WARNING: greedy outputs differ from HF generate for: {', '.join(identical)}")
    return 0


def _undrafted_share(controller) -> float | None:
    total = controller.drafted_rounds + controller.undrafted_rounds
    return controller.undrafted_rounds / total if total else None
