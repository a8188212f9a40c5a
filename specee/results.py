"""The results contract: every results.json carries config, environment and metrics."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from omegaconf import OmegaConf

from specee.env import environment
from specee.errors import SpeceeError
from specee.io import write_json_atomic

RESULTS = "results.json"


def command_line() -> str:
    """The command that produced an artifact, without machine-specific output folders."""
    import sys
    # Output folders and the data root are where this machine keeps things, not part of the recipe
    # (the artifacts' cards record each data file with its sha256).
    args = [a for a in sys.argv[1:] if not a.startswith(("hydra.run.dir=", "hydra.sweep.dir=", "paths.data_root=",
                                                         "experiment.out_dir=", "force="))]
    return " ".join(["python", "run.py", *args])


def output_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig
    return Path(HydraConfig.get().runtime.output_dir)


def finished(out: Path) -> dict | None:
    """A previous complete result in ``out``, if any (results are written atomically)."""
    path = out / RESULTS
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise SpeceeError(f"{path} is corrupt ({err}); delete it or rerun with force=true") from err


def synthetic_inputs(cfg) -> dict:
    """What in this run is not a trained model's behaviour, said in every result."""
    out = {}
    if cfg.model.get("init", "pretrained") == "random":
        shape = cfg.model.path or f"specee/models/shapes/{cfg.model.name}.json"
        out["weights"] = (f"random (model.init=random, shape from {shape}"
                          + (f", cut to {cfg.model.num_layers} layers" if cfg.model.num_layers else "") + ")")
        out["tokenizer"] = "tiny's tokenizer (prompt ids are a subset of the model's vocabulary)"
        mode = cfg.ablation.mode
        if mode in ("specee", "eagle"):
            out["draft"] = "random weights of the draft head's shape"
            if cfg.draft.get("vocab_size"):
                out["draft_vocab"] = f"the first {cfg.draft.vocab_size} token ids (no frequency table for random weights)"
        if mode == "specee":
            out["predictors"] = "random weights of the predictors' shape"
        if mode == "adainfer":
            out["adainfer_svm"] = "fixed stand-in coefficients"
    replay = cfg.early_exit.get("replay")
    if replay:
        out["exits"] = f"replayed from {replay} (predictors and verification run, their outputs ignored)"
    return out


def save(out: Path, cfg, metrics: dict, extra: dict | None = None) -> Path:
    doc = {
        "specee_results": 1,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "env": environment(dtype=cfg.model.dtype, seed=cfg.seed),
        "synthetic": synthetic_inputs(cfg),
        "metrics": metrics,
        **(extra or {}),
    }
    return write_json_atomic(out / RESULTS, doc)
