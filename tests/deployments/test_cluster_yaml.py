"""Deployment configuration without a running cluster: cluster.yaml against Ray's own schema and checks, both Serve
configs against Serve's schema and AppArgs, the GPU config against the cluster it runs on, and the app builder's
argument handling."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import tomllib
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from deployments import AppArgs, app
from deployments.app import (DIRECT_INGRESS_DRAIN_ENV, DIRECT_INGRESS_ENV, PROXY_GUARD_ENV, SMALL_MACHINE_CPUS,
                             SMALL_MACHINE_SERVE_ENV, AppError, _engine_options, direct_ingress_env, parse_app_args,
                             proxy_guard_env, small_machine_serve_env)
from ray_specdec.models.loading import resolve_model_path
from tests.helpers.models import SSM_TARGETS, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
SERVE_CONFIGS = ["serve_config.yaml", "serve_config.gpu.yaml"]


@pytest.fixture(autouse=True)
def _direct_ingress_env_restored():
    """app() outside a running Ray turns Serve's direct ingress on in this process's environment, as it should for
    `serve run`: here that would reach every Ray the later test modules start."""
    keys = (DIRECT_INGRESS_ENV, *DIRECT_INGRESS_DRAIN_ENV, *PROXY_GUARD_ENV)
    saved = {k: os.environ.get(k) for k in keys}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
# The paper's pairing, as the hub has it (tests never reach the hub: CI's network is package registries only): the
# target's attention heads bound tp_size; both models pad the GPT-NeoX tokenizer's 50,277 tokens to these sizes.
PAPER_MODELS = {
    "EleutherAI/pythia-6.9b": {"model_type": "gpt_neox", "vocab_size": 50432, "num_attention_heads": 32},
    "state-spaces/mamba-130m-hf": {"model_type": "mamba", "vocab_size": 50280},
}


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def serve_config(name: str) -> dict:
    return yaml.safe_load((REPO / name).read_text())


def gpu_args() -> dict:
    (application,) = serve_config("serve_config.gpu.yaml")["applications"]
    return application["args"]


def test_cluster_yaml_matches_rays_schema(cluster):
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(cluster, schema)
    broken = dict(cluster, available_node_types={"head": {"node_config": {}}})  # resources missing
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(dict(cluster, docker={"image": "rayproject/ray:2.60.0-py311-gpu", "gpus": 1}), schema)


def test_cluster_yaml_shape(cluster):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(cluster))  # what `ray up` does first: defaults filled in, then all its checks
    assert cluster["provider"]["type"] == "aws"
    types = cluster["available_node_types"]
    head = types[cluster["head_node_type"]]
    workers = {name: t for name, t in types.items() if name != cluster["head_node_type"]}
    assert head["resources"]["GPU"] == 0
    assert set(workers) == {"target_gpu", "drafter_gpu"}  # the targets' ranks, and the drafter pool
    for worker in workers.values():
        assert worker["resources"]["GPU"] >= 1 and worker["node_config"]["InstanceType"].startswith(("g", "p"))
        assert 1 <= worker["min_workers"] <= worker["max_workers"] <= cluster["max_workers"]
    for node in types.values():  # no node falls back to Ray's default machine image, an old Ubuntu 18.04 DLAMI
        assert "base-oss-nvidia-driver-gpu-ubuntu-22.04" in node["node_config"]["ImageId"]
    assert "--dashboard-host=127.0.0.1" in " ".join(cluster["head_start_ray_commands"])


def test_cluster_runs_rays_gpu_image_with_the_pinned_ray_and_torch(cluster):
    """Ray's image tags are {Ray version}-py{Python}-gpu; the setup pins the same Ray (the image's own, and the one this
    repo is tested with) and the CUDA torch wheel before anything else can pull another build."""
    match = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)-gpu", cluster["docker"]["image"])
    assert match, cluster["docker"]["image"]
    version, python = match[1], (int(match[2]), int(match[3]))
    assert version == ray.__version__ and python == (3, 11)
    setup = cluster["setup_commands"]
    assert setup[0] == f'pip install -q "torch==2.13.0" "ray[serve]=={version}"'


def test_cluster_installs_this_package_with_its_gpu_extra(cluster):
    (mount,) = [remote for remote, local in cluster["file_mounts"].items() if local == "."]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["name"] == "ray_specdec" and "gpu" in pyproject["project"]["optional-dependencies"]
    checkout = mount.replace("~", "$HOME")
    assert f'pip install -q --no-build-isolation -e "{checkout}[gpu]"' in cluster["worker_setup_commands"]
    assert f"pip install -q -e {mount}" in cluster["head_setup_commands"]
    # the serve configs travel with the checkout, where the README tells users to find them
    for config in SERVE_CONFIGS:
        assert (REPO / config).is_file() and not any(config.startswith(x) for x in cluster["rsync_exclude"])


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_serve_configs_match_serves_schema_and_app_args(name):
    config = serve_config(name)
    schema = ServeDeploySchema.model_validate(config)
    assert schema.http_options.host == "127.0.0.1" and schema.proxy_location == "HeadOnly"
    (application,) = config["applications"]
    module, attribute = application["import_path"].split(":")
    assert getattr(importlib.import_module(module), attribute) is app
    assert set(application["args"]) <= set(AppArgs.model_fields)
    AppArgs(**application["args"])


def test_serve_config_spells_out_the_defaults():
    (application,) = serve_config("serve_config.yaml")["applications"]
    assert AppArgs(**application["args"]) == AppArgs()


def test_gpu_serve_config_serves_the_paper_pairing():
    args = AppArgs(**gpu_args())
    assert (args.target, args.drafter) == ("EleutherAI/pythia-6.9b", "state-spaces/mamba-130m-hf")
    assert (args.dtype, args.device) == ("bfloat16", "cuda")
    for name in (args.target, args.drafter):
        assert name in PAPER_MODELS and resolve_model_path(name) == name  # a hub id, not a local directory


def test_gpu_serve_config_fits_the_cluster(cluster):
    args = AppArgs(**gpu_args())
    types = cluster["available_node_types"]
    node = types["target_gpu"]["resources"]
    # the target's ranks, one GPU each, in one STRICT_PACK placement group: exactly one node's GPUs
    assert args.tp_size == node["GPU"]
    assert PAPER_MODELS[args.target]["num_attention_heads"] % args.tp_size == 0
    # engine replicas go only where their custom resource is (their drafter needs that node's GPU), and every replica
    # the autoscaler may ask for fits there with its ranks' GPUs and CPUs
    (resource, per_replica), = args.resources.items()
    assert [name for name, t in types.items() if resource in t["resources"]] == ["target_gpu"]
    per_node = int(node[resource] // per_replica)
    assert per_node >= 1 and per_node * args.tp_size <= node["GPU"]
    assert per_node * args.tp_size * args.cpus_per_rank <= node["CPU"]
    assert args.autoscaling and args.max_replicas <= per_node * types["target_gpu"]["max_workers"]
    assert args.min_replicas <= per_node * types["target_gpu"]["min_workers"]  # what `ray up` starts serves at once
    # the drafter pool: only on drafter_gpu nodes (off the targets' GPUs), its most replicas fit their nodes
    pool = args.drafter_pool_options()
    actor, scaling = pool["ray_actor_options"], pool["autoscaling_config"]
    (slot, per_drafter), = actor["resources"].items()
    assert args.drafters == "remote"
    assert [name for name, t in types.items() if slot in t["resources"]] == ["drafter_gpu"]
    drafter_node, most = types["drafter_gpu"], types["drafter_gpu"]["max_workers"]
    per_drafter_node = int(drafter_node["resources"][slot] // per_drafter)
    assert per_drafter_node * actor["num_gpus"] <= drafter_node["resources"]["GPU"]
    assert per_drafter_node * actor["num_cpus"] <= drafter_node["resources"]["CPU"]
    assert 1 <= scaling["min_replicas"] <= per_drafter_node * drafter_node["min_workers"]
    assert scaling["max_replicas"] <= per_drafter_node * most
    assert types["target_gpu"]["max_workers"] + most <= cluster["max_workers"]
    options = _engine_options(args)
    assert options["ray_actor_options"]["resources"] == args.resources
    assert options["ray_actor_options"]["num_gpus"] == 0  # the ranks hold the GPUs


@pytest.mark.parametrize(
    "args, message",
    [
        ({"tp_size": 0}, "tp_size"),
        ({"device": "tpu"}, "device must be cpu, cuda or cuda:N"),
        ({"trees": "3,2;x"}, "tree must be comma-separated"),
        ({"trees": "3,2;3,2"}, "distinct"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas (2) < min_replicas (3)"),
        ({"replicas": 0}, "replicas"),
        ({"kv_budget_gib": 1.0, "kv_budget_tokens": 4096}, "not both"),
        ({"kv_budget_gib": 0}, "kv_budget_gib"),
        ({"max_running": 0}, "max_running"),
        ({"drafter_replicas": 2}, "Extra inputs are not permitted"),
        ({"lookup": 33}, "lookup"),
        ({"tree": "1,1+L"}, "lookup must be written like"),
        ({"drafter_prefill_window": 0}, "drafter_prefill_window"),
    ],
)
def test_app_args_refuse_bad_values(args, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AppArgs(**args)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"tree": "bogus"},
         "bad app arguments: tree: tree must be comma-separated integers like 3,2,2,1,1, got 'bogus'"),
        ({"drafter_replicas": "2"},
         "bad app arguments: drafter_replicas: unknown argument (see AppArgs in deployments/app.py)"),
        ({"tp_size": "0", "lookup": "40"}, "bad app arguments: tp_size: Input should be greater than or equal to 1 "
                                           "(got '0'); lookup: Input should be less than or equal to 32 (got '40')"),
        ({"min_replicas": "3", "max_replicas": "2"}, "bad app arguments: max_replicas (2) < min_replicas (3)"),
    ],
)
def test_serve_run_arguments_fail_in_one_line(raw, message):
    """`serve run deployments:app key=value` hands the builder a dict of strings (Serve's own path, not a copy of it);
    a bad one is an AppError, which the CLI prints as "Error: <message>" without a traceback."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    with pytest.raises(AppError) as info:
        call_user_app_builder_with_args_if_necessary(app, raw)
    assert info.value.format_message() == message


def test_engine_replica_options():
    fixed = _engine_options(AppArgs(replicas=3))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    # each request is one streaming call for its whole life: a replica takes what its scheduler runs and queues
    assert fixed["max_ongoing_requests"] == 64 + 256
    args = AppArgs(min_replicas=1, max_replicas=4, target_ongoing_requests=3)
    scaled = _engine_options(args)
    assert "num_replicas" not in scaled and scaled["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 4, "initial_replicas": 1, "target_ongoing_requests": 3,
        "upscale_delay_s": 30.0, "downscale_delay_s": 600.0, "look_back_period_s": 30.0,
    }  # fmt: skip
    assert "autoscaling_config" not in _engine_options(AppArgs(min_replicas=2, max_replicas=2))
    # tp_size 1: the replica holds the target (and its GPU); tp_size > 1: its ranks hold the devices
    local = _engine_options(AppArgs(device="cuda", num_cpus_per_rank=2))["ray_actor_options"]
    assert (local["num_cpus"], local["num_gpus"]) == (2, 1)
    ranked = _engine_options(AppArgs(device="cuda", tp_size=2, resources={"engine_slot": 2}))["ray_actor_options"]
    assert (ranked["num_cpus"], ranked["num_gpus"], ranked["resources"]) == (0, 0, {"engine_slot": 2})


def test_auto_cpus_per_rank_share_this_machines_cores(monkeypatch):
    """On CPU the replicas' torch threads share the machine's cores (one replica: all of them); on GPUs one."""
    app_module = importlib.import_module("deployments.app")  # (the package's `app` is the builder function)
    monkeypatch.setattr(app_module.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(app_module.ray, "is_initialized", lambda: False)
    assert AppArgs().cpus_per_rank == 8.0
    assert _engine_options(AppArgs())["ray_actor_options"]["num_cpus"] == 8.0
    assert AppArgs(replicas=2).cpus_per_rank == 4.0
    assert AppArgs(tp_size=2).cpus_per_rank == 4.0
    assert AppArgs(min_replicas=1, max_replicas=3).cpus_per_rank == 2.0  # room for the most replicas it may run
    assert AppArgs(replicas=16).cpus_per_rank == 1.0  # at least one
    assert AppArgs(device="cuda").cpus_per_rank == 1.0
    assert AppArgs(num_cpus_per_rank=0.5).cpus_per_rank == 0.5  # a number stands as given
    # a Ray already started with fewer CPUs than the machine has: what it can place
    monkeypatch.setattr(app_module.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(app_module.ray, "cluster_resources", lambda: {"CPU": 2.0})
    assert AppArgs().cpus_per_rank == 2.0
    # a number or a word: one clause for the field, the kinds it takes together, not pydantic's error per kind
    for bad, why in (("-1", "greater than or equal to 0"), ("lots", "a valid number")):
        with pytest.raises(AppError) as info:
            parse_app_args({"num_cpus_per_rank": bad})
        message = info.value.format_message()
        assert message == (f"bad app arguments: num_cpus_per_rank: should be {why}"
                           + (", unable to parse string as a number" if bad == "lots" else "")
                           + f", or should be 'auto' (got {bad!r})")  # fmt: skip


def test_missing_default_models_is_one_clear_line(monkeypatch, tmp_path):
    import ray_specdec.defaults as defaults

    monkeypatch.setattr(defaults, "DEFAULT_TARGET", tmp_path / "target-neox")
    with pytest.raises(AppError) as info:
        app(AppArgs())
    message = info.value.format_message()
    assert "\n" not in message and "embedded default target model is missing" in message and "target=" in message


def bound(application) -> tuple[str, tuple, dict]:
    """(deployment name, constructor args, kwargs) of an application built by `app`."""
    deployment = application._bound_deployment
    return deployment.name, deployment._replica_config.init_args, deployment._replica_config.init_kwargs


def test_builder_wires_the_app(model_dirs):
    target, drafter = model_dirs
    built = app(AppArgs(target=str(target), drafter=str(drafter), trees="1,1;3,2,1", tp_size=2, kv_budget_tokens=4096,
                        max_waiting=3, retry_s=5))  # fmt: skip
    # engine mode (the default): one deployment, the routes and an engine replica in each of its processes; one
    # replica keeps the bandit and the metrics itself (hubs=auto), so no hub deployment
    name, (settings,), server = bound(built)
    assert (name, server["bandit_hub"], server["metrics_hub"]) == ("engine", None, None)
    assert server["replica_kwargs"]["bandit_path"] is None  # no bandit_path given: nothing to save
    for shared in ({"hubs": "deployments"}, {"replicas": 2}, {"min_replicas": 1, "max_replicas": 3}):
        hubs = bound(app(AppArgs(target=str(target), drafter=str(drafter), bandit_path="b.json", **shared)))[2]
        assert (bound(hubs["bandit_hub"])[0], bound(hubs["metrics_hub"])[0]) == ("bandit", "metrics")
        assert bound(hubs["bandit_hub"])[1][1] == os.path.abspath("b.json")  # the hub owns the file
        assert hubs["replica_kwargs"]["bandit_path"] is None
    own = bound(app(AppArgs(target=str(target), drafter=str(drafter), bandit_path="~/b.json")))[2]
    assert own["replica_kwargs"]["bandit_path"] == os.path.expanduser("~/b.json") and own["bandit_hub"] is None
    kwargs = server["replica_kwargs"]
    assert (kwargs["target"], kwargs["drafter"]) == (str(target), str(drafter))
    placement = (kwargs["tp_size"], kwargs["dtype"], kwargs["device"], kwargs["num_cpus_per_rank"])
    assert placement == (2, "auto", "cpu", 1.0)
    assert [str(t) for t in kwargs["policy"].arms] == ["1,1", "3,2,1"]
    scheduler = kwargs["config"].scheduler
    assert (scheduler.kv_budget_tokens, scheduler.max_waiting, kwargs["kv_budget_gib"]) == (4096, 3, None)
    assert kwargs["drafter_prefill_window"] == "auto"
    assert (settings.model_name, settings.tokenizer, settings.retry_s) == ("target", str(target), 5)
    assert built._bound_deployment._deployment_config.max_ongoing_requests == 64 + 3  # max_running + max_waiting
    # router mode: router -> engine deployment, the same replica arguments and hub
    routed = app(AppArgs(target=str(target), drafter=str(drafter), trees="1,1;3,2,1", tp_size=2,
                         kv_budget_tokens=4096, max_waiting=3, retry_s=5, ingress="router"))  # fmt: skip
    name, (routed_settings,), router = bound(routed)
    assert (name, bound(router["engine_handle"])[0], bound(router["bandit_hub"])[0]) == ("router", "engine", "bandit")
    engine_name, (), engine_kwargs = bound(router["engine_handle"])
    assert engine_kwargs["bandit_hub"] is router["bandit_hub"] and routed_settings == settings
    assert {k: v for k, v in engine_kwargs.items() if k not in ("bandit_hub", "metrics_hub", "policy")} == \
        {k: v for k, v in kwargs.items() if k != "policy"}
    windowed = bound(app(AppArgs(target=str(target), drafter=str(drafter), drafter_prefill_window=512, tree="2,1")))[2]
    assert windowed["replica_kwargs"]["drafter_prefill_window"] == 512 and windowed["bandit_hub"] is None
    assert str(windowed["replica_kwargs"]["policy"]) == "2,1" and windowed["replica_kwargs"]["kv_budget_gib"] == 2.0
    plain = bound(app(AppArgs(target=str(target), drafter="none")))[2]
    assert plain["replica_kwargs"]["drafter"] is None and plain["bandit_hub"] is None
    with pytest.raises(AppError, match="drafter: model directory"):
        app(AppArgs(target=str(target), drafter=str(target / "missing")))


def test_builder_refuses_a_drafter_with_another_tokenizer(model_dirs, tmp_path):
    """Checked before any replica loads weights: the pair would draft garbage (every round wasted, silently)."""
    target, drafter = model_dirs
    other = tmp_path / "drafter"
    shutil.copytree(drafter, other)
    tiny_tokenizer().save_pretrained(other)  # other words at the ids the target's tokenizer uses
    with pytest.raises(AppError) as info:
        app(AppArgs(target=str(target), drafter=str(other)))
    message = info.value.format_message()
    assert "\n" not in message and message.startswith("the drafter's tokenizer does not match the target's")
    assert "id 2: target " in message


def test_a_small_machine_gets_quieter_serve_settings_and_a_users_own_stand(monkeypatch):
    """`serve run` builds the app before it starts Ray: the builder sets the settings the controller and replicas of
    that Ray read, on a machine of at most SMALL_MACHINE_CPUS cores, leaving any the user set."""
    env = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
    added = {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000", "RAY_prestart_worker_first_driver": "0",
             "RAY_enable_worker_prestart": "0"}  # fmt: skip
    assert small_machine_serve_env(env, cpus=2) == added
    assert env == {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"} | added
    big: dict = {}
    assert small_machine_serve_env(big, cpus=SMALL_MACHINE_CPUS + 1) == {} and big == {}
    environ = {"PATH": os.environ.get("PATH", "")}
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    app(AppArgs())
    assert {k: environ[k] for k in SMALL_MACHINE_SERVE_ENV} == SMALL_MACHINE_SERVE_ENV


def test_direct_ingress_is_set_before_ray_starts_and_a_users_own_value_stands(monkeypatch):
    """`serve run` builds the app before it starts Ray: the builder turns Serve's direct ingress on there. Not when
    Ray runs already (its Serve read its environment), not over a user's own value, not when switched off."""
    env: dict = {}
    assert direct_ingress_env(True, env, ray_running=False) == env
    assert env == {DIRECT_INGRESS_ENV: "1"} | DIRECT_INGRESS_DRAIN_ENV
    drained = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "30"}  # a user's drain period stands
    assert direct_ingress_env(True, drained, ray_running=False) == {DIRECT_INGRESS_ENV: "1"}
    for on, running, given in ((True, True, {}), (False, False, {}), (True, False, {DIRECT_INGRESS_ENV: "0"})):
        env = dict(given)
        assert direct_ingress_env(on, env, ray_running=running) == {} and env == given
    environ = {"PATH": os.environ.get("PATH", "")}
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    app(AppArgs())
    assert environ[DIRECT_INGRESS_ENV] == "1"
    off = {"PATH": environ["PATH"]}
    monkeypatch.setattr(os, "environ", off)
    app(AppArgs(direct_ingress=False))
    assert DIRECT_INGRESS_ENV not in off
    with pytest.raises(AppError, match="direct_ingress"):
        parse_app_args({"direct_ingress": "sometimes"})


def test_the_proxy_guard_is_set_before_ray_starts_and_a_users_own_value_stands(monkeypatch):
    """The HTTP proxy's middleware (serving/proxy_guard.py) reaches the proxy of the Ray `serve run` starts; not one
    running already, not over a user's own callback; every node's proxy of the cluster gets it from cluster.yaml."""
    env: dict = {}
    assert proxy_guard_env(env, ray_running=False) == PROXY_GUARD_ENV and env == PROXY_GUARD_ENV
    for running, given in ((True, {}), (False, {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "mine:callback"})):
        env = dict(given)
        assert proxy_guard_env(env, ray_running=running) == {} and env == given
    environ = {"PATH": os.environ.get("PATH", "")}
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    app(AppArgs())
    assert {k: environ[k] for k in PROXY_GUARD_ENV} == PROXY_GUARD_ENV
    cluster = yaml.safe_load((REPO / "cluster.yaml").read_text())
    [(name, value)] = PROXY_GUARD_ENV.items()
    for commands in (cluster["head_start_ray_commands"], cluster["worker_start_ray_commands"]):
        assert f"{name}={value} ray start" in commands[-1]


@pytest.mark.parametrize("kind", ["mamba", "jamba"])
def test_tensor_parallel_ssm_targets_fail_in_one_line_before_any_actor(tmp_path, kind):
    """An SSM or hybrid target at tp_size 2: the builder says so (Serve prints it as "Error: ..."), no rank starts."""
    SSM_TARGETS[kind]().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(AppError) as info:
        app(AppArgs(target=str(tmp_path), drafter="none", tp_size=2))
    name = {"mamba": "MambaForCausalLM", "jamba": "JambaForCausalLM"}[kind]
    assert info.value.format_message() == (f"tensor parallelism (tp_size 2) serves attention targets only, not "
                                           f"{name}; serve it with tp_size=1")  # fmt: skip
    assert bound(app(AppArgs(target=str(tmp_path), drafter="none")))[0] == "engine"  # tp_size 1 builds
