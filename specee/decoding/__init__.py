"""Decoding modes. Each decoder has ``generate(prompt_ids, max_new_tokens, eos_id) -> Generation``."""
from __future__ import annotations

from specee.errors import SpeceeError
from specee.io import project_path
from specee.models.loader import check_trained_for


def build_decoder(cfg, rt, placement=None, shadow: bool = False, profile_phases: bool = False,
                  eos_id: int | None = None):
    """The configured decoder, built through one path: each artifact it needs (draft head,
    predictors, schedule, SVM) loaded once. ``placement`` overrides cfg.placement (statistics
    compare several); ``shadow`` (autoregressive SpecEE only) records where the all-layers policy
    would have exited; ``profile_phases`` makes CUDA phase reads synchronized (a profiling pass);
    ``eos_id``: the generation's EOS (prompt lookup cuts its proposals before one)."""
    mode, ee, a = cfg.ablation.mode, cfg.early_exit, cfg.ablation
    tree_mode = mode == "eagle" or (mode == "specee" and a.decoding == "tree")
    if shadow and not (mode == "specee" and not tree_mode):
        raise SpeceeError(f"shadow exits are defined for autoregressive SpecEE only, not ablation={a.name}")
    draft = bank = schedule = replay = None
    random_init = cfg.model.init == "random"  # weights only for their cost: random artifacts too
    if mode in ("specee", "eagle"):
        from specee.models.draft import DraftHead, load_draft
        if random_init:
            draft = DraftHead(rt.config).attach(rt).eval()
            if cfg.draft.vocab_size:  # the cost of a reduced head; which ids does not matter (synthetic)
                draft.restrict_vocab(list(range(cfg.draft.vocab_size)))
        else:
            draft, card = load_draft(project_path(cfg.draft.path), rt, cfg.draft.vocab_size)
            check_trained_for(card, cfg.draft.path, rt.model, "draft head")
    if mode == "specee":
        from specee.early_exit.predictor import PredictorBank
        from specee.early_exit.replay import load_replay
        from specee.early_exit.schedule import build_schedule
        if random_init:
            bank = PredictorBank.random(rt.num_layers, ee.k, seed=cfg.seed, threshold=ee.threshold)
            if ee.calibration == "per_layer":  # no trained thresholds: the per-layer path's cost
                bank.set_layer_thresholds([ee.threshold] * rt.num_layers)
        else:
            bank, card = PredictorBank.load(project_path(ee.predictors_path), rt.num_layers, ee.k, ee.threshold,
                                            ee.calibration)
            check_trained_for(card, ee.predictors_path, rt.model, "predictors")
        bank = bank.to(rt.device)  # float32: features are computed in float32
        placement = placement or cfg.placement
        schedule = build_schedule(placement, rt.num_layers, project_path(placement.profile_path))
        replay = load_replay(ee.replay, rt.num_layers, cfg.seed)
    if mode == "dense":
        from specee.decoding.dense import DenseDecoder
        decoder = DenseDecoder(rt)
    elif tree_mode:
        from specee.decoding.tree import TreeDecoder
        tree = a.tree if isinstance(a.tree, str) else [list(p) for p in a.tree]
        choice = None
        if a.tree_select == "auto":
            from specee.decoding.tree_select import auto_tree
            choice = auto_tree(cfg, rt, draft)
            tree = choice["chosen"]["paths"]
        decoder = TreeDecoder(rt, draft, tree, bank, schedule, a.mapping, ee.k, ee.kv_policy, replay, ee.delta_from,
                              a.tree_exit_rule)
        decoder.tree_choice = choice
    elif mode == "specee" and a.speculation == "prompt_lookup":
        from specee.decoding.specee_ar import PromptLookupSpecEEDecoder
        decoder = PromptLookupSpecEEDecoder(rt, draft, bank, ee.k, ee.kv_policy, schedule, shadow, replay,
                                            ee.delta_from, ngram_size=a.ngram_size)
    elif mode == "specee":
        from specee.decoding.specee_ar import SpecEEDecoder
        decoder = SpecEEDecoder(rt, draft, bank, ee.k, ee.kv_policy, schedule, shadow, replay, ee.delta_from)
    elif mode == "pld":
        from specee.decoding.pld import PromptLookupDecoder
        choice = None
        if a.num_tokens == "auto":  # the proposal length with the most tokens per unit time here
            from specee.decoding.auto_settings import auto_num_tokens
            choice = auto_num_tokens(cfg, rt, eos_id)
        decoder = PromptLookupDecoder(rt, choice["chosen"] if choice else a.num_tokens, a.ngram_size, eos_id)
        decoder.lookup_choice = choice
    elif mode in ("hf_pld", "hf_self_spec"):
        decoder = build_peer(cfg, rt, mode, eos_id)
    elif mode == "adainfer":
        from specee.decoding.adainfer import AdaInferDecoder, AdaInferSVM
        if random_init:
            svm = AdaInferSVM([1.0, 1.0], -1.5, {"synthetic": "fixed random-init stand-in"})
        else:
            svm = AdaInferSVM.load(project_path(ee.adainfer_path))
            check_trained_for(svm.card, ee.adainfer_path, rt.model, "AdaInfer classifier")
        decoder = AdaInferDecoder(rt, svm, ee.kv_policy)
    else:
        raise SpeceeError(f"ablation.mode={mode!r} has no decoder; valid: dense, specee, adainfer, eagle, pld, "
                          "hf_pld, hf_self_spec")
    decoder.profile_phases = profile_phases
    return decoder


def build_peer(cfg, rt, mode: str, eos_id=None, num_tokens: int | None = None):
    """A transformers ``generate`` peer: ``mode`` hf_pld, hf_self_spec or hf_plain (the peers' own
    baseline), at the ablation's settings (``exit_layer=auto`` chosen here, recorded as ``choice``)."""
    from specee.config import check_exit_layer_text
    from specee.decoding.hf_peer import HFGenerateDecoder, peer_kwargs
    a, choice, k = cfg.ablation, None, None
    if mode == "hf_self_spec":
        k = a.exit_layer
        if k == "auto":
            from specee.decoding.auto_settings import auto_exit_layer
            choice = auto_exit_layer(cfg, rt, eos_id)
            k = choice["chosen"]
        elif k >= rt.num_layers:
            raise SpeceeError(check_exit_layer_text(k, rt.num_layers))
    if num_tokens is None:
        num_tokens = a.num_tokens if a.num_tokens != "auto" else 10
    decoder = HFGenerateDecoder(rt.model, rt, mode, **peer_kwargs(mode, num_tokens, a.ngram_size, k))
    decoder.choice = choice
    return decoder
