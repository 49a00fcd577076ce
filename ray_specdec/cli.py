"""Command line: `python -m ray_specdec {generate,bench,loadtest,models,qa-traffic,train-drafter} ...`.

Every command answers bad input with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from ray_specdec.factory import LoadError
from ray_specdec.models.loading import prefill_window_arg

# Subcommands implemented elsewhere: name -> module whose main(argv) -> int handles it.
EXTERNAL_COMMANDS = {
    "bench": "ray_specdec.tools.bench",
    "loadtest": "ray_specdec.tools.loadtest",
    "models": "ray_specdec.tools.list_models",
    "qa-traffic": "ray_specdec.tools.qa_traffic",
    "train-drafter": "ray_specdec.training.distill",
}


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def generate_parser() -> OneLineParser:
    from ray_specdec.engine.config import add_engine_arguments

    p = OneLineParser(prog="python -m ray_specdec generate", description="Generate with tree speculative decoding.")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--target", default=None, help="HF id or local dir of the target (default: embedded target-neox)")
    p.add_argument("--drafter", default=None,
                   help="HF id or local dir of the Mamba drafter, or 'none' (default: embedded)")
    p.add_argument("--tree", default=None,
                   help="tree config N1,N2,... (the chain is 1,1,1,1; '+L6' adds its own lookup branch); default: "
                   "1,1,1 on CPU, 2,2,1,1 on GPU")
    p.add_argument("--drafter-prefill-window", type=prefill_window_arg, default="auto", metavar="N|auto|all",
                   help="the drafter's state starts from a request's last N tokens; auto (default): the window the "
                        "drafter's config names (the shipped drafter: 512), else all; all: every token")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--draft-sampling", choices=["iid", "without_replacement"], default="without_replacement")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16, float64 or auto")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_arguments(p)
    return p


def run_generate(argv: list[str]) -> int:
    from ray_specdec.config import SamplingParams, TreeConfig
    from ray_specdec.engine.config import engine_config_from_args
    from ray_specdec.factory import load_engine

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one result on stdout, at most one line on stderr
    args = generate_parser().parse_args(argv)
    if not args.prompt:
        raise UsageError("--prompt is empty")
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            max_new_tokens=args.max_new_tokens,
            stop=tuple(args.stop),
            draft_sampling=args.draft_sampling,
        )
        tree = TreeConfig.parse(args.tree) if args.tree is not None else None  # None: the device's default
        config = engine_config_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    engine = load_engine(args.target, args.drafter, tree=tree, dtype=args.dtype, device=args.device,
                         config=config, kv_budget_gib=args.kv_budget_gib,
                         drafter_prefill_window=args.drafter_prefill_window)
    try:
        result = engine.generate(args.prompt, params)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          "prompt_tokens": result.prompt_tokens, "stats": result.stats.to_dict()}))
    else:
        print(result.text)
        s = result.stats
        print(
            f"[{s.new_tokens} tokens in {s.total_s:.2f}s, {s.tokens_per_s:.1f} tok/s, {s.rounds} rounds, "
            f"mean accepted length {s.mean_accepted_length:.2f}]",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ["generate", *EXTERNAL_COMMANDS]
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m ray_specdec {{{','.join(commands)}}} [options]  (--help on each)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "generate":
            return run_generate(rest)
        if command in EXTERNAL_COMMANDS:
            return importlib.import_module(EXTERNAL_COMMANDS[command]).main(rest)
        raise UsageError(f"unknown command {command!r}; expected one of {', '.join(commands)}")
    except (UsageError, LoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
