"""The results contract: every results.json carries config, environment and metrics."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from omegaconf import OmegaConf

from specee.env import environment
from specee.errors import SpeceeError
from specee.io import read_json, write_json_atomic

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
    """A previous complete result in ``out``, if any (results are written atomically).

    A results.json that is there but not whole (empty, cut, not UTF-8, not a specee result) is
    refused in one line, never rerun over: results are written atomically, so such a file is not
    this harness's half-write but a damaged disk or a hand edit, and what it held may be someone's
    only copy. The rest of a sweep still runs; the sweep ends listing the refused job."""
    path = out / RESULTS
    if not path.is_file():
        return None
    return read_results(path, "delete it (or move it aside) or rerun that job with force=true")


def read_results(path: Path, fix: str) -> dict:
    """One results.json, whole and holding the results contract; else SpeceeError saying what is
    wrong with it and ``fix``."""
    doc = read_json(path, fix)
    check_results(path, doc)
    from specee.result_values import check_result_values  # the values the report computes with
    check_result_values(path, doc)
    return doc


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


def read_sweep(root: Path) -> tuple[list[tuple[Path, dict]], list[tuple[Path, str]]]:
    """For a report over a sweep: every whole results.json under ``root``, and each one skipped with
    its reason (an empty or corrupt file among many must not hide the rest). Nothing whole but
    something broken is refused, naming the first broken file."""
    whole, skipped = [], []
    for path in sorted(Path(root).rglob(RESULTS)):
        try:
            whole.append((path, read_results(path, "rerun that job with force=true")))
        except SpeceeError as err:
            skipped.append((path, str(err)))
    if skipped and not whole:
        raise SpeceeError(f"no whole results.json under {root}: {skipped[0][1]}"
                          + (f" (and {len(skipped) - 1} more broken)" if len(skipped) > 1 else ""))
    return whole, skipped


def synthetic_inputs(cfg) -> dict:
    """What in this run is not a trained model's behaviour, said in every result."""
    out = {}
    if cfg.model.get("init", "pretrained") == "random":
        from specee.models.loader import shape_file
        src = shape_file(cfg.model)  # a checkpoint folder's config.json, else the shipped shape
        shape = cfg.model.path if src.name == "config.json" else f"specee/models/shapes/{cfg.model.name}.json"
        out["weights"] = (f"random (model.init=random, shape from {shape}"
                          + (f", cut to {cfg.model.num_layers} layers" if cfg.model.num_layers else "") + ")")
        out["tokenizer"] = "tiny's tokenizer (prompt ids are a subset of the model's vocabulary)"
        from specee.decoding import modes
        spec = modes.of(cfg.ablation)
        out.update(spec.synthetic)
        if spec.needs_adainfer:  # which classifier's shape stands in
            out["adainfer_classifier"] = f"{out['adainfer_classifier']} ({cfg.ablation.get('classifier', 'svm')})"
        if spec.needs_draft and cfg.draft.get("vocab_size"):
            out["draft_vocab"] = f"the first {cfg.draft.vocab_size} token ids (no frequency table for random weights)"
    from specee.decoding import modes
    if modes.of(cfg.ablation).needs_bank:
        from specee.early_exit.standin import profile_label
        label = profile_label(cfg)
        if label:
            out["exit_profile"] = label
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
