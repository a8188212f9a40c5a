"""The exit policies a frontier sweeps, built from their ablations' own configs.

Each policy is an ablation (``conf/ablation/<name>.yaml``) composed as a job with that ablation
would be, so its bank, schedule, classifier and settings are the ones its speed and accuracy jobs
use; only its knob moves: SpecEE's global threshold, the tuned bank's target precision (per-layer
thresholds chosen on the calibration split), AdaInfer's SVM margin and CRF P(stop) level, and an
exit rule's own knob over its own grid (:mod:`specee.exit_rules`).
"""
from __future__ import annotations

import json
import math

from specee import ablations
from specee.builders import build_decoder
from specee.decoding import modes
from specee.decoding.operating_point import identity, set_point
from specee.errors import SpeceeError
from specee.frontier.replay import Policy
from specee.io import project_path


def task_overrides() -> list[str]:
    """The running job's command-line overrides (none outside a Hydra job)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return []


def policy_config(cfg, ablation: str):
    """The job's config with ``ablation`` in place of its own, composed as Hydra would."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    from specee.io import PROJECT_ROOT
    keep = [o for o in task_overrides()
            if o.split("=", 1)[0].lstrip("+~") != "ablation" and not o.lstrip("+~").startswith("ablation.")]
    if not any(o.startswith("model=") for o in keep):
        keep.append(f"model={cfg.model.name}")
    over = keep + [f"ablation={ablation}"]
    if GlobalHydra.instance().is_initialized():
        pcfg = compose("config", over)
    else:
        with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
            pcfg = compose("config", over)
    with open_dict(pcfg):  # the job's own settings where it set them (seed, paths, runtime)
        pcfg.seed, pcfg.paths, pcfg.runtime, pcfg.model = cfg.seed, cfg.paths, cfg.runtime, cfg.model
    return pcfg


def _grid(values, name: str) -> list[float]:
    vals = [float(v) for v in values]
    if not vals:
        raise SpeceeError(f"experiment.{name} is empty: give at least two operating points, e.g. "
                          f"experiment.{name}=[0.95,0.9,0.8,0.6,0.4,0.2]")
    if any(not math.isfinite(v) for v in vals):
        raise SpeceeError(f"experiment.{name}={vals}: every value must be a finite number")
    return vals


def build_policies(cfg, rt) -> tuple[list[Policy], dict]:
    """The replayable policies of ``experiment.policies`` and what recording needs: the draft, each
    bank by name, AdaInfer's classifiers, decoders for the unit costs, and the prompt ids the
    predictors were trained on (left out of the frontier)."""
    e = cfg.experiment
    policies, parts = [], {"banks": {}, "calibration_prompt_ids": set(), "draft": None,
                           "unit_decoder": None, "ada_decoder": None, "left_out": {}, "rules": {},
                           "rule_decoders": {}}
    thr_grid = sorted(_grid(e.threshold_grid, "threshold_grid"), reverse=True)  # conservative first
    prec_grid = sorted(_grid(e.precision_grid, "precision_grid"), reverse=True)
    margin_grid = sorted(_grid(e.margin_grid, "margin_grid"), reverse=True)
    pstop_grid = sorted(_grid(e.p_stop_grid, "p_stop_grid"), reverse=True)
    for name in e.policies:
        pcfg = policy_config(cfg, name)
        spec = modes.of(pcfg.ablation)
        if not spec.early_exit or spec.is_tree(pcfg.ablation):
            raise SpeceeError(f"experiment.policies: {name} is not an autoregressive early-exit ablation "
                              "(tree SpecEE goes in experiment.real_only, lossless ones in experiment.lossless_peers)")
        try:
            dec = build_decoder(pcfg, rt)
        except SpeceeError as err:  # an artifact this model lacks: the frontier goes on without it, and says so
            from specee.io import PROJECT_ROOT  # a result names project files relative to the project
            parts["left_out"][name] = str(err).replace(f"{PROJECT_ROOT}/", "")
            print(f"note: {name} left out: {err}")
            continue
        if spec.needs_bank:
            bank_key = str(pcfg.early_exit.predictors_path)
            parts["banks"][bank_key] = dec.predictors
            parts["draft"] = parts["draft"] or dec.draft
            parts["unit_decoder"] = parts["unit_decoder"] or dec
            card = project_path(pcfg.early_exit.predictors_path) / "predictors_card.json"
            if card.is_file():
                parts["calibration_prompt_ids"] |= set(json.loads(card.read_text()).get("calibration_prompt_ids", []))
            per_layer = pcfg.early_exit.calibration == "per_layer"
            policies.append(Policy(name, ablations.of(pcfg.ablation).label, "specee", "target_precision" if per_layer else "threshold",
                                   prec_grid if per_layer else thr_grid, bank=bank_key, schedule=dec.schedule,
                                   can_exit=list(dec.can_exit), per_layer=per_layer, mode=pcfg.ablation.mode,
                                   identity=identity(pcfg)))
        elif spec.exit_rule is not None:  # a registered exit rule: its knob, its grid (conservative first)
            parts["rules"][name] = dec.rule
            parts["calibration_prompt_ids"] |= set(dec.rule.trained_on())
            parts["rule_decoders"][name] = dec
            policies.append(Policy(name, ablations.of(pcfg.ablation).label, "rule", dec.rule.knob,
                                   [float(v) for v in dec.rule.grid], mode=pcfg.ablation.mode, rule=dec.rule,
                                   identity=identity(pcfg)))
        else:  # AdaInfer
            kind = pcfg.ablation.classifier
            parts[kind] = dec.svm
            parts["ada_decoder"] = parts["ada_decoder"] or dec
            knob, grid = {"svm": ("margin", margin_grid), "crf": ("p_stop", pstop_grid)}[kind]
            policies.append(Policy(name, ablations.of(pcfg.ablation).label, kind, knob, grid, mode=pcfg.ablation.mode,
                                   identity=identity(pcfg)))
    if not policies:
        raise SpeceeError("experiment.policies is empty: name at least one early-exit ablation, e.g. [specee_t1_t2]")
    if parts["draft"] is None:  # AdaInfer alone: the draft still proposes nothing it reads
        raise SpeceeError("experiment.policies needs at least one SpecEE ablation (its draft head is recorded)")
    return policies, parts


def set_operating_point(decoder, policy: Policy, value: float, thresholds, kv_policy: str | None = None) -> None:
    """Put a real decoder at a replayed point (the one implementation: specee/decoding/operating_point.py)."""
    set_point(decoder, policy.kind, value, policy.per_layer, thresholds, kv_policy)
