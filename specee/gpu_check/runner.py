"""Running the GPU check's steps: each in its own process group under its cap and the budget, its
file rewritten as it goes, the summary rebuilt after each change; a stop from outside ends the step
and marks it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from specee.gpu_check.goals import KEYS, figures, gpu_only_checks
from specee.gpu_check.outputs import error_text, log_tail, step_path, write_json
from specee.gpu_check.steps import DRY_RUN_STEP_S, MIN_STEP_S, RESERVE_S, Step, dry_run
from specee.gpu_check.summary import write_summary
from specee.io import PROJECT_ROOT as ROOT
from specee.jobs import end_job, job_command, start_job, wait_job


class Check:
    """One check's run: its folder, caches, device facts and the step running now."""

    def __init__(self, out: Path, cache: Path, dry: bool, budget_s: float, steps: list):
        self.out, self.cache, self.dry, self.budget_s, self.steps = out, cache, dry, budget_s, steps
        self.proc: subprocess.Popen | None = None
        self.info: dict | None = None  # check.json, its used seconds kept current
        self.current: dict | None = None
        self.t_start = time.perf_counter()
        self.env = {**os.environ, "HYDRA_FULL_ERROR": "1", "PYTHONUNBUFFERED": "1",
                    "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
                    "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}

    def command(self, step: Step, overrides: list, run_dir: Path) -> list[str]:
        return job_command([*overrides, "force=true"], run_dir)

    def record(self, row: dict) -> None:
        write_json(step_path(self.out, row["step"]), row)
        if self.info is not None:
            self.info["used_s"] = round(time.perf_counter() - self.t_start, 1)
            write_json(self.out / "check.json", self.info)
        write_summary(self.out)

    def run_step(self, step: Step, overrides: list, timeout: float) -> dict:
        name = step.name
        run_dir = self.cache / "runs" / name
        shutil.rmtree(run_dir, ignore_errors=True)
        log = self.out / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        (self.out / "results" / f"{name}.json").unlink(missing_ok=True)  # a rerun's result replaces an old one
        row = {"step": name, "status": "running", "overrides": overrides, "runtime": step.runtime,
               "timeout_s": round(timeout), "expected_s": step.expected_s, "log": f"logs/{name}.log",
               "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "check_pid": os.getpid()}
        self.current = row
        self.record(row)
        t0 = time.perf_counter()
        with log.open("w") as f:
            f.write("$ " + " ".join(self.command(step, overrides, run_dir)) + "\n")
            f.flush()
            # its own process group: a timeout (or this check being stopped) ends its compile workers too
            self.proc = start_job(self.command(step, overrides, run_dir), log=f, env=self.env, cwd=ROOT,
                                  own_group=True)
            row["step_pid"] = self.proc.pid  # its process group, to end by hand if this check is killed
            write_json(step_path(self.out, name), row)
            rc = wait_job(self.proc, timeout)
        self.proc = None
        row["seconds"] = round(time.perf_counter() - t0, 1)
        row["rc"] = rc
        path = run_dir / "results.json"
        if rc == 0 and path.is_file():
            doc = json.loads(path.read_text())
            (self.out / "results").mkdir(exist_ok=True)
            shutil.copyfile(path, self.out / "results" / f"{name}.json")
            m = doc["metrics"]
            row["metrics"] = {k: m[k] for k in KEYS if k in m}
            row["figures"] = figures(m)
            row["dense"] = {k: (m.get("dense") or {}).get(k) for k in ("tokens_per_s", "decode_tokens_per_s",
                                                                      "energy")}
            row["synthetic"] = doc.get("synthetic", {})
            row["gpu_only_checks"] = gpu_only_checks(overrides, m, self.dry)
            row["status"] = "check failed" if any(c["verdict"] == "fail" for c in row["gpu_only_checks"]) \
                else "passed"
        else:
            row["status"] = "timeout" if rc == "timeout" else "failed"
            tail = log_tail(log)
            row["error"] = (f"exceeded its {timeout:.0f} s timeout; the log ends:\n" + tail) if rc == "timeout" \
                else error_text(tail) if rc != 0 else f"no results.json in the run folder\n{tail}"
        self.current = None
        self.record(row)
        return row

    def kill_step(self) -> None:
        if self.proc is not None:
            end_job(self.proc)

    def stopped(self, signum, _frame) -> None:
        """Stopped from outside (a session's time limit, Ctrl-C): end the step, mark it, keep the rest."""
        self.kill_step()
        if self.current is not None:
            row = {**self.current, "status": "killed", "rc": f"signal {signum}",
                   "error": f"the check was stopped (signal {signum}) during this step; the log ends:\n"
                            + log_tail(self.out / self.current["log"])}
            write_json(step_path(self.out, row["step"]), row)
        write_summary(self.out)
        sys.exit(128 + signum)

def run_steps(check: Check) -> list[dict]:
    deadline = check.t_start + check.budget_s - RESERVE_S
    for s in check.steps:  # every selected step has its file from the start
        write_json(step_path(check.out, s.name), {"step": s.name, "status": "pending", "runtime": s.runtime,
                                                  "expected_s": s.expected_s})
    write_summary(check.out)
    rows = []
    for s in check.steps:
        left = deadline - time.perf_counter()
        # A dry run still asks the GPU question (its code is checked) and runs the step on the CPU.
        why = s.skip() if s.skip else None
        overrides = dry_run(s.overrides) if check.dry else s.overrides
        if why and not check.dry:
            row = {"step": s.name, "status": "skipped", "runtime": s.runtime, "why": why, "overrides": overrides}
            check.record(row)
        elif left < MIN_STEP_S and not check.dry:
            row = {"step": s.name, "status": "skipped", "runtime": s.runtime, "overrides": overrides,
                   "why": f"time budget spent ({left:.0f} s left of {check.budget_s:.0f} s); rerun with --steps"}
            check.record(row)
        else:
            row = check.run_step(s, overrides, DRY_RUN_STEP_S if check.dry else min(s.cap_s, left))
            if why:
                row["on_a_gpu_here"] = f"would be skipped: {why}"
                check.record(row)
        rows.append(row)
        print(f"{s.name}: {row['status']} in {row.get('seconds', 0)} s "
              f"({time.perf_counter() - check.t_start:.0f} s of {check.budget_s:.0f} s used)", flush=True)
    return rows
