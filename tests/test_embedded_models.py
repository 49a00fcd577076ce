"""Embedded model names: where each resolves (a directory of that name wins; hub ids are untouched), the grown ones
built on first use into RAY_SPECDEC_CACHE_DIR, and `python -m ray_specdec models`."""

from __future__ import annotations

import json
import os

import pytest

from ray_specdec.cli import main as cli_main
from ray_specdec.defaults import (DEFAULT_MODEL_NAMES, EMBEDDED_MODEL_NAMES, TARGET_HYBRID_LARGE, TARGET_NEOX_LARGE,
                                  default_drafter_for, default_model_path, embedded_model_path, is_built,
                                  models_cache_dir)
from ray_specdec.models.loading import resolve_model_path
from ray_specdec.models.tokenizer_check import check_model_pair
from ray_specdec.tools.list_models import main



def test_embedded_names():
    assert EMBEDDED_MODEL_NAMES == ("target-neox", "target-llama", "drafter-mamba", "drafter-neox-small",
                                    "target-hybrid", "target-mamba2", "drafter-mamba2", "drafter-mamba-hybrid",
                                    "target-neox-large", "target-hybrid-large")


def test_a_target_with_a_paired_drafter_gets_it_by_default(tmp_path, monkeypatch):
    """target-hybrid (by name or directory) and target-hybrid-large get drafter-mamba-hybrid, distilled against
    target-hybrid; every other target drafter-mamba. The app and load_engine take the same default."""
    from deployments.app import _model_path

    monkeypatch.setenv("RAY_SPECDEC_CACHE_DIR", str(tmp_path))
    paired = default_model_path("drafter-mamba-hybrid")
    assert default_drafter_for("target-hybrid") == default_drafter_for(TARGET_HYBRID_LARGE) == paired
    assert default_drafter_for(os.fspath(default_model_path("target-hybrid"))) == paired
    for other in (None, "target-neox", TARGET_NEOX_LARGE, "target-mamba2", os.fspath(tmp_path)):
        assert default_drafter_for(other) == default_model_path("drafter-mamba"), other
    assert _model_path(None, "drafter", target="target-hybrid") == os.fspath(paired)
    assert _model_path(None, "drafter", target="target-neox") == os.fspath(default_model_path("drafter-mamba"))


@pytest.mark.parametrize("name", DEFAULT_MODEL_NAMES)
def test_shipped_names_resolve_to_the_package_directory(name):
    assert resolve_model_path(name) == os.fspath(default_model_path(name))


def test_a_directory_of_that_name_wins(tmp_path, monkeypatch):
    (tmp_path / "target-neox").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("target-neox") == os.fspath(tmp_path / "target-neox")


@pytest.mark.parametrize("hub_id", ["EleutherAI/pythia-70m", "gpt2", "state-spaces/mamba-130m-hf"])
def test_hub_ids_are_returned_unchanged(hub_id):
    assert resolve_model_path(hub_id) == hub_id


def test_unknown_names_still_fail():
    with pytest.raises(FileNotFoundError):
        resolve_model_path("./target-neox-huge")
    with pytest.raises(ValueError, match="unknown embedded model"):
        embedded_model_path("target-neox-huge")


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_SPECDEC_CACHE_DIR", str(tmp_path))
    assert models_cache_dir() == tmp_path / "models"
    monkeypatch.setenv("RAY_SPECDEC_CACHE_DIR", "")
    assert models_cache_dir() == models_cache_dir().home() / ".cache" / "ray_specdec" / "models"


@pytest.mark.parametrize("name", [TARGET_NEOX_LARGE, TARGET_HYBRID_LARGE])
def test_large_name_is_built_on_first_use(tmp_path, monkeypatch, name):
    monkeypatch.setenv("RAY_SPECDEC_CACHE_DIR", str(tmp_path))
    assert not is_built(name)
    assert resolve_model_path(name) == os.fspath(tmp_path / "models" / name)
    assert is_built(name)
    check_model_pair(name, "drafter-mamba")  # the pair shares its source's tokenizer


def _json_rows(capsys, argv) -> dict[str, dict]:
    assert main(argv) == 0
    return {row["name"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}


def test_models_command_lists_without_building(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAY_SPECDEC_CACHE_DIR", str(tmp_path))
    rows = _json_rows(capsys, ["--no-build", "--json"])
    for name in DEFAULT_MODEL_NAMES:  # counted from the weights' header, as training counted the model
        assert rows[name]["parameters"] == json.loads((default_model_path(name) / "training.json").read_text())[
            "parameters"]
    assert rows["target-neox"]["parameters"] == 13_793_280
    assert rows["target-neox"]["architecture"] == "GPTNeoXForCausalLM"
    assert rows["drafter-mamba"]["made"] == "shipped"
    assert rows[TARGET_NEOX_LARGE] == {"name": TARGET_NEOX_LARGE, "architecture": "-", "parameters": None,
                                       "made": "grown from target-neox", "built": False,
                                       "directory": os.fspath(tmp_path / "models" / TARGET_NEOX_LARGE)}
    assert not (tmp_path / "models" / TARGET_NEOX_LARGE).exists()
    assert rows[TARGET_HYBRID_LARGE]["made"] == "grown from target-hybrid" and not rows[TARGET_HYBRID_LARGE]["built"]


def test_models_command_builds_and_prints_a_table(capsys):
    # this run's cache directory (tests/conftest.py), where other tests may have built the large model already
    assert cli_main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "architecture", "parameters", "made", "built", "directory"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert list(rows) == list(EMBEDDED_MODEL_NAMES)
    assert rows[TARGET_NEOX_LARGE][:7] == [TARGET_NEOX_LARGE, "GPTNeoXForCausalLM", "105.1M", "grown", "from",
                                           "target-neox", "yes"]
    assert rows[TARGET_HYBRID_LARGE][:7] == [TARGET_HYBRID_LARGE, "BambaForCausalLM", "48.3M", "grown", "from",
                                             "target-hybrid", "yes"]
    assert rows["target-neox"][:5] == ["target-neox", "GPTNeoXForCausalLM", "13.8M", "shipped", "yes"]
    assert rows["target-mamba2"][:4] == ["target-mamba2", "Mamba2ForCausalLM", "10.7M", "shipped"]
    assert rows["drafter-mamba2"][:4] == ["drafter-mamba2", "Mamba2ForCausalLM", "2.8M", "shipped"]


def test_models_command_refuses_bad_flags_in_one_line(capsys):
    assert cli_main(["models", "--bogus"]) == 2
    assert capsys.readouterr().err.strip() == "error: unrecognized arguments: --bogus"


def test_app_passes_embedded_names_to_its_replicas(tmp_path, monkeypatch):
    from deployments.app import _model_path

    monkeypatch.setenv("RAY_SPECDEC_CACHE_DIR", str(tmp_path))
    # each replica resolves the name on its own machine; the app's machine checks it (and builds) first
    assert _model_path(TARGET_NEOX_LARGE, "target") == TARGET_NEOX_LARGE
    assert is_built(TARGET_NEOX_LARGE)
    assert _model_path("drafter-mamba", "drafter") == "drafter-mamba"
    (tmp_path / "drafter-mamba").mkdir()
    monkeypatch.chdir(tmp_path)
    assert _model_path("drafter-mamba", "drafter") == os.fspath(tmp_path / "drafter-mamba")
