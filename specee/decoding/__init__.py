"""Decoding modes. Each decoder has ``generate(prompt_ids, max_new_tokens, eos_id) -> Generation``;
which decoder a config gets, and what it needs, is its mode's spec (specee/decoding/modes.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specee.io import project_path
from specee.models.loader import check_trained_for


@dataclass
class Parts:
    """The artifacts a mode's decoder is built from, each loaded once (None where not needed)."""
    draft: Any = None
    bank: Any = None
    schedule: Any = None
    replay: Any = None
    svm: Any = None
    rule: Any = None  # an exit rule (specee/exit_rules/)


def load_parts(cfg, rt, spec, placement=None) -> Parts:
    """Load what ``spec`` needs. ``model.init=random``: random stand-ins of the same shapes
    (weights only for their cost; every result says so)."""
    ee, parts = cfg.early_exit, Parts()
    random_init = cfg.model.init == "random"
    if spec.needs_draft:
        from specee.models.draft import DraftHead, load_draft
        if random_init:
            parts.draft = DraftHead(rt.config).attach(rt).eval()
            if cfg.draft.vocab_size:  # the cost of a reduced head; which ids does not matter (synthetic)
                parts.draft.restrict_vocab(list(range(cfg.draft.vocab_size)))
        else:
            parts.draft, card = load_draft(project_path(cfg.draft.path), rt, cfg.draft.vocab_size)
            check_trained_for(card, cfg.draft.path, rt.model, "draft head")
    if spec.needs_bank:
        from specee.early_exit.predictor import PredictorBank
        from specee.early_exit.replayed_exits import load_replay
        from specee.early_exit.schedule import build_schedule
        if random_init:
            bank = PredictorBank.random(rt.num_layers, ee.k, seed=cfg.seed, threshold=ee.threshold)
            if ee.calibration == "per_layer":  # no trained thresholds: the per-layer path's cost
                bank.set_layer_thresholds([ee.threshold] * rt.num_layers)
        else:
            bank, card = PredictorBank.load(project_path(ee.predictors_path), rt.num_layers, ee.k, ee.threshold,
                                            ee.calibration)
            check_trained_for(card, ee.predictors_path, rt.model, "predictors")
        parts.bank = bank.to(rt.device)  # float32: features are computed in float32
        placement = placement or cfg.placement
        from specee.early_exit.standin import profile_dir
        parts.schedule = build_schedule(placement, rt.num_layers, profile_dir(cfg, placement))
        parts.replay = load_replay(ee.replay, rt.num_layers, cfg.seed)
    if spec.needs_adainfer:
        from specee.decoding.adainfer import load_classifier, standin_classifier
        kind = cfg.ablation.classifier
        if random_init:
            parts.svm = standin_classifier(kind)
        else:
            parts.svm = load_classifier(project_path(ee.adainfer_path), kind)
            check_trained_for(parts.svm.card, ee.adainfer_path, rt.model, "AdaInfer classifier")
    if spec.exit_rule is not None:
        rule = spec.exit_rule
        parts.rule = rule.standin(rt) if random_init else rule.load(cfg, rt)
    return parts
