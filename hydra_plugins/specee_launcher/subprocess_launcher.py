"""Hydra launcher that runs each sweep job in a fresh Python process, one after another.

Hydra's basic launcher runs every job in the launching process, so torch thread settings,
allocator state and imported modules leak from one job into the next — and timing jobs must not
overlap, which rules out parallel local launchers. This one re-invokes the same script with the
job's overrides and ``hydra.run.dir`` set to the job's sweep subdirectory (specee/jobs.py: the
one job runner the main job and the GPU check use too). For clusters use
``hydra/launcher=slurm`` (hydra-submitit-launcher) instead.
"""

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.plugins.launcher import Launcher
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from specee.jobs import run_job

log = logging.getLogger(__name__)


@dataclass
class SubprocessLauncherConf:
    _target_: str = "hydra_plugins.specee_launcher.subprocess_launcher.SubprocessLauncher"
    stop_on_failure: bool = False


ConfigStore.instance().store(group="hydra/launcher", name="subprocess", node=SubprocessLauncherConf)


class SubprocessLauncher(Launcher):
    def __init__(self, stop_on_failure: bool = False) -> None:
        self.stop_on_failure = stop_on_failure
        self.config: Optional[DictConfig] = None
        self.hydra_context = None

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        script = sys.argv[0]
        runs, failed = [], []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            sweep_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_cfg):
                sweep_cfg.hydra.job.id = sweep_cfg.hydra.job.num = idx
            HydraConfig.instance().set_config(sweep_cfg)  # the subdir interpolates hydra:job.*
            out = Path(sweep_cfg.hydra.sweep.dir) / str(sweep_cfg.hydra.sweep.subdir)
            shown = " ".join(filter_overrides(overrides))
            log.info(f"#{idx} : {shown}  ->  {out}")
            rc = run_job(list(overrides), out, script=script).rc
            ret = JobReturn(overrides=list(overrides), working_dir=str(out), task_name=sweep_cfg.hydra.job.name)
            ret.status, ret.return_value = JobStatus.COMPLETED, rc
            runs.append(ret)
            if rc != 0:
                failed.append(f"#{idx} ({shown}): exit status {rc}")
                log.error(f"job #{idx} failed with exit status {rc}; its message is above")
                if self.stop_on_failure:
                    break
        if failed:
            # Each job already printed its own error; end the sweep with a summary, not a traceback.
            log.error(f"{len(failed)} of {len(job_overrides)} jobs failed:\n  " + "\n  ".join(failed))
            raise SystemExit(1)
        return runs
