"""The application builder: `serve run deployments:app key=value ...` or a Serve config file (serve_config.yaml).

One pydantic model (`AppArgs`, extra="forbid") holds every argument; `app(args)` wires four deployments:
router (FastAPI ingress) -> target (one replica owning tp_size rank actors), drafter (replicated, autoscaled) and the
shared bandit hub. Defaults: the embedded default models on CPU, tp_size 1, one drafter replica, the bandit over the
default tree arms. Errors in the arguments are reported in one line (`serve run` prints "Error: ...").
"""

import os
from typing import Annotated, Any, Literal

import click
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from ray.serve import Application

from deployments.bandit import BanditHubDeployment
from deployments.drafter import DrafterDeployment
from deployments.router import RouterDeployment, RouterSettings
from deployments.target import TargetDeployment
from ray_specdec.bandit import DEFAULT_ARMS, BanditConfig
from ray_specdec.engine import DEFAULT_MIN_PATH_PROB
from ray_specdec.config import DEFAULT_LOOKUP, MAX_LOOKUP_TOKENS, TreeConfig, default_tree
from ray_specdec.models.loading import resolve_model_path
from ray_specdec.serving.router import LoadBackoff


class AppError(click.ClickException):
    """A one-line configuration error (click prints it as "Error: ..." and `serve run` exits with status 1)."""


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # models
    target: str | None = None  # HF id or local directory (with tokenizer); None: the embedded default target
    drafter: str | None = None  # HF id or directory of a Mamba model; None: embedded default; "none": no drafting
    model_name: str | None = None  # name served by /v1/models; default: the target directory's name
    tp_size: int = Field(1, ge=1)  # tensor-parallel ranks of the target (DeepSpeed AutoTP)
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "cpu"  # cpu, cuda or cuda:N (checked where the replicas run, not here)
    max_context: int | None = Field(None, ge=2)  # cap on prompt + max_tokens (default: the target's own)
    # drafters: a fixed count, or autoscaling when drafter_max_replicas > drafter_min_replicas
    drafter_replicas: int = Field(1, ge=1)
    drafter_min_replicas: int | None = Field(None, ge=1)
    drafter_max_replicas: int | None = Field(None, ge=1)
    drafter_target_ongoing_requests: float = Field(2.0, gt=0)  # draft calls in flight per replica to aim for
    drafter_upscale_delay_s: float = Field(30.0, ge=0)
    drafter_downscale_delay_s: float = Field(600.0, ge=0)
    drafter_look_back_period_s: float = Field(30.0, gt=0)  # window of the load average autoscaling acts on
    drafter_num_cpus: float = Field(1.0, ge=0)
    drafter_num_gpus: float | None = Field(None, ge=0)  # None: 0 on CPU, 1 on CUDA
    drafter_resources: dict[str, float] = Field(default_factory=dict)  # custom resources, e.g. to pin a node type
    drafter_max_sessions: int = Field(1024, ge=1)  # request states per replica (least recently used evicted)
    # a request's drafter state starts from its last this many tokens: "auto" (the window the drafter's config names;
    # the shipped drafter: 512), "all" (or None), or a count >= 1 (see docs/BENCHMARKS.md)
    drafter_prefill_window: Annotated[int, Field(ge=1)] | Literal["auto", "all"] | None = "auto"
    # drafts stop at depths whose paths the drafter itself rates below this probability (0: always the whole tree)
    min_path_prob: float = Field(DEFAULT_MIN_PATH_PROB, ge=0, lt=1)
    # every drafted tree of a greedy request also verifies up to this many tokens copied from earlier in the context
    # (prompt lookup; 0: off). Trees written with their own "+L<k>" keep theirs.
    lookup: int = Field(DEFAULT_LOOKUP, ge=0, le=MAX_LOOKUP_TOKENS)
    # target
    target_num_cpus_per_rank: float = Field(1.0, ge=0)
    target_resources: dict[str, float] = Field(default_factory=dict)  # of the target replica (ranks: placement group)
    # trees and the bandit
    trees: str | list[str] | None = None  # bandit arms, "1,1,1,1;3,3,2,1;none" or a list; None: the default arms
    tree: str | None = None  # one tree for every request instead of the bandit
    bandit_path: str | None = None  # JSON file the bandit state is loaded from and saved to
    # serving limits and timeouts
    router_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(32, ge=1)  # per router replica
    max_queued_requests: int = Field(64, ge=0)  # beyond this Serve answers 503
    backoff_full_below: int = Field(4, ge=1)  # in-flight requests up to which trees are not cut
    backoff_off_at: int = Field(32, ge=2)  # in-flight requests from which nothing is drafted
    target_timeout_s: float = Field(120.0, gt=0)
    draft_timeout_s: float = Field(30.0, gt=0)

    @field_validator("trees")
    @classmethod
    def _parse_trees(cls, trees: str | list[str] | None) -> list[str] | None:
        if trees is None:
            return None
        items = trees.split(";") if isinstance(trees, str) else trees
        parsed = [TreeConfig.parse(t) for t in items if t.strip() and t.strip().lower() != "none"]
        if not parsed or len(set(parsed)) != len(parsed):
            raise ValueError("trees must list distinct non-empty tree configs, e.g. '1,1,1,1;3,3,2,1;none'")
        if any(t.strip().lower() == "none" for t in items):  # no drafting as an arm of its own
            parsed.append(TreeConfig(()))
        return [str(t) for t in parsed]

    @field_validator("tree")
    @classmethod
    def _parse_tree(cls, tree: str | None) -> str | None:
        return None if tree is None else str(TreeConfig.parse(tree))

    @field_validator("device")
    @classmethod
    def _check_device(cls, device: str) -> str:
        if device != "cpu" and not (device == "cuda" or device.startswith("cuda:") and device[5:].isdigit()):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
        return device

    @model_validator(mode="after")
    def _check_ranges(self) -> "AppArgs":
        lo, hi = self.drafter_min_replicas or 1, self.drafter_max_replicas or self.drafter_replicas
        if hi < lo:
            raise ValueError(f"drafter_max_replicas ({hi}) < drafter_min_replicas ({lo})")
        if self.backoff_off_at <= self.backoff_full_below:
            raise ValueError("backoff_off_at must be greater than backoff_full_below")
        return self

    @property
    def autoscaling(self) -> bool:
        return self.drafter_max_replicas is not None and self.drafter_max_replicas > (self.drafter_min_replicas or 1)


