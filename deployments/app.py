"""The application builder: `serve run deployments:app key=value ...` or a Serve config file (serve_config.yaml).

One pydantic model (`AppArgs`, extra="forbid") holds every argument; `app(args)` wires the deployments: engine
replicas (the OpenAI routes and the round loop beside the target and the drafter, one replica per data-parallel copy
of the target; each owns tp_size rank actors when tp_size > 1) and, with more than one replica, the shared bandit hub
and metrics hub (one engine replica keeps both inside: `hubs`). With drafters=remote the drafter is a `drafter`
deployment of its own replicas (deployments/drafter.py) that every engine replica drafts through. With
ingress=router, router replicas (the routes alone) answer HTTP and forward each request to an engine replica, and a
request whose engine replica dies continues on another.
Defaults: the embedded default models on CPU, tp_size 1, one engine replica, the bandit over the default tree arms.
Errors in the arguments are reported in one line (`serve run` prints "Error: ...").
"""

import dataclasses
import os
import types
import typing
from typing import Annotated, Any, Literal, get_type_hints

import click
import ray
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator
from ray.serve import Application
from transformers import AutoConfig

from deployments.bandit import BanditHubDeployment
from deployments.drafter import DrafterDeployment
from deployments.drafter_scaling import POLICY
from deployments.engine import EngineDeployment
from deployments.metrics import MetricsHubDeployment
from deployments.router import RouterDeployment, ServerDeployment
from ray_specdec import env
from ray_specdec.config import TreeConfig, default_tree
from ray_specdec.defaults import EMBEDDED_MODEL_NAMES
from ray_specdec.engine.config import PART_CLASSES, EngineConfig, engine_config_from_args
from ray_specdec.models.loading import resolve_model_path
from ray_specdec.models.target.kinds import UnsupportedTarget, check_tensor_parallel
from ray_specdec.models.tokenizer_check import TokenizerMismatch, check_model_pair
from ray_specdec.serving.openai_server import ServerSettings
from ray_specdec.settings import field_bounds, field_docs
from ray_specdec.speculation.bandit import DEFAULT_ARMS, BanditConfig

# Ray Serve's own periodic work, slowed on a machine of a few cores. Every wake-up of the Serve controller's loop
# (every 0.1 s by default) and of each replica's metrics export (0.1 s) preempts one of the engine's OpenMP threads
# mid-step, and the other waits for it at the next barrier. Measured on the 2-core machine: the engine in a process of
# its own beside an idle Serve app, 8 requests, 590 -> 652 tokens/s with both at 1 s; served at 8 requests, tree none
# 471 / 481 -> 498 / 514 and the service's choice 425 / 418 -> 450 / 481 (docs/BENCHMARKS.md). Both only delay what
# the controller does (autoscaling, restarts: by up to a second) and the export of Ray's own metrics.
# Nor does Ray start idle workers ahead of need there (one per CPU for the first driver, by default: processes that
# wake ~150 times a second each and run nothing of this app, which starts actors only). The app's own processes in
# one: served on the 2-core machine, both together with the hubs inside the replica (AppArgs.hubs) took the
# service's choice at one request from 264 to 308 tokens/s and tree none at 8 from 548 to 611 (three runs each,
# alternated; docs/BENCHMARKS.md).
SMALL_MACHINE_CPUS = 4
SMALL_MACHINE_SERVE_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "RAY_prestart_worker_first_driver": "0",
    "RAY_enable_worker_prestart": "0",
}


DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
# A replica of Serve's direct ingress that stops (Ctrl-C of `serve run`, a downscale) first keeps answering for this
# long, so that a load balancer in front can take it out of its list: 30 s by default. The Ray this app starts itself
# is one machine's, with no balancer in front: 2 s (a user's own value stands).
DIRECT_INGRESS_DRAIN_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


