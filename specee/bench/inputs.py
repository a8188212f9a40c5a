"""The prompts a decoding job runs, formatted in the model's chat template, and its end of sequence."""
from __future__ import annotations

from specee.data import load_prompt_set
from specee.decoding import modes
from specee.errors import SpeceeError
from specee.io import project_path
from specee.models.loader import load_tokenizer
from specee.prompts import format_conversation


def load_prompts(cfg) -> list[dict]:
    """Prompts with their user turns (up to dataset.turns); ``text`` is the formatted first turn."""
    prompts = load_prompt_set(project_path(cfg.paths.data_root), cfg.dataset)
    tokenizer = load_tokenizer(cfg.model)  # the checkpoint's own chat template, when it has one
    return [{"id": p.id, "category": p.category, "turns": p.turns[: max(1, cfg.dataset.turns)],
             "text": format_conversation(cfg.model.chat_template, [(p.turns[0], None)], tokenizer)}
            for p in prompts]


def generation_eos(cfg, tokenizer):
    """A random-weight model has no meaningful end of sequence: it generates the full budget."""
    return None if cfg.model.init == "random" else tokenizer.eos_token_id


def check_disjoint_from_calibration(cfg, prompts: list[dict]) -> None:
    """Evaluation prompts must not be ones the predictors were trained on."""
    if not modes.of(cfg.ablation).needs_bank:
        return
    import json
    card = project_path(cfg.early_exit.predictors_path) / "predictors_card.json"
    if not card.is_file():
        return  # build_decoder reports the missing predictors
    calib = set(json.loads(card.read_text()).get("calibration_prompt_ids", []))
    overlap = sorted({p["id"] for p in prompts} & calib)
    if overlap:
        raise SpeceeError(f"evaluation prompts {overlap[:5]} were used to train the predictors; "
                          "choose dataset.offset/count below the calibration offset")
