"""Accuracy drift check: compare a fresh accuracy run with a committed baseline.

Baseline file (JSON, one per model, e.g. ``specee/evaluation/baselines/tiny.json``)::

    {"specee_accuracy_baseline": 2, "model": "tiny",
     "settings": {"limit": 200, "num_fewshot": 0, "fewshot_pool": 20, "seed": 0, ...},
     "tasks": {"boolq": {"dense": {"accuracy": 0.61, "n": 200, "measured_spread": 0.0,
                                   "tolerance": 0.069, "justification": "...",
                                   "items": {"20": {"answer": 1, "loglik": -3.1416, "layers": 17.5}, ...}}}},
     "updated": {"dense": {"date": "...", "env": {...}, "machine": {"cpu": "...", "torch": "..."}}}}

Two gates (``experiment.drift_gate``):

- ``exact`` — every item must give the same answer, the same mean layers used and the same
  log-likelihood (within ``LOGLIK_ATOL``); any changed item is reported with its id, old and new
  answer and layers. On a CPU with fixed seeds two runs are identical, so this catches a change of
  one exit decision. Use it where the run is deterministic: the same machine class and torch
  version as the baseline (CI, a developer's box).
- ``interval`` — per-task accuracy within a tolerance (below). Use it across machines, GPUs or
  torch versions, where kernels differ in the last bits and near-tie items may flip.
- ``auto`` (default) — ``exact`` when this run's machine (CPU model, GPU, torch) is the baseline's,
  else ``interval``; the result says which gate ran and why.

Tolerance = measured run-to-run spread (the baseline update evaluates twice; on CPU with fixed
seeds the runs are identical, spread 0) + ``Z`` binomial standard errors of the n-item subset,
``Z * sqrt(p(1-p)/n)`` with the Laplace estimate ``p = (k+1)/(n+2)`` (never zero at 0 % or
100 %). A numerics change that flips a few near-tie items stays inside; a model or library
change that moves accuracy by more than ~95 % sampling noise of the subset is flagged.

Update (writes/merges the entry of each task for this run's ablation)::

    python run.py experiment=accuracy model=tiny ablation=dense experiment.update_baseline=true threads=1
"""
from __future__ import annotations

import math
from datetime import datetime, timezone
from pathlib import Path

from specee.cards import read_card
from specee.errors import SpeceeError
from specee.io import write_json_atomic

FORMAT = 2
Z = 2.0
LOGLIK_ATOL = 1e-3
GATES = ("auto", "exact", "interval")
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


def load(path: Path, model: str | None = None) -> dict:
    """The baseline at ``path``, its shape checked (and, given ``model``, that it is that model's)."""
    if not path.is_file():
        raise SpeceeError(f"no accuracy baseline at {path}; create it with "
                          "experiment.update_baseline=true (see specee/evaluation/drift.py)")
    fix = "regenerate it with experiment.update_baseline=true (or point experiment.baseline at another)"
    doc = read_card(path, fix, {"specee_accuracy_baseline": int}, "specee accuracy baseline")
    if doc.get("specee_accuracy_baseline") != FORMAT:
        raise SpeceeError(f"{path} is not a format-{FORMAT} specee accuracy baseline (per-item records); "
                          "regenerate it with experiment.update_baseline=true")
    for key, kind in (("model", str), ("settings", dict), ("tasks", dict), ("updated", dict)):
        if not isinstance(doc.get(key), kind):
            raise SpeceeError(f"{path} is not a specee accuracy baseline: {key!r} is missing or not a "
                              f"{kind.__name__}; {fix}")
    for task, modes in doc["tasks"].items():
        for mode, e in (modes.items() if isinstance(modes, dict) else [(None, None)]):
            ok = isinstance(e, dict) and all(isinstance(e.get(k), (int, float)) and not isinstance(e.get(k), bool)
                                             for k in ("accuracy", "n", "tolerance")) \
                and isinstance(e.get("items", {}), dict)
            if not ok:
                raise SpeceeError(f"{path} is corrupt: tasks.{task}.{mode} is not an entry with accuracy, n, "
                                  f"tolerance and items; {fix}")
    if model is not None and doc["model"] != model:
        raise SpeceeError(f"baseline {path} is for model {doc['model']!r}, not {model!r}; point "
                          "experiment.baseline at this model's baseline (or update it)")
    return doc


def _check_settings(doc: dict, settings: dict, path: Path) -> None:
    diff = {k: (doc["settings"].get(k), settings.get(k)) for k in SETTINGS
            if doc["settings"].get(k) != settings.get(k)}
    if diff:
        raise SpeceeError(f"baseline {path} was made with other settings (baseline, this run): {diff}; "
                          "rerun with the baseline's settings or update the baseline")


