"""One job is one ``run.py`` process: the one place the project starts, waits for and ends one.

The main job (experiments/reproduce.py), the sweep launcher (hydra_plugins/specee_launcher) and the
GPU check (specee/gpu_check/runner.py) all run their jobs through here, each in a fresh Python
process — torch's thread settings, allocator state and imported modules never leak from one job
into the next, and timed jobs never overlap.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Sequence

from specee.io import PROJECT_ROOT


def job_command(overrides: Sequence[str], run_dir: Path | str, script: Path | str | None = None) -> list[str]:
    """``python run.py <overrides> hydra.run.dir=<run_dir>``; the folder is quoted for Hydra's
    override parser, so a path with spaces, quotes or ``=`` stays one value."""
    quoted = str(run_dir).replace("\\", "\\\\").replace("'", "\\'")
    return [sys.executable, str(script or PROJECT_ROOT / "run.py"), *overrides, f"hydra.run.dir='{quoted}'"]


def start_job(cmd: list[str], log: IO | None = None, env: dict | None = None, cwd: Path | None = None,
              own_group: bool = False) -> subprocess.Popen:
    """Start ``cmd``; its output to ``log`` (stdout and stderr together) or to this process's own.
    ``own_group``: its own process group, so :func:`end_job` ends its workers (inductor's compile
    pool) with it, and a Ctrl-C meant for the caller does not reach it."""
    return subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT if log is not None else None,
                            env=env, start_new_session=own_group)


def end_job(proc: subprocess.Popen) -> None:
    """End a job started with ``own_group=True`` and everything it started."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def wait_job(proc: subprocess.Popen, timeout: float | None = None) -> int | str:
    """Its exit status, or ``"timeout"`` once it has run ``timeout`` seconds (it is then ended)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_job(proc)
        return "timeout"


@dataclass
class JobRun:
    rc: int | str
    seconds: float


def run_job(overrides: Sequence[str], run_dir: Path | str, script: Path | str | None = None) -> JobRun:
    """Run one job in the foreground (its output on this terminal) and wait for it."""
    t0 = time.perf_counter()
    proc = start_job(job_command(overrides, run_dir, script))
    try:
        rc = proc.wait()
    except KeyboardInterrupt:  # the job got the same Ctrl-C: let it finish saying so, then stop
        proc.wait()
        raise
    return JobRun(rc, round(time.perf_counter() - t0, 1))