def direct_ingress_env(on: bool, environ: dict | None = None, ray_running: bool | None = None) -> dict[str, str]:
    """DIRECT_INGRESS_ENV=1 (and DIRECT_INGRESS_DRAIN_ENV) in `environ` when `on`, unless it is set already (a
    user's value stands) or Ray runs already (its Serve read its environment when it started; setting it here would
    only reach a later Ray of this process); -> what was set."""
    environ = os.environ if environ is None else environ
    ray_running = ray.is_initialized() if ray_running is None else ray_running
    if not on or ray_running or DIRECT_INGRESS_ENV in environ:
        return {}
    added = {DIRECT_INGRESS_ENV: "1"} | {k: v for k, v in DIRECT_INGRESS_DRAIN_ENV.items() if k not in environ}
    environ.update(added)
    return added


# Serve's HTTP proxy with serving/proxy_guard.py's middleware: a request whose replica died gets 503 with Retry-After
# (Serve's proxy: a bare 500), a stream it cut an OpenAI error event, a probe no replica answers 503 within 1.5 s.
PROXY_GUARD_ENV = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "ray_specdec.serving.proxy_guard:middlewares"}


def proxy_guard_env(environ: dict | None = None, ray_running: bool | None = None) -> dict[str, str]:
    """PROXY_GUARD_ENV in `environ` unless Ray runs already (its proxy read its environment when it started: a
    cluster started beforehand sets it in its own, cluster.yaml) or a callback is set (a user's value stands);
    -> what was set."""
    environ = os.environ if environ is None else environ
    ray_running = ray.is_initialized() if ray_running is None else ray_running
    if ray_running:
        return {}
    added = {k: v for k, v in PROXY_GUARD_ENV.items() if k not in environ}
    environ.update(added)
    return added


def small_machine_serve_env(environ: dict | None = None, cpus: int | None = None) -> dict[str, str]:
    """SMALL_MACHINE_SERVE_ENV where this machine has at most SMALL_MACHINE_CPUS cores, set in `environ` unless it
    sets them already (a user's values stand); -> what was set. `serve run` builds the app before it starts Ray, so
    set here (from `app`) they reach the controller and the replicas of the Ray it starts. A cluster started
    beforehand (`ray up`) reads them from its own environment."""
    environ = os.environ if environ is None else environ
    cpus = os.cpu_count() if cpus is None else cpus
    if cpus is None or cpus > SMALL_MACHINE_CPUS:
        return {}
    added = {k: v for k, v in SMALL_MACHINE_SERVE_ENV.items() if k not in environ}
    environ.update(added)
    return added


class AppError(click.ClickException):
    """A one-line configuration error (click prints it as "Error: ..." and `serve run` exits with status 1)."""