def machine(env: dict) -> dict:
    """What must match for the exact gate: CPU model, GPUs and the torch build."""
    return {"cpu": env.get("cpu"), "gpus": [g.get("name") for g in env.get("gpus") or []],
            "torch": (env.get("packages") or {}).get("torch")}


def update(path: Path, model: str, mode: str, settings: dict, accuracy: dict[str, dict],
           spread: dict[str, float], env: dict, items: dict[str, dict] | None = None) -> dict:
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
            "tolerance": tol, "justification": why, "items": (items or {}).get(task, {})}
    doc["updated"][mode] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "env": env,
                            "machine": machine(env)}
    write_json_atomic(path, doc)
    return doc


def changed_items(base_items: dict, items: dict) -> list[dict]:
    """Items whose answer, mean layers or log-likelihood differ from the baseline's."""
    out = []
    for doc_id in sorted(set(base_items) | set(items), key=lambda k: (len(k), k)):
        old, new = base_items.get(doc_id), items.get(doc_id)
        if old is None or new is None:
            out.append({"id": doc_id, "old": old, "new": new, "why": "missing"})
            continue
        why = [w for w, bad in (
            ("answer", old["answer"] != new["answer"]),
            ("layers", abs((old["layers"] or 0) - (new["layers"] or 0)) > 1e-6),
            ("loglik", old["loglik"] is not None and new["loglik"] is not None
             and abs(old["loglik"] - new["loglik"]) > LOGLIK_ATOL)) if bad]
        if why:
            out.append({"id": doc_id, "old": old, "new": new, "why": "+".join(why)})
    return out


def compare(doc: dict, mode: str, accuracy: dict[str, dict], items: dict[str, dict] | None = None,
            gate: str = "interval") -> list[dict]:
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
            if gate == "exact":
                row["changed"] = changed_items(base.get("items", {}), (items or {}).get(task, {}))
                bad = new["n"] != base["n"] or bool(row["changed"]) or abs(row["delta"]) > 1e-12
            else:
                bad = new["n"] != base["n"] or abs(row["delta"]) > base["tolerance"] + 1e-12
            row["status"] = "DRIFT" if bad else "ok"
        rows.append(row)
    return rows


def table(rows: list[dict], max_items: int = 10) -> str:
    fmt = lambda v, sign="": "-" if v is None else f"{v:{sign}.4f}"  # noqa: E731
    lines = ["| task | mode | baseline | run | delta | tolerance | changed items | status |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['task']} | {r['mode']} | {fmt(r['baseline'])} | {fmt(r['run'])} | "
              f"{fmt(r['delta'], '+')} | {fmt(r['tolerance'])} | "
              f"{len(r['changed']) if 'changed' in r else '-'} | {r['status']} |" for r in rows]
    for r in rows:
        for c in r.get("changed", [])[:max_items]:
            old, new = c["old"] or {}, c["new"] or {}
            lines.append(f"  {r['task']} item {c['id']} ({c['why']}): answer {old.get('answer')!r} -> "
                         f"{new.get('answer')!r}, layers {old.get('layers')} -> {new.get('layers')}, "
                         f"loglik {old.get('loglik')} -> {new.get('loglik')}")
        if len(r.get("changed", [])) > max_items:
            lines.append(f"  {r['task']}: {len(r['changed']) - max_items} more changed items")
    return "\n".join(lines)


def choose_gate(doc: dict, mode: str, gate: str, env: dict | None) -> tuple[str, str]:
    if gate not in GATES:
        raise SpeceeError(f"experiment.drift_gate={gate!r} is unknown; valid: {', '.join(GATES)}")
    if gate != "auto":
        return gate, f"drift_gate={gate}"
    theirs = (doc.get("updated", {}).get(mode) or {}).get("machine")
    ours = machine(env or {})
    if theirs == ours:
        return "exact", f"same machine class and torch as the baseline ({ours['cpu']}, torch {ours['torch']})"
    return "interval", f"another machine or torch than the baseline's ({theirs} vs {ours}): accuracy intervals"


def check(path: Path, mode: str, settings: dict, accuracy: dict[str, dict], items: dict[str, dict] | None = None,
          gate: str = "interval", env: dict | None = None) -> tuple[list[dict], bool, dict]:
    """Rows of the comparison, whether nothing drifted, and which gate ran (and why)."""
    doc = load(path)
    _check_settings(doc, settings, path)
    used, why = choose_gate(doc, mode, gate, env)
    rows = compare(doc, mode, accuracy, items, used)
    return rows, not any(r["status"] == "DRIFT" for r in rows), {"gate": used, "reason": why}