def app(args: AppArgs | dict[str, Any]) -> Application:
    """Serve passes the `key=value` arguments (or a config file's `args`) as a dict: not annotated as a pydantic model,
    so the validation error is ours to word (one line) rather than Serve's traceback."""
    args = args if isinstance(args, AppArgs) else parse_app_args(args)
    target_path = _model_path(args.target, "target")
    drafter_path = None if (args.drafter or "").lower() == "none" else _model_path(args.drafter, "drafter")
    settings = _router_settings(args, target_path, drafter_path is not None)
    target = TargetDeployment.options(
        ray_actor_options={"num_cpus": 0, "resources": args.target_resources},
        max_ongoing_requests=max(256, 2 * args.router_replicas * args.max_ongoing_requests),
    ).bind(target_path, tp_size=args.tp_size, dtype=args.dtype, device=args.device,
           num_cpus_per_rank=args.target_num_cpus_per_rank)  # fmt: skip
    drafter = None
    if drafter_path is not None:
        drafter = DrafterDeployment.options(**_drafter_options(args)).bind(
            drafter_path, _vocab_size(target_path), dtype=args.dtype, device=args.device,
            max_sessions=args.drafter_max_sessions, min_path_prob=args.min_path_prob,
            prefill_window=args.drafter_prefill_window,
        )  # fmt: skip
    hub = None
    if settings.bandit is not None:
        path = os.path.abspath(os.path.expanduser(args.bandit_path)) if args.bandit_path else None
        hub = BanditHubDeployment.bind(settings.bandit, path)
    return RouterDeployment.options(
        num_replicas=args.router_replicas,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
    ).bind(target, drafter, hub, settings)


