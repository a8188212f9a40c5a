"""Dispatch a composed config to its experiment recipe."""
from __future__ import annotations

from pathlib import Path

import torch
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf

from specee.config import validate
from specee.data import data_root
from specee.io import project_path
from specee.errors import SpeceeError


class _Tee:
    """Write a stream's output to the terminal and to the job's run.log (a failed sweep job
    must leave a record of why)."""

    def __init__(self, stream, log):
        self._stream, self._log = stream, log

    def write(self, text):
        self._log.write(text)
        self._log.flush()
        return self._stream.write(text)

    def flush(self):
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def tee_output_to_run_log() -> None:
    import sys
    from hydra.core.hydra_config import HydraConfig
    try:
        out = Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # not under hydra.main (a library call)
        return
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "run.log", "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - lives for the process
    sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)


# Recipes that reuse a finished run in their folder (skip-if-done, for sweeps); every other recipe
# refuses a folder that already holds a result unless force=true.
_REUSES_FINISHED = ("experiments.speed.run", "experiments.stats.run", "experiments.accuracy.run")
_LOCK = None  # held for the life of the process


def claim_run_dir(cfg) -> None:
    """One process per run folder: refuse a folder in use by another specee process, or holding
    another finished run (force=true replaces it)."""
    global _LOCK
    import fcntl
    from hydra.core.hydra_config import HydraConfig
    try:
        out = Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        return
    out.mkdir(parents=True, exist_ok=True)
    lock = open(out / ".specee.lock", "a+")  # noqa: SIM115 - held until exit
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SpeceeError(f"run folder {out} is in use by another specee process; wait for it or choose "
                          "another hydra.run.dir") from None
    _LOCK = lock
    if (out / "results.json").is_file() and not cfg.force and cfg.experiment._target_ not in _REUSES_FINISHED:
        raise SpeceeError(f"run folder {out} already holds a finished run (results.json); choose another "
                          "hydra.run.dir or pass force=true to replace it")


def run_experiment(cfg: DictConfig):
    # Instantiating the dataclasses checks every value's type, not just key names.
    OmegaConf.to_object(cfg)
    validate(cfg)
    claim_run_dir(cfg)
    data_root(project_path(cfg.paths.data_root))  # every recipe reads it: fail before any work
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target = cfg.experiment._target_
    try:
        fn = get_method(target)
    except Exception as err:  # noqa: BLE001 - hydra wraps import errors in its own type
        raise SpeceeError(f"experiment._target_={target!r} cannot be imported: {err}") from err
    return fn(cfg)
