"""specee entry point: `python run.py [experiment=...] [model=...] [ablation=...] [-m ...]`."""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from specee.config import register

register()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig):
    from specee.errors import SpeceeError, one_line
    from specee.launch import run_experiment, tee_output_to_run_log

    tee_output_to_run_log()
    try:
        return run_experiment(cfg)
    except SpeceeError as err:
        print(f"specee: error: {one_line(err)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    if len(sys.argv) == 1:
        # Bare `python run.py` is the main job: the default reproduction (sweep, stats,
        # accuracy subset, report). Any argument selects a single job (default: experiment=speed).
        sys.argv.append("experiment=reproduce")
    from specee.launch import check_command_line
    check_command_line(sys.argv[1:])  # bad input: one error line and exit 2, before Hydra makes a run folder
    main()
