"""Decoding modes. Each decoder has ``generate(prompt_ids, max_new_tokens, eos_id) -> Generation``."""
from __future__ import annotations

from specee.errors import SpeceeError
from specee.io import project_path


def build_decoder(cfg, rt, placement=None, shadow: bool = False):
    """The configured decoder; ``placement`` overrides cfg.placement (statistics compare several)."""
    mode, ee = cfg.ablation.mode, cfg.early_exit
    if mode == "dense":
        from specee.decoding.dense import DenseDecoder
        return DenseDecoder(rt)
    if mode == "eagle" or (mode == "specee" and cfg.ablation.decoding == "tree"):
        from specee.decoding.tree import TreeDecoder
        from specee.models.draft import load_draft
        draft, _ = load_draft(project_path(cfg.draft.path), rt)
        bank = schedule = None
        if mode == "specee":
            from specee.early_exit.predictor import PredictorBank
            from specee.early_exit.schedule import build_schedule
            bank, _ = PredictorBank.load(project_path(ee.predictors_path), rt.num_layers, ee.k, ee.threshold)
            bank = bank.to(rt.device)  # float32: features are computed in float32
            placement = placement or cfg.placement
            schedule = build_schedule(placement, rt.num_layers, project_path(placement.profile_path))
        tree = cfg.ablation.tree if isinstance(cfg.ablation.tree, str) else [list(p) for p in cfg.ablation.tree]
        return TreeDecoder(rt, draft, tree, bank, schedule, cfg.ablation.mapping, ee.k, ee.kv_policy)
    if mode == "specee":
        from specee.decoding.specee_ar import SpecEEDecoder
        from specee.early_exit.predictor import PredictorBank
        from specee.models.draft import load_draft
        draft, _ = load_draft(project_path(cfg.draft.path), rt)
        from specee.early_exit.schedule import build_schedule
        bank, _ = PredictorBank.load(project_path(ee.predictors_path), rt.num_layers, ee.k, ee.threshold)
        placement = placement or cfg.placement
        schedule = build_schedule(placement, rt.num_layers, project_path(placement.profile_path))
        return SpecEEDecoder(rt, draft, bank.to(rt.device), ee.k, ee.kv_policy, schedule, shadow)
    if mode == "adainfer":
        from specee.decoding.adainfer import AdaInferDecoder, AdaInferSVM
        return AdaInferDecoder(rt, AdaInferSVM.load(project_path(ee.adainfer_path)), ee.kv_policy)
    raise SpeceeError(f"ablation.mode={mode!r} has no decoder; valid: dense, specee, adainfer, eagle")
