"""Flatten a directory of results.json files into one pandas table (one row per job)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from specee.errors import SpeceeError
from specee.results import RESULTS, read_results

# Config keys that identify a job; everything under metrics is kept.
ID_KEYS = ["model.name", "ablation.name", "ablation.mode", "placement.name", "early_exit.kv_policy",
           "early_exit.k", "early_exit.threshold", "dataset.name", "dataset.max_new_tokens", "seed"]


def load_results(root: str | Path) -> list[tuple[Path, dict]]:
    root = Path(root)
    if not root.is_dir():
        raise SpeceeError(f"sweep={root} is not a directory; pass the folder holding the jobs' results.json")
    docs = []
    for path in sorted(root.rglob(RESULTS)):
        docs.append((path, read_results(path, "rerun that job with force=true")))
    return docs


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
