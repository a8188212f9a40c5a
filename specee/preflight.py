"""Every input file a run will read, checked before the base model loads: the model folder's
JSON files and weight headers, and each artifact the configured decoder, recipe or drift check
needs (draft head, predictors, AdaInfer SVM, exit profile, replay, accuracy baseline), each
through its own loader's check. A bad file is one SpeceeError naming it and the fix; the
weights fingerprint is compared after loading, where the model's weights are known."""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import OmegaConf

from specee.config import recipe, recipe_name
from specee.cards import read_card, read_json, safetensors_shapes
from specee.errors import SpeceeError
from specee.io import project_path



@dataclass
class Shape:
    num_layers: int
    hidden_size: int
    vocab_size: int
    positions: int | None


def model_shape(model_cfg) -> Shape | None:
    """The model's shape from its config.json (or shipped shape), every JSON file and weight
    header of its folder read; None for a hub id (read only when it downloads)."""
    from specee.models.loader import checkpoint_dir, resolve_device, shape_config
    resolve_device(model_cfg.device)
    if model_cfg.init == "random":
        from specee.models.loader import shape_file
        if shape_file(model_cfg).name == "config.json":  # a checkpoint folder's shape, not a shipped one
            read_json(shape_file(model_cfg),
                      "model.init=random reads the architecture from model.path's config.json")
        c = shape_config(model_cfg)
        return Shape(c.num_hidden_layers, c.hidden_size, c.vocab_size, getattr(c, "max_position_embeddings", None))
    src = checkpoint_dir(model_cfg)
    folder = project_path(src)
    if not folder.is_dir():
        return None  # model.allow_hub=true with a hub id
    try:
        return _checkpoint_shape(folder, model_cfg)
    except SpeceeError as err:  # the same words as a failed load, with the file that failed
        raise SpeceeError(f"could not load the checkpoint at model.path={model_cfg.path}: {err}") from None


