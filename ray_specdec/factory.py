"""Building an engine from model names: HF ids, local directories, or the embedded defaults."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ray_specdec.config import TreeConfig, default_tree

if TYPE_CHECKING:
    from ray_specdec.engine.config import EngineConfig


class LoadError(Exception):
    """A model could not be found or loaded; the message is one line for the user."""


def resolve_device(device: str | None) -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise LoadError(f"device {device!r} requested but CUDA is not available")
    if not (str(device) == "cpu" or str(device).startswith("cuda")):
        raise LoadError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto")
    return str(device)


def _default(kind: str, target: str | None = None) -> str:
    """The embedded default target, or the default drafter for `target` (its paired drafter: defaults.py)."""
    from ray_specdec.defaults import DEFAULT_TARGET, default_drafter_for

    path = DEFAULT_TARGET if kind == "target" else default_drafter_for(target)
    if not (path / "config.json").exists():
        raise LoadError(f"no --{kind} given and the embedded default {kind} is missing ({path.name})")
    return os.fspath(path)


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def load_target(name: str | None, dtype="auto", device="cpu"):
    """The target adapter its config calls for (models/target/kinds.py): attention or Mamba."""
    from ray_specdec.models.target.kinds import load_target_model

    name = name or _default("target")
    try:
        return load_target_model(name, dtype=dtype, device=device)
    except Exception as e:  # any failure to load is the user's input problem here
        raise LoadError(f"cannot load target {name!r}: {_first_line(e)}") from None


def load_drafter(name: str | None, dtype="auto", device="cpu", prefill_window: int | str | None = "auto",
                 target: str | None = None):
    """None -> the embedded default drafter (for `target`, as named: its paired drafter, defaults.py); 'none' -> no
    drafter (plain target decoding); else the drafter class its config calls for (models/drafter/kinds.py): Mamba or
    Mamba2."""
    from ray_specdec.models.drafter.kinds import load_drafter_model

    if name is not None and name.lower() == "none":
        return None
    name = name or _default("drafter", target)
    try:
        return load_drafter_model(name, dtype=dtype, device=device, prefill_window=prefill_window)
    except Exception as e:
        raise LoadError(f"cannot load drafter {name!r}: {_first_line(e)}") from None


def check_tokenizers(target: str, drafter: str) -> None:
    """The drafter's tokenizer must agree with the target's on the ids they share (models/tokenizer_check.py);
    read from their tokenizer and config files, before any weights are loaded."""
    from ray_specdec.models.tokenizer_check import TokenizerMismatch, check_model_pair

    try:
        check_model_pair(target, drafter)
    except TokenizerMismatch as e:
        raise LoadError(str(e)) from None
    except Exception as e:
        raise LoadError(f"cannot compare the tokenizers of {target!r} and {drafter!r}: {_first_line(e)}") from None


def load_engine(
    target: str | None = None,
    drafter: str | None = None,
    tree: TreeConfig | None = None,
    dtype: str = "auto",
    device: str | None = "auto",
    config: EngineConfig | None = None,
    kv_budget_gib: float | str | None = None,
    drafter_prefill_window: int | str | None = "auto",
):
    """tree None: the device's default tree (config.default_tree); config: the engine's settings (None:
    EngineConfig(), the defaults the app has too); kv_budget_gib: its KV budget in GiB of the target's cache
    instead of rows ("auto": kv_sizing.AUTO_SHARE of the device's memory free after loading; either budget is checked
    against that memory: LoadError where it does not fit); drafter_prefill_window: the drafter's state starts from
    this many last tokens of a request ("auto": the window the drafter's config names, else all; None or "all":
    all)."""
    from ray_specdec.engine.kv_sizing import device_room, fitted_kv_budget
    from ray_specdec.engine.config import EngineConfig
    from ray_specdec.engine.llm import SpeculativeEngine
    from ray_specdec.engine.scheduler_config import SchedulerConfig
    from ray_specdec.models.loading import resolve_dtype, resolve_model_path, resolve_prefill_window

    device = resolve_device(device)
    try:
        resolve_dtype(dtype, device)
        # check both names before loading anything: a typo in the drafter should not cost a target load
        for kind, name in (("target", target), ("drafter", drafter)):
            if name is not None and name.lower() != "none":
                resolve_model_path(name)
    except ValueError as e:
        raise LoadError(str(e)) from None
    except FileNotFoundError as e:
        raise LoadError(f"cannot load {kind} {name!r}: {e}") from None
    if drafter is None or drafter.lower() != "none":
        check_tokenizers(target or _default("target"), drafter or _default("drafter", target))
    target_model = load_target(target, dtype, device)
    try:  # the drafter resolves "auto" from its config; here only the argument's form is checked
        resolve_prefill_window(drafter_prefill_window, config=None)
    except ValueError:
        raise LoadError(
            f"drafter_prefill_window must be >= 1, 'auto', 'all' or None, got {drafter_prefill_window!r}"
        ) from None
    drafter_model = load_drafter(drafter, dtype, device, drafter_prefill_window, target)
    config = config or EngineConfig()
    scheduler = config.scheduler
    try:
        # the default budget (131,072 rows: ~64 GiB of a 7B model's KV) shrinks to the device; a chosen one must fit
        rows = fitted_kv_budget(scheduler.kv_budget_tokens, kv_budget_gib, target_model.kv_bytes_per_token,
                                device_room(device),
                                given=scheduler.kv_budget_tokens != SchedulerConfig().kv_budget_tokens)
    except ValueError as e:
        raise LoadError(str(e)) from None
    config = replace(config, scheduler=replace(scheduler, kv_budget_tokens=rows))
    tree = tree if tree is not None else default_tree(str(device))
    return SpeculativeEngine(target_model, drafter_model, tree, config=config)
