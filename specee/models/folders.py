"""Checkpoints and artifacts by name: the folders a run reads, checked before any file is opened.

A model config names its checkpoint folder after the model under the models root
(``model.path: ${paths.models}/${model.name}``; ``paths.models`` is ``SPECEE_MODELS_ROOT``, else
``models/``) and its artifacts beside it (``model.artifacts``: ``<name>_draft``,
``<name>_predictors``, ``<name>_exit_profile``, ``<name>_adainfer``), so a sweep over models
needs no per-model paths. Every folder the run needs and lacks is named in one line with the
command (or copy) that fills it; a per-model override (``model.path=DIR``, ``draft.path=DIR``,
``early_exit.predictors_path=DIR``) is checked the same way.
"""
from __future__ import annotations

from pathlib import Path

from specee.errors import SpeceeError
from specee.io import project_path


def _root_note(cfg) -> str:
    return f"paths.models={cfg.paths.models} (the SPECEE_MODELS_ROOT environment variable, else models/)"


def missing_model_text(model_cfg, path: Path) -> str:
    """The one line for a checkpoint folder that is not there."""
    from specee.models.fetch import SOURCES
    name = model_cfg.name
    if name in SOURCES:
        fill = f"fetch it first: python run.py experiment=fetch model={name} (same paths.models / model.path)"
    else:
        fill = (f"put the model's Hugging Face checkpoint there (config.json, weights, tokenizer), point "
                f"SPECEE_MODELS_ROOT at the folder that holds {name}/, or give model.path=DIR")
    return f"model={name}: no checkpoint folder at {path} (model.path={model_cfg.path}); {fill}"


def needed(cfg, facts, spec) -> list[tuple[str, str, Path, str]]:
    """(what, config key, folder, how to fill it) for every folder this run reads by path, given
    its recipe's ``facts`` and its mode's ``spec`` (read by the caller: this module sits below the
    config and the decoders)."""
    m = cfg.model
    if not facts.loads_model:
        return []
    out = []
    random_init = m.init == "random"
    if not random_init and m.path and not m.allow_hub:
        out.append(("checkpoint", "model.path", project_path(m.path), ""))
    if random_init:  # random stand-ins replace the draft, predictors and classifier; a profile stands in too
        return out
    model = f"model={m.name}"
    ee = cfg.early_exit
    if ((facts.decodes and spec.needs_draft) or facts.needs_draft) and cfg.draft.name != "none" and cfg.draft.path:
        out.append(("draft head", "draft.path", project_path(cfg.draft.path),
                    f"put the model's EAGLE-1 head there (its config.json and weights) or train one: "
                    f"python run.py experiment=train_draft {model}"))
    if (facts.decodes and spec.needs_bank) or facts.needs_bank:
        folder = project_path(ee.predictors_path)
        bank = cfg.ablation.get("bank", "trained")  # the bank variant the ablation declares
        fill = (f"python run.py experiment=import_predictors {model} (the authors' released bank)"
                if bank == "authors" else
                f"python run.py experiment=train_predictors {model}"
                + (" experiment.recipe=paper" if bank == "paper" else ""))
        out.append(("predictors", "early_exit.predictors_path", folder, fill))
        if cfg.placement.get("offline"):
            out.append(("exit profile", "placement.profile_path", project_path(cfg.placement.profile_path),
                        f"python run.py experiment=profile_exits {model}"))
    if facts.decodes and spec.needs_adainfer:
        out.append(("AdaInfer classifiers", "early_exit.adainfer_path", project_path(ee.adainfer_path),
                    f"python run.py experiment=train_predictors {model} (trains them beside the predictors)"))
    return out


def check_folders(cfg, facts, spec) -> None:
    """Refuse, in one line, every folder this run needs that does not exist."""
    missing = [(what, key, folder, fill) for what, key, folder, fill in needed(cfg, facts, spec)
               if not folder.is_dir()]
    if not missing:
        return
    if missing[0][0] == "checkpoint" and len(missing) == 1:
        raise SpeceeError(missing_model_text(cfg.model, missing[0][2]))
    parts = []
    for what, key, folder, fill in missing:
        if what == "checkpoint":
            fill = "its Hugging Face checkpoint (config.json, weights, tokenizer)"
        parts.append(f"{folder} ({what}, {key}; fill it: {fill})")
    raise SpeceeError(f"model={cfg.model.name} with ablation={cfg.ablation.name} is missing {len(missing)} "
                      f"folder{'s' * (len(missing) > 1)} "
                      f"this run reads, looked for by name: {'; '.join(parts)}. Models root: {_root_note(cfg)}; "
                      "a per-model path (model.path=DIR, draft.path=DIR, ...) overrides any of them")
