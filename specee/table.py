"""Flatten a directory of results.json files into one pandas table (one row per job)."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from specee.errors import SpeceeError
from specee.results import RESULTS

# Config keys that identify a job; everything under metrics is kept.
ID_KEYS = ["model.name", "ablation.name", "ablation.mode", "placement.name", "early_exit.kv_policy",
           "early_exit.k", "early_exit.threshold", "dataset.name", "dataset.max_new_tokens", "seed"]


def load_results(root: str | Path) -> list[tuple[Path, dict]]:
    root = Path(root)
    if not root.is_dir():
        raise SpeceeError(f"sweep={root} is not a directory; pass the folder holding the jobs' results.json")
    docs = []
    for path in sorted(root.rglob(RESULTS)):
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise SpeceeError(f"{path} is corrupt ({err}); rerun that job with force=true") from None
        check_results(path, doc)
        docs.append((path, doc))
    return docs


def check_results(path: Path, doc) -> None:
    """The results contract: a specee results document with config, env and metrics."""
    problems = []
    if not isinstance(doc, dict) or doc.get("specee_results") != 1:
        problems.append("no 'specee_results': 1 marker")
    else:
        cfg = doc.get("config")
        if not isinstance(cfg, dict) or not all(isinstance(cfg.get(k), dict) for k in ("model", "ablation", "experiment")):
            problems.append("no config with model, ablation and experiment")
        if not isinstance(doc.get("env"), dict):
            problems.append("no env")
        if not isinstance(doc.get("metrics"), dict):
            problems.append("no metrics")
    if problems:
        raise SpeceeError(f"{path} is not a specee results file ({'; '.join(problems)}); remove it from the "
                          "sweep folder or rerun that job with force=true")


def flatten(path: Path, doc: dict) -> dict:
    cfg = pd.json_normalize(doc.get("config", {}), sep=".").iloc[0].to_dict() if doc.get("config") else {}
    row = {"job_dir": str(path.parent), "created": doc.get("created"),
           "experiment": str(cfg.get("experiment._target_", "")).split(".")[-2:-1][0]
           if cfg.get("experiment._target_") else None}
    row.update({k: cfg.get(k) for k in ID_KEYS})
    env = doc.get("env", {})
    row.update({"env.cpu": env.get("cpu"), "env.gpu": (env.get("gpus") or [{}])[0].get("name"),
                "env.torch": env.get("packages", {}).get("torch"), "env.threads": env.get("torch_threads"),
                "env.git_commit": (env.get("git") or {}).get("commit")})
    metrics = pd.json_normalize(doc.get("metrics", {}), sep=".")
    if len(metrics):
        for k, v in metrics.iloc[0].to_dict().items():
            if not isinstance(v, (list, dict)):
                row[f"metrics.{k}"] = v
    return row


def results_table(root: str | Path) -> pd.DataFrame:
    docs = load_results(root)
    if not docs:
        raise SpeceeError(f"no {RESULTS} under {root}; run a sweep first")
    return pd.DataFrame([flatten(p, d) for p, d in docs])
