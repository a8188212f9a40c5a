"""The GPU check's output folder: whole-or-nothing writes, one file per step, the logs' tails, and
the step files read back in the plan's order (a step whose check died is marked killed)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from specee.gpu_check.steps import STEP_NAMES


def write_json(path: Path, doc) -> None:
    """Whole or not at all: a check killed mid-write leaves the previous version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)

def write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

def step_path(out: Path, name: str) -> Path:
    return out / "steps" / f"{name}.json"

def last_line(text) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""

def log_tail(path: Path, lines: int = 120, chars: int = 12000) -> str:
    """The end of a step's log as a terminal shows it (a progress bar's redraws collapsed)."""
    try:
        raw = path.read_text(errors="replace")
    except OSError:
        return ""
    shown = [ln.rsplit("\r", 1)[-1] for ln in raw.splitlines()]
    return "\n".join(shown[-lines:])[-chars:]

def error_text(tail: str) -> str:
    """The part of a log's tail that says what went wrong: from the first traceback or error
    line on (the full text, not Hydra's closing hint), else the whole tail."""
    lines = tail.splitlines()
    for i, ln in enumerate(lines):
        if ln.startswith(("Traceback", "specee: error:", "Error executing job")):
            return "\n".join(lines[i:])
    return tail

def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or (Path.home() / ".cache")
    try:
        p = Path(base) / "specee" / "gpu_check"
        p.mkdir(parents=True, exist_ok=True)
        return p
    except OSError:  # a read-only home: the temp folder
        return Path(tempfile.gettempdir()) / "specee_gpu_check"

def alive(pid) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

def read_steps(out: Path) -> list[dict]:
    """The step files in the plan's order (a rerun of some steps keeps the others' files). A step
    still ``running`` whose check is gone was killed with it (a SIGKILL leaves no one to say so)."""
    rows = []
    for name in STEP_NAMES:
        p = step_path(out, name)
        if not p.is_file():
            continue
        try:
            row = json.loads(p.read_text())
        except json.JSONDecodeError as err:
            row = {"step": name, "status": "unreadable", "error": f"{p.name}: {err}"}
        if row.get("status") == "running" and row.get("check_pid") != os.getpid() and not alive(row.get("check_pid")):
            row = {**row, "status": "killed", "error": "the check ended during this step (killed from outside); "
                                                       f"the log ends:\n{log_tail(out / row['log'])}"}
        rows.append(row)
    return rows
