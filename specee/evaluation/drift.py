"""Accuracy drift check: compare a fresh accuracy run with a committed baseline.

Baseline file (JSON, one per model, e.g. ``specee/evaluation/baselines/tiny.json``)::

    {"specee_accuracy_baseline": 1, "model": "tiny",
     "settings": {"limit": 200, "num_fewshot": 0, "fewshot_pool": 20, "seed": 0, ...},
     "tasks": {"boolq": {"dense": {"accuracy": 0.61, "n": 200, "measured_spread": 0.0,
                                   "tolerance": 0.069, "justification": "..."}}},
     "updated": {"dense": {"date": "...", "env": {...}}}}

Tolerance = measured run-to-run spread (the baseline update evaluates twice; on CPU with fixed
seeds the runs are identical, spread 0) + ``Z`` binomial standard errors of the n-item subset,
``Z * sqrt(p(1-p)/n)`` with the Laplace estimate ``p = (k+1)/(n+2)`` (never zero at 0 % or
100 %). A numerics change that flips a few near-tie items stays inside; a model or library
change that moves accuracy by more than ~95 % sampling noise of the subset is flagged.

Update (writes/merges the entry of each task for this run's ablation)::

    python run.py experiment=accuracy model=tiny ablation=dense experiment.update_baseline=true threads=1
"""
from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

from specee.errors import SpeceeError
from specee.io import write_json_atomic

FORMAT = 1
Z = 2.0
SETTINGS = ("limit", "num_fewshot", "fewshot_pool", "seed", "max_gen_tokens", "max_length",
            "on_overflow", "dtype")


def tolerance(accuracy: float, n: int, spread: float = 0.0) -> tuple[float, str]:
    k = round(accuracy * n)
    p = (k + 1) / (n + 2)
    se = math.sqrt(p * (1 - p) / n)
    why = (f"{Z:g} x binomial SE sqrt(p(1-p)/n) = {Z * se:.4f} with p=(k+1)/(n+2)={p:.3f}, n={n} "
           f"(beyond ~95% sampling noise of the subset) + measured run-to-run spread {spread:.4f} "
           "(two identical runs)")
    return Z * se + spread, why


def load(path: Path) -> dict:
    if not path.is_file():
        raise SpeceeError(f"no accuracy baseline at {path}; create it with "
                          "experiment.update_baseline=true (see specee/evaluation/drift.py)")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise SpeceeError(f"accuracy baseline {path} is corrupt ({err})") from err
    if doc.get("specee_accuracy_baseline") != FORMAT:
        raise SpeceeError(f"{path} is not a format-{FORMAT} specee accuracy baseline")
    return doc


def _check_settings(doc: dict, settings: dict, path: Path) -> None:
    diff = {k: (doc["settings"].get(k), settings.get(k)) for k in SETTINGS
            if doc["settings"].get(k) != settings.get(k)}
    if diff:
        raise SpeceeError(f"baseline {path} was made with other settings (baseline, this run): {diff}; "
                          "rerun with the baseline's settings or update the baseline")


def update(path: Path, model: str, mode: str, settings: dict, accuracy: dict[str, dict],
           spread: dict[str, float], env: dict) -> dict:
    """Merge this run's per-task accuracy for ``mode`` into the baseline at ``path``."""
    doc = load(path) if path.is_file() else {"specee_accuracy_baseline": FORMAT, "model": model,
                                             "settings": settings, "tasks": {}, "updated": {}}
    if doc["model"] != model:
        raise SpeceeError(f"baseline {path} is for model {doc['model']!r}, not {model!r}")
    if doc["tasks"]:
        _check_settings(doc, settings, path)
    doc["settings"] = settings
    for task, m in accuracy.items():
        tol, why = tolerance(m["accuracy"], m["n"], spread[task])
        doc["tasks"].setdefault(task, {})[mode] = {
            "accuracy": m["accuracy"], "n": m["n"], "measured_spread": spread[task],
            "tolerance": tol, "justification": why}
    doc["updated"][mode] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "env": env}
    write_json_atomic(path, doc)
    return doc


def compare(doc: dict, mode: str, accuracy: dict[str, dict]) -> list[dict]:
    """One row per task of the baseline or the run; status ok | DRIFT | not run | no baseline."""
    rows = []
    for task in sorted(set(doc["tasks"]) | set(accuracy)):
        base = doc["tasks"].get(task, {}).get(mode)
        new = accuracy.get(task)
        row = {"task": task, "mode": mode, "baseline": base and base["accuracy"],
               "run": new and new["accuracy"], "delta": None, "tolerance": base and base["tolerance"]}
        if base is None:
            row["status"] = "no baseline"
        elif new is None:
            row["status"] = "not run"
        else:
            row["delta"] = new["accuracy"] - base["accuracy"]
            bad = new["n"] != base["n"] or abs(row["delta"]) > base["tolerance"] + 1e-12
            row["status"] = "DRIFT" if bad else "ok"
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    fmt = lambda v, sign="": "-" if v is None else f"{v:{sign}.4f}"  # noqa: E731
    lines = ["| task | mode | baseline | run | delta | tolerance | status |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['task']} | {r['mode']} | {fmt(r['baseline'])} | {fmt(r['run'])} | "
              f"{fmt(r['delta'], '+')} | {fmt(r['tolerance'])} | {r['status']} |" for r in rows]
    return "\n".join(lines)


def check(path: Path, mode: str, settings: dict, accuracy: dict[str, dict]) -> tuple[list[dict], bool]:
    """Rows of the comparison and whether every compared task stayed within tolerance."""
    doc = load(path)
    _check_settings(doc, settings, path)
    rows = compare(doc, mode, accuracy)
    return rows, not any(r["status"] == "DRIFT" for r in rows)