def _checkpoint_shape(folder, model_cfg) -> Shape:
    fix = "copy the checkpoint folder again (or retrain it)"
    for f in sorted(folder.glob("*.json")):
        if f.name != "config.json":
            read_json(f, fix)
    conf = read_card(folder / "config.json", fix, {"num_hidden_layers": int, "hidden_size": int, "vocab_size": int},
                     "Hugging Face model config")
    from specee.artifact_checks import check_model_shape  # 0 layers/heads would divide by zero in the build
    check_model_shape(conf, folder / "config.json", "fix its config.json (or copy the checkpoint folder again)")
    for f in sorted(folder.glob("*.safetensors")):
        safetensors_shapes(f, fix)
    if not any((folder / t).is_file() for t in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise SpeceeError(f"{folder} holds no tokenizer (tokenizer.json, tokenizer.model or vocab.json); {fix}")
    pos = conf.get("max_position_embeddings")
    return Shape(conf["num_hidden_layers"], conf["hidden_size"], conf["vocab_size"],
                 pos if isinstance(pos, int) and not isinstance(pos, bool) else None)


def _context(cfg, shape: Shape) -> None:
    """Generation and scoring budgets against the model's positions (a prompt keeps at least one
    token: longer prompts are cut from the left, a budget that fills the context cannot be)."""
    if not shape.positions:
        return
    for key in recipe(cfg).context_budgets:
        n = OmegaConf.select(cfg, key)
        if n is not None and n >= shape.positions:
            raise SpeceeError(f"{key}={n} leaves no room for a prompt in model={cfg.model.name}'s "
                              f"{shape.positions} positions; use at most {shape.positions - 1}")
    if "max_length" in cfg.experiment and (n := cfg.experiment.get("max_length")) is not None \
            and n > shape.positions:
        raise SpeceeError(f"experiment.max_length={n} exceeds model={cfg.model.name}'s {shape.positions} "
                          f"positions; use at most {shape.positions} (or null)")


def _same_base(cards: dict[str, dict]) -> None:
    """Artifacts trained together must record the same base model (the weights themselves are
    compared after loading)."""
    seen = {what: (c.get("base_weights_fingerprint"), path) for what, (c, path) in cards.items()
            if isinstance(c.get("base_weights_fingerprint"), str)}
    if len({fp for fp, _ in seen.values()}) > 1:
        listed = "; ".join(f"{what} at {path}: {fp[:12]}…" for what, (fp, path) in seen.items())
        raise SpeceeError(f"these artifacts were trained for different base models ({listed}); retrain "
                          "them for one model (experiment=train_draft, then train_predictors)")


def preflight(cfg) -> None:
    """Raise SpeceeError on the first input file this run would fail on; read nothing it won't.
    What is read follows from the recipe's facts and the mode's spec."""
    from specee.decoding import modes
    facts = recipe(cfg)
    if cfg.early_exit.get("operating_point"):
        _operating_point(cfg, facts)
    if not facts.loads_model:
        return
    from specee.models.folders import check_folders
    check_folders(cfg, facts, modes.of(cfg.ablation))  # every folder by name, all missing ones in one line, before any file is read
    if facts.reads_prompts:  # every row typed (file:line), ids unique, before a run folder is made
        from specee.data import load_prompt_set
        load_prompt_set(project_path(cfg.paths.data_root), cfg.dataset)
    shape = model_shape(cfg.model)
    if recipe_name(cfg) == "accuracy":
        _baseline(cfg)
    if recipe_name(cfg) in ("accuracy", "frontier"):
        _user_tasks(cfg)
    if shape is None:
        return
    _context(cfg, shape)
    k = cfg.ablation.exit_layer  # a wrong value is wrong whether or not this mode reads it
    if k != "auto" and k >= shape.num_layers:
        from specee.config import check_exit_layer_text
        raise SpeceeError(check_exit_layer_text(k, shape.num_layers))
    spec, ee, random_init = modes.of(cfg.ablation), cfg.early_exit, cfg.model.init == "random"
    uses_draft = (facts.decodes and spec.needs_draft) or facts.needs_draft
    uses_bank = (facts.decodes and spec.needs_bank) or facts.needs_bank
    uses_svm = facts.decodes and spec.needs_adainfer
    if uses_draft and (ee.k > shape.vocab_size):
        raise SpeceeError(f"early_exit.k={ee.k} exceeds the vocabulary of model={cfg.model.name} "
                          f"({shape.vocab_size} tokens); use a smaller top-K")
    if uses_draft and cfg.draft.vocab_size > shape.vocab_size:
        raise SpeceeError(f"draft.vocab_size={cfg.draft.vocab_size} exceeds the vocabulary of model={cfg.model.name} "
                          f"({shape.vocab_size} tokens); use a smaller N, or 0 for the full vocabulary")
    cards = {}
    schedules = uses_bank
    if random_init:  # random stand-ins replace the draft, predictors and SVM (their cost only)
        uses_draft = uses_bank = uses_svm = False
    if uses_draft and cfg.draft.name != "none" and cfg.draft.path:
        from specee.models.draft import check_draft
        cards["draft head"] = (check_draft(project_path(cfg.draft.path), shape.num_layers, shape.hidden_size),
                               cfg.draft.path)
        if cfg.draft.vocab_size:
            from specee.models.draft_vocab import read_table, reduced_ids
            reduced_ids(read_table(project_path(cfg.draft.path), shape.vocab_size), cfg.draft.vocab_size)
    if uses_bank:
        from specee.early_exit.predictor import PredictorBank
        cards["predictors"] = (PredictorBank.check(project_path(ee.predictors_path), shape.num_layers, ee.k,
                                                   ee.calibration),
                               ee.predictors_path)
    if uses_svm:
        from specee.decoding.adainfer import load_classifier
        try:
            classifier = load_classifier(project_path(ee.adainfer_path), cfg.ablation.classifier)
        except SpeceeError as err:  # which choice of the user's needs the missing or broken file
            raise SpeceeError(f"ablation={cfg.ablation.name} (classifier {cfg.ablation.classifier}): {err}") from None
        cards["AdaInfer classifier"] = (classifier.card, ee.adainfer_path)
    _same_base(cards)
    if schedules:
        _profiles(cfg, shape.num_layers)
        from specee.early_exit.replayed_exits import load_replay
        load_replay(ee.replay, shape.num_layers, cfg.seed)


def _profiles(cfg, num_layers: int) -> None:
    from specee.early_exit.schedule import load_profile
    from specee.io import PROJECT_ROOT
    offline = bool(cfg.placement.offline)
    if "placements" in cfg.experiment:  # every placement the statistics compare
        for name in cfg.experiment.placements:
            preset = PROJECT_ROOT / "conf" / "placement" / f"{name}.yaml"
            offline |= preset.is_file() and bool(OmegaConf.load(preset).get("offline"))
    if offline:
        from specee.early_exit.standin import profile_dir
        load_profile(profile_dir(cfg, cfg.placement), num_layers)


def _baseline(cfg) -> None:
    from specee.evaluation import drift
    e = cfg.experiment
    path = project_path(e.baseline)
    if e.check_baseline or (e.update_baseline and path.exists()):
        drift.load(path, cfg.model.name)


def _user_tasks(cfg) -> None:
    """The user's task YAMLs under experiment.include_path that the run names (their fields, the
    types and ranges of their values, their data files), before any model loads or folder is made."""
    e = cfg.experiment
    if not e.get("include_path"):
        return
    from specee.evaluation import registry
    include = project_path(e.include_path)
    if not include.is_dir():
        raise SpeceeError(f"experiment.include_path={include} is not a folder of task YAMLs")
    registry.check_user_tasks(list(e.tasks), include)


def _operating_point(cfg, facts) -> None:
    """early_exit.operating_point: a job that decodes one ablation runs the point; any other refuses."""
    name = recipe_name(cfg)
    if name not in ("speed", "accuracy"):
        raise SpeceeError(f"early_exit.operating_point is for experiment=speed and experiment=accuracy (one ablation "
                          f"at the certified point), not experiment={name}"
                          + ("; the main job takes it as experiment.operating_point" if name.startswith("reproduce") else ""))
    from specee.decoding.operating_point import check
    check(cfg)