class AppOwnArgs(BaseModel):
    """The app's own arguments: the models, the deployment's shape, the tree policy and the KV budget in GiB.
    `AppArgs` adds every field of `EngineConfig` under its own name."""

    model_config = ConfigDict(extra="forbid")

    # models
    target: str | None = None  # HF id or local directory (with tokenizer); None: the embedded default target
    drafter: str | None = None  # HF id or directory of a Mamba model; None: embedded default; "none": no drafting
    model_name: str | None = None  # name served by /v1/models; default: the target directory's name
    tp_size: int = Field(1, ge=1)  # tensor-parallel ranks of the target (DeepSpeed AutoTP)
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "cpu"  # cpu, cuda or cuda:N (checked where the replicas run, not here)
    max_context: int | None = Field(None, ge=2)  # cap on prompt + max_tokens (default: the target's own)
    # engine replicas (each: the loop, a copy of the target and the drafter): a fixed count, or autoscaling when
    # max_replicas > min_replicas
    replicas: int = Field(1, ge=1)
    min_replicas: int | None = Field(None, ge=1)
    max_replicas: int | None = Field(None, ge=1)
    target_ongoing_requests: float = Field(16.0, gt=0)  # requests in flight per engine replica to aim for
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    look_back_period_s: float = Field(30.0, gt=0)  # window of the load average autoscaling acts on
    # CPUs each target rank reserves and runs torch's threads on (tp_size 1: the engine replica). "auto": 1 on GPUs;
    # on CPU this machine's cores (at most the CPUs of a Ray already started here) shared by the ranks of the most
    # engine replicas the app may run, at least 1: on a 2-core machine one replica's target runs on both cores
    num_cpus_per_rank: Annotated[float, Field(ge=0)] | Literal["auto"] = "auto"
    # custom resources of an engine replica; with tp_size > 1 on GPUs, name one that only the ranks' nodes have: the
    # replica's drafter uses a GPU of the node it lands on (cluster.yaml: engine_slot)
    resources: dict[str, float] = Field(default_factory=dict)
    # where requests are drafted: "local" (the drafter in each engine replica's process, beside the target) or
    # "remote" (a `drafter` deployment of replicas of their own, on other nodes or devices than the targets: one call
    # per drafter replica per step, a request's drafter state kept on one replica; docs/DESIGN.md "Drafter modes")
    drafters: Literal["local", "remote"] = "local"
    drafter_pool_replicas: int = Field(1, ge=1)  # drafter replicas (drafters=remote) without drafter_pool_autoscaling
    # Serve's autoscaling_config of the drafter deployment (drafters=remote), e.g. {"min_replicas": 1,
    # "max_replicas": 4, "upscale_delay_s": 10}; its policy is drafter_pool_scale_on's unless it names a "policy"
    drafter_pool_autoscaling: dict[str, Any] | None = None
    # what an autoscaled drafter pool follows: "busy", the share of its time each replica spends drafting
    # (deployments/drafter_scaling.py: ceil(summed busy / drafter_pool_busy_target) replicas, fewer only once the
    # smaller pool stays under 3/4 of the target), or "ongoing", Serve's default (calls in flight per replica against
    # target_ongoing_requests: an engine keeps about one call per replica in flight whatever its load)
    drafter_pool_scale_on: Literal["busy", "ongoing"] = "busy"
    drafter_pool_busy_target: float = Field(0.6, gt=0, le=1)  # busy fraction a drafter replica should stay under
    # Serve's ray_actor_options of a drafter replica (drafters=remote), e.g. {"num_cpus": 2, "num_gpus": 0.5,
    # "resources": {"drafter_slot": 1}}; None: 1 CPU (its torch threads), and 1 GPU where device is not cpu
    drafter_pool_actor_options: dict[str, Any] | None = None
    drafter_pool_shards: int = Field(16, ge=1, le=256)  # requests hash into this many shards, each on one replica
    drafter_pool_timeout_s: float = Field(5.0, gt=0)  # a drafter call unanswered by then: its rounds go undrafted
    # drafters=remote: while the target verifies a round, the drafter replicas draft the next one from the path they
    # rate likeliest (assumed accepted whole, with their own pick of the bonus token); used where the verdict agrees
    drafter_pool_overlap: bool = False
    # drafters=remote: how often, in seconds, an engine moves the shards beyond an even share on a drafter replica to
    # new routes, which Serve places on the replica holding the fewest (a replica added later gets a share of the
    # requests in flight, their states rebuilt there from their token ids; speculation/drafters.py)
    drafter_pool_rebalance_s: float = Field(5.0, gt=0)
    # a request's drafter state starts from its last this many tokens: "auto" (the window the drafter's config names;
    # the shipped drafter: 512), "all" (or None), or a count >= 1 (see docs/BENCHMARKS.md)
    drafter_prefill_window: Annotated[int, Field(ge=1)] | Literal["auto", "all"] | None = "auto"
    # trees and the bandit
    trees: str | list[str] | None = None  # bandit arms, "1,1,1,1;3,3,2,1;none" or a list; None: the default arms
    tree: str | None = None  # one tree for every request instead of the bandit
    bandit_path: str | None = None  # JSON file the bandit state is loaded from and saved to
    # where the bandit's shared state and every replica's metrics gather: "deployments" (a bandit hub and a metrics
    # hub of their own, for any number of replicas), "replica" (inside the engine replica, when it is the app's only
    # one and answers HTTP itself: two processes fewer beside the engine, each waking hundreds of times a second), or
    # "auto": "replica" where it can be (ingress engine, replicas 1, no autoscaling), else "deployments"
    hubs: Literal["auto", "replica", "deployments"] = "auto"
    # KV of the admitted requests per replica (all its ranks), in GiB; "auto": 90% of the device's memory free after
    # loading the models. Either is checked against that memory as the replica starts (ray_specdec/engine/kv_sizing.py).
    kv_budget_gib: Annotated[float, Field(gt=0, allow_inf_nan=False)] | Literal["auto"] | None = 2.0
    kv_budget_tokens: int | None = Field(None, ge=1)  # the same budget in cached tokens (instead of kv_budget_gib)
    # serving shape. "engine": each engine replica answers HTTP itself (the proxy hands it the request; no hop in
    # between). "router": router replicas answer HTTP and forward to the engine replicas, one hop further, and a
    # request whose engine replica dies mid-stream continues on another (docs/INTERFACES.md, "Serving")
    ingress: Literal["engine", "router"] = "engine"
    router_replicas: int = Field(1, ge=1)  # router mode only
    # the ingress replicas also answer HTTP on ports of their own (Ray Serve's direct ingress, 30000 and up, on the
    # same host as the proxy), where a request skips the proxy and its hop: at 32 requests on the 2-core machine that
    # served 1.2x the tokens/s (docs/BENCHMARKS.md). The proxy's port keeps working. Set from here
    # when Ray is not running yet (`serve run`); a cluster started beforehand reads RAY_SERVE_ENABLE_DIRECT_INGRESS
    # from its own environment (cluster.yaml)
    direct_ingress: bool = True
    # on CPU at tp_size 1, the engine replica's other threads (Serve's event loop and HTTP, Ray's) run at niceness 19
    # below its compute threads, so that their wake-ups do not stall the step's OpenMP barriers: 1.11x the tokens/s
    # at one request on the 2-core machine (ray_specdec/serving/thread_priority.py, docs/BENCHMARKS.md)
    compute_first: bool = True
    max_ongoing_requests: int = Field(256, ge=1)  # per router replica (router mode only)
    max_queued_requests: int = Field(256, ge=0)  # waiting for a replica; beyond this Serve answers 503
    recover_timeout_s: float = Field(120.0, gt=0)  # how long an engine waits for restarted target ranks

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

    @field_validator("drafter_pool_autoscaling")
    @classmethod
    def _check_drafter_pool_autoscaling(cls, config: dict[str, Any] | None) -> dict[str, Any] | None:
        if config is not None:
            from ray.serve.config import AutoscalingConfig

            try:
                AutoscalingConfig(**config)
            except Exception as exc:  # pydantic's (Serve's own model), or a TypeError
                why = "; ".join(e["msg"] for e in exc.errors()) if hasattr(exc, "errors") else str(exc)
                raise ValueError(f"not a Serve autoscaling_config: {why}") from None
        return config

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
    def _check_ranges(self) -> "AppOwnArgs":
        lo, hi = self.min_replicas or 1, self.max_replicas or self.replicas
        if hi < lo:
            raise ValueError(f"max_replicas ({hi}) < min_replicas ({lo})")
        if self.kv_budget_tokens is not None and "kv_budget_gib" in self.model_fields_set:
            raise ValueError("give kv_budget_gib or kv_budget_tokens, not both")
        self.engine_config()  # the config's own checks as well
        if self.drafters == "remote" and (self.drafter or "").lower() == "none":
            raise ValueError("drafters=remote needs a drafter (drafter=none drafts nothing)")
        if self.hubs == "replica" and not self._one_replica:
            raise ValueError("hubs=replica needs one engine replica answering HTTP itself (ingress=engine, "
                             "replicas=1, no autoscaling): each replica would learn and count alone")  # fmt: skip
        return self

    @property
    def _one_replica(self) -> bool:
        return self.ingress == "engine" and self.replicas == 1 and not self.autoscaling

    @property
    def hubs_in_replica(self) -> bool:
        """Whether the bandit's state and the metrics stay in the one engine replica (`hubs`)."""
        return self.hubs == "replica" or self.hubs == "auto" and self._one_replica

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None and self.max_replicas > (self.min_replicas or 1)

    @property
    def cpus_per_rank(self) -> float:
        """num_cpus_per_rank with "auto" resolved (the field's comment says how)."""
        if self.num_cpus_per_rank != "auto":
            return float(self.num_cpus_per_rank)
        if self.device != "cpu":
            return 1.0
        cores = os.cpu_count() or 1
        if ray.is_initialized():  # a Ray started with fewer CPUs than the machine has (tests, shared hosts)
            cores = min(cores, int(ray.cluster_resources().get("CPU", cores)))
        if self.drafters == "remote":  # the drafter replicas' cores are theirs
            per_replica = self.drafter_pool_options()["ray_actor_options"].get("num_cpus", 1)
            cores -= int(per_replica * self.drafter_pool_min_replicas)
        replicas = self.max_replicas if self.autoscaling else self.replicas
        return float(max(1, cores // (replicas * self.tp_size)))

    @property
    def drafter_pool_min_replicas(self) -> int:
        if self.drafter_pool_autoscaling is None:
            return self.drafter_pool_replicas
        return int(self.drafter_pool_autoscaling.get("min_replicas", 1))

    def drafter_pool_options(self) -> dict[str, Any]:
        """The `drafter` deployment's Serve options (drafters=remote)."""
        actor = self.drafter_pool_actor_options
        if actor is None:
            actor = {"num_cpus": 1, "num_gpus": 0 if self.device == "cpu" else 1}
        options: dict[str, Any] = {"ray_actor_options": actor}
        if self.drafter_pool_autoscaling is None:
            options["num_replicas"] = self.drafter_pool_replicas
        else:
            options["autoscaling_config"] = dict(self.drafter_pool_autoscaling)
            if self.drafter_pool_scale_on == "busy" and "policy" not in self.drafter_pool_autoscaling:
                options["autoscaling_config"]["policy"] = {
                    "policy_function": POLICY, "policy_kwargs": {"target": self.drafter_pool_busy_target}}
        return options

    def engine_config(self) -> EngineConfig:
        """The fields named as EngineConfig's, read as the CLI's flags are (kv_budget_tokens None: the default)."""
        return engine_config_from_args(self)


def _engine_fields() -> dict[str, tuple]:
    """Every field of EngineConfig's parts as a pydantic field: its type, default, bounds and documentation from the
    dataclass. kv_budget_tokens is the app's own (None: the budget is kv_budget_gib)."""
    own = set(AppOwnArgs.model_fields)
    made = {}
    for cls in PART_CLASSES.values():
        docs, hints, defaults = field_docs(cls), get_type_hints(cls), cls()
        for f in dataclasses.fields(cls):
            if f.name not in own:
                made[f.name] = (hints[f.name], Field(getattr(defaults, f.name), description=docs.get(f.name) or None,
                                                     **field_bounds(f)))
    return made


AppArgs = create_model("AppArgs", __base__=AppOwnArgs, __module__=__name__, **_engine_fields())
AppArgs.__doc__ = "Every argument of the app: AppOwnArgs' and EngineConfig's fields (docs/SETTINGS.md)."


def app(args: AppArgs | dict[str, Any]) -> Application:
    """Serve passes the `key=value` arguments (or a config file's `args`) as a dict: not annotated as a pydantic model,
    so the validation error is ours to word (one line) rather than Serve's traceback."""
    args = args if isinstance(args, AppArgs) else parse_app_args(args)
    small_machine_serve_env()
    direct_ingress_env(args.direct_ingress)
    proxy_guard_env()
    target_path = _model_path(args.target, "target")
    drafter_path = (None if (args.drafter or "").lower() == "none"
                    else _model_path(args.drafter, "drafter", target=args.target))
    if args.tp_size > 1:  # here, before any rank actor starts: an SSM or hybrid target is served unsharded only
        try:
            check_tensor_parallel(AutoConfig.from_pretrained(resolve_model_path(target_path)), args.tp_size)
        except UnsupportedTarget as exc:
            raise AppError(str(exc)) from None
    if drafter_path is not None:
        try:  # here, before any replica loads weights: a mismatched pair would draft garbage, silently
            check_model_pair(target_path, drafter_path)
        except TokenizerMismatch as exc:
            raise AppError(str(exc)) from None
    fixed = TreeConfig.parse(args.tree) if args.tree is not None else None
    arms = tuple(TreeConfig.parse(t) for t in args.trees) if args.trees else DEFAULT_ARMS
    bandit = BanditConfig(arms=arms) if drafter_path is not None and fixed is None else None
    path = os.path.abspath(os.path.expanduser(args.bandit_path)) if args.bandit_path else None
    config = args.engine_config()
    local = args.hubs_in_replica  # the replica's bandit is the whole state, and its metrics the app's
    hub = BanditHubDeployment.bind(bandit, path) if bandit is not None and not local else None
    # every replica's metrics, for GET /metrics (deployments/metrics.py)
    metrics = None if local else MetricsHubDeployment.bind()
    replica = dict(
        target=target_path, drafter=drafter_path, tp_size=args.tp_size, dtype=args.dtype, device=args.device,
        num_cpus_per_rank=args.cpus_per_rank, policy=bandit or fixed or default_tree(args.device),
        config=config, kv_budget_gib=None if args.kv_budget_tokens else args.kv_budget_gib,
        max_context=args.max_context, drafter_prefill_window=args.drafter_prefill_window,
        recover_timeout_s=args.recover_timeout_s, compute_first=args.compute_first,
        bandit_path=path if local and bandit is not None else None,
    )  # fmt: skip
    if args.drafters == "remote" and drafter_path is not None:
        engines = args.max_replicas if args.autoscaling else args.replicas
        pool = DrafterDeployment.options(**args.drafter_pool_options()).bind(
            drafter_path, dtype=args.dtype, device=args.device, prefill_window=args.drafter_prefill_window,
            max_sessions=config.scheduler.max_running * engines,
            num_threads=max(1, round(args.drafter_pool_options()["ray_actor_options"].get("num_cpus", 1))))
        replica |= {"drafter_pool": pool, "drafter_pool_shards": args.drafter_pool_shards,
                    "drafter_pool_timeout_s": args.drafter_pool_timeout_s,
                    "drafter_pool_overlap": args.drafter_pool_overlap,
                    "drafter_pool_rebalance_s": args.drafter_pool_rebalance_s}
    serving = config.serving
    settings = ServerSettings(
        **dataclasses.asdict(serving) | {"api_key": serving.api_key or env.API_KEY.value()},
        model_name=args.model_name or os.path.basename(target_path.rstrip("/")), tokenizer=target_path,
        max_context=args.max_context,
    )  # fmt: skip
    if args.ingress == "engine":
        options = _engine_options(args) | {"max_queued_requests": args.max_queued_requests}
        return ServerDeployment.options(**options).bind(settings, bandit_hub=hub, replica_kwargs=replica,
                                                        metrics_hub=metrics)  # fmt: skip
    engine = EngineDeployment.options(**_engine_options(args)).bind(**replica, bandit_hub=hub, metrics_hub=metrics)
    return RouterDeployment.options(
        num_replicas=args.router_replicas,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
    ).bind(settings, engine_handle=engine, bandit_hub=hub, metrics_hub=metrics)


def parse_app_args(raw: dict[str, Any]) -> AppArgs:
    """AppArgs from `key=value` strings or a config file's values; an invalid one raises AppError in one line."""
    try:
        return AppArgs.model_validate(raw)
    except ValidationError as exc:
        problems, alternatives = [], {}
        for error in exc.errors():
            loc = error["loc"]
            if len(loc) == 2 and loc[0] in _UNION_FIELDS:  # one error per branch of a union: said together below
                alternatives.setdefault(loc[0], ([], error["input"]))[0].append(error["msg"].removeprefix("Input "))
                continue
            name = ".".join(str(part) for part in loc)
            if error["type"] == "extra_forbidden":
                problems.append(f"{name}: unknown argument (see AppArgs in deployments/app.py)")
                continue
            message = error["msg"].removeprefix("Value error, ")  # our validators' messages quote the value
            if error["type"] != "value_error":
                message += f" (got {error['input']!r})"
            problems.append(f"{name}: {message}" if name else message)
        for name, (branches, given) in alternatives.items():  # "should be a valid number, or should be 'auto'"
            problems.append(f"{name}: {', or '.join(branches)} (got {given!r})")
        raise AppError("bad app arguments: " + "; ".join(problems).replace("\n", " ")) from None


def _union_fields() -> frozenset[str]:
    """AppArgs' fields whose type is a union of two or more kinds besides None (a number or a word): pydantic reports
    one error per kind."""
    def kinds(annotation) -> int:
        return len([a for a in typing.get_args(annotation) if a is not type(None)])
    return frozenset(name for name, f in AppArgs.model_fields.items()
                     if typing.get_origin(f.annotation) in (typing.Union, types.UnionType) and kinds(f.annotation) > 1)


_UNION_FIELDS = _union_fields()


def _engine_options(args: AppArgs) -> dict[str, Any]:
    local_target = args.tp_size == 1  # the replica holds the target itself; with ranks, they hold the devices
    gpus = float(args.device != "cpu") if local_target else 0.0
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": args.cpus_per_rank if local_target else 0, "num_gpus": gpus,
                              "resources": args.resources},
        # every request in flight is one long streaming call; the scheduler queues what does not fit its batch
        "max_ongoing_requests": args.max_running + args.max_waiting,
    }  # fmt: skip
    if not args.autoscaling:
        options["num_replicas"] = args.replicas
        return options
    options["autoscaling_config"] = {
        "min_replicas": args.min_replicas or 1,
        "max_replicas": args.max_replicas,
        "initial_replicas": args.min_replicas or 1,
        "target_ongoing_requests": args.target_ongoing_requests,
        "upscale_delay_s": args.upscale_delay_s,
        "downscale_delay_s": args.downscale_delay_s,
        "look_back_period_s": args.look_back_period_s,
    }
    return options


def _model_path(name: str | None, kind: str, target: str | None = None) -> str:
    """A local directory as an absolute path (replicas run elsewhere), a hub id or an embedded model's name as is, or
    the embedded default (a drafter: the one paired with `target`, as the user named it; defaults.py)."""
    if name is None:
        from ray_specdec.defaults import DEFAULT_TARGET, default_drafter_for

        default = DEFAULT_TARGET if kind == "target" else default_drafter_for(target)
        if not (default / "config.json").exists():
            raise AppError(
                f"the embedded default {kind} model is missing (ray_specdec/default_models/{default.name}); "
                f"pass {kind}=<HF id or model directory>"
            )
        return os.fspath(default)
    try:
        path = resolve_model_path(name)
    except (ValueError, FileNotFoundError) as exc:
        raise AppError(f"{kind}: {exc}") from None
    # an embedded model's name resolves on each replica's own machine (a grown one is built into that machine's cache)
    return name if name in EMBEDDED_MODEL_NAMES and not os.path.isdir(name) else path