def parse_app_args(raw: dict[str, Any]) -> AppArgs:
    """AppArgs from `key=value` strings or a config file's values; an invalid one raises AppError in one line."""
    try:
        return AppArgs.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            name = ".".join(str(part) for part in error["loc"])
            if error["type"] == "extra_forbidden":
                problems.append(f"{name}: unknown argument (see AppArgs in deployments/app.py)")
                continue
            message = error["msg"].removeprefix("Value error, ")  # our validators' messages quote the value
            if error["type"] != "value_error":
                message += f" (got {error['input']!r})"
            problems.append(f"{name}: {message}" if name else message)
        raise AppError("bad app arguments: " + "; ".join(problems).replace("\n", " ")) from None


def _router_settings(args: AppArgs, target_path: str, drafting: bool) -> RouterSettings:
    fixed = TreeConfig.parse(args.tree) if args.tree is not None else None
    arms = tuple(TreeConfig.parse(t) for t in args.trees) if args.trees else DEFAULT_ARMS
    return RouterSettings(
        model_name=args.model_name or os.path.basename(target_path.rstrip("/")),
        tokenizer=target_path,
        bandit=BanditConfig(arms=arms) if drafting and fixed is None else None,
        tree=fixed or default_tree(args.device),
        max_context=args.max_context,
        backoff=LoadBackoff(args.backoff_full_below, args.backoff_off_at),
        target_timeout_s=args.target_timeout_s,
        draft_timeout_s=args.draft_timeout_s,
        lookup=args.lookup,
    )


def _drafter_options(args: AppArgs) -> dict[str, Any]:
    gpus = args.drafter_num_gpus if args.drafter_num_gpus is not None else float(args.device != "cpu")
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": args.drafter_num_cpus, "num_gpus": gpus, "resources": args.drafter_resources},
        # a request has at most one draft call in flight: the router's concurrency bounds the drafters' queue
        "max_ongoing_requests": max(8, args.router_replicas * args.max_ongoing_requests),
    }
    if not args.autoscaling:
        options["num_replicas"] = args.drafter_replicas
        return options
    options["autoscaling_config"] = {
        "min_replicas": args.drafter_min_replicas or 1,
        "max_replicas": args.drafter_max_replicas,
        "initial_replicas": args.drafter_min_replicas or 1,
        "target_ongoing_requests": args.drafter_target_ongoing_requests,
        "upscale_delay_s": args.drafter_upscale_delay_s,
        "downscale_delay_s": args.drafter_downscale_delay_s,
        "look_back_period_s": args.drafter_look_back_period_s,
    }
    return options


def _model_path(name: str | None, kind: str) -> str:
    """A local directory as an absolute path (replicas run elsewhere), a hub id as is, or the embedded default."""
    if name is None:
        from ray_specdec.defaults import DEFAULT_DRAFTER, DEFAULT_TARGET

        default = DEFAULT_TARGET if kind == "target" else DEFAULT_DRAFTER
        if not (default / "config.json").exists():
            raise AppError(
                f"the embedded default {kind} model is missing (ray_specdec/default_models/{default.name}); "
                f"pass {kind}=<HF id or model directory>"
            )
        return os.fspath(default)
    try:
        return resolve_model_path(name)
    except (ValueError, FileNotFoundError) as exc:
        raise AppError(f"{kind}: {exc}") from None


def _vocab_size(target_path: str) -> int:
    """The target's vocabulary size (the drafters draft in it), read from its config without loading weights."""
    from transformers import AutoConfig

    try:
        return int(AutoConfig.from_pretrained(target_path).get_text_config(decoder=True).vocab_size)
    except Exception as exc:
        raise AppError(f"cannot read the target's config from {target_path!r}: {type(exc).__name__}: {exc}") from None
