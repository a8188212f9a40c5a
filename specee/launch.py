"""Dispatch a composed config to its experiment recipe."""
from __future__ import annotations

import torch
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf

from specee.config import validate
from specee.data import data_root
from specee.io import project_path
from specee.errors import SpeceeError


def run_experiment(cfg: DictConfig):
    # Instantiating the dataclasses checks every value's type, not just key names.
    OmegaConf.to_object(cfg)
    validate(cfg)
    data_root(project_path(cfg.paths.data_root))  # every recipe reads it: fail before any work
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target = cfg.experiment._target_
    try:
        fn = get_method(target)
    except Exception as err:  # noqa: BLE001 - hydra wraps import errors in its own type
        raise SpeceeError(f"experiment._target_={target!r} cannot be imported: {err}") from err
    return fn(cfg)
