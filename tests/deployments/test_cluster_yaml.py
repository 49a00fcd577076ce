"""Deployment configuration without a running cluster: cluster.yaml against Ray's own schema, serve_config.yaml
against Serve's schema and AppArgs, and the app builder's argument handling."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from deployments import AppArgs, app
from deployments.app import AppError, _drafter_options

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def test_cluster_yaml_matches_rays_schema(cluster):
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(cluster, schema)
    broken = dict(cluster, available_node_types={"head": {"node_config": {}}})  # resources missing
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_cluster_yaml_shape(cluster):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(cluster))  # what `ray up` does first: defaults filled in, then all its checks
    assert cluster["provider"]["type"] == "aws"
    types = cluster["available_node_types"]
    head, workers = types[cluster["head_node_type"]], [t for name, t in types.items() if name != "head"]
    assert head["resources"]["GPU"] == 0
    assert len(workers) == 1 and workers[0]["node_config"]["InstanceType"].startswith(("g", "p"))
    assert 1 <= workers[0]["min_workers"] <= workers[0]["max_workers"] <= cluster["max_workers"]
    setup = " ".join(cluster["setup_commands"])
    assert "torch==2.13.0" in setup and "pip install -q -e ~/ray_specdec" in setup
    assert cluster["file_mounts"] == {"~/ray_specdec": "."}


def test_serve_config_is_valid_and_spells_out_the_defaults():
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config)
    assert schema.http_options.host == "127.0.0.1"
    (application,) = config["applications"]
    assert application["import_path"] == "deployments:app"
    assert AppArgs(**application["args"]) == AppArgs()


@pytest.mark.parametrize(
    "args, message",
    [
        ({"tp_size": 0}, "tp_size"),
        ({"device": "tpu"}, "device must be cpu, cuda or cuda:N"),
        ({"trees": "3,2;x"}, "tree must be comma-separated"),
        ({"trees": "3,2;3,2"}, "distinct"),
        ({"drafter_min_replicas": 3, "drafter_max_replicas": 2}, "drafter_max_replicas (2) < drafter_min_replicas (3)"),
        ({"backoff_full_below": 8, "backoff_off_at": 8}, "backoff_off_at"),
        ({"replicas": 2}, "Extra inputs are not permitted"),
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
        ({"tree": "bogus"}, "bad app arguments: tree: tree must be comma-separated integers like 3,2,2,1,1, got 'bogus'"),
        ({"replicas": "2"}, "bad app arguments: replicas: unknown argument (see AppArgs in deployments/app.py)"),
        ({"tp_size": "0", "lookup": "40"}, "bad app arguments: tp_size: Input should be greater than or equal to 1 "
                                           "(got '0'); lookup: Input should be less than or equal to 32 (got '40')"),
        ({"drafter_min_replicas": "3", "drafter_max_replicas": "2"},
         "bad app arguments: drafter_max_replicas (2) < drafter_min_replicas (3)"),
    ],
)
def test_serve_run_arguments_fail_in_one_line(raw, message):
    """`serve run deployments:app key=value` hands the builder a dict of strings (Serve's own path, not a copy of it);
    a bad one is an AppError, which the CLI prints as "Error: <message>" without a traceback."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    with pytest.raises(AppError) as info:
        call_user_app_builder_with_args_if_necessary(app, raw)
    assert info.value.format_message() == message


def test_autoscaling_options():
    fixed = _drafter_options(AppArgs(drafter_replicas=3))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    args = AppArgs(drafter_min_replicas=1, drafter_max_replicas=4, drafter_target_ongoing_requests=3)
    scaled = _drafter_options(args)
    assert scaled["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 4, "initial_replicas": 1, "target_ongoing_requests": 3,
        "upscale_delay_s": 30.0, "downscale_delay_s": 600.0, "look_back_period_s": 30.0,
    }  # fmt: skip
    assert _drafter_options(AppArgs(device="cuda"))["ray_actor_options"]["num_gpus"] == 1


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
    built = app(AppArgs(target=str(target), drafter=str(drafter), trees="1,1;3,2,1", tp_size=2))
    name, (target_app, drafter_app, hub_app, settings), _ = bound(built)
    assert name == "router" and [bound(a)[0] for a in (target_app, drafter_app, hub_app)] == ["target", "drafter",
                                                                                              "bandit"]  # fmt: skip
    assert bound(target_app)[1:] == ((str(target),), {"tp_size": 2, "dtype": "auto", "device": "cpu",
                                                       "num_cpus_per_rank": 1.0})  # fmt: skip
    assert bound(drafter_app)[1] == (str(drafter), 128)  # the target's vocabulary, read from its config
    assert bound(drafter_app)[2]["prefill_window"] == "auto"
    windowed = app(AppArgs(target=str(target), drafter=str(drafter), drafter_prefill_window=512))
    assert bound(bound(windowed)[1][1])[2]["prefill_window"] == 512
    assert [str(t) for t in settings.bandit.arms] == ["1,1", "3,2,1"] and settings.model_name == "target"
    _, (_, no_drafter, no_hub, plain), _ = bound(app(AppArgs(target=str(target), drafter="none")))
    assert no_drafter is None and no_hub is None and plain.bandit is None
    with pytest.raises(AppError, match="drafter: model directory"):
        app(AppArgs(target=str(target), drafter=str(target / "missing")))
