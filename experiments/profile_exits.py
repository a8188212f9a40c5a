"""Recipe: the offline exit profile — where tokens exit with predictors after every layer.

    python run.py experiment=profile_exits model=tiny

Runs SpecEE (all layers) over the calibration prompts (disjoint from evaluation) and stores the
per-layer exit counts in ``placement.profile_path``; ``placement=offline_topm`` reads them.
"""
from __future__ import annotations


from omegaconf import OmegaConf
from tqdm import tqdm

from specee import data, results
from specee.builders import build_decoder
from specee.decoding import modes
from specee.early_exit.schedule import PROFILE, offline_rule, offline_set
from specee.errors import SpeceeError
from specee.io import atomic_dir, project_path
from specee.models.loader import load_model
from specee.prompts import format_conversation
from specee.runtime.layerwise import LayerwiseLM


def run(cfg) -> dict:
    e = cfg.experiment
    model, tokenizer = load_model(cfg.model)
    rt = LayerwiseLM(model)
    all_layers = OmegaConf.merge(cfg.placement, {"name": "all_layers", "offline": False, "online": False})
    specee_cfg = modes.as_specee_ar(cfg)  # whatever ablation= says
    decoder = build_decoder(specee_cfg, rt, placement=all_layers)
    prompts, files = data.calibration_prompts(project_path(cfg.paths.data_root), e.calibration)
    counts = [0] * rt.num_layers
    for p in tqdm(prompts, desc="profile exits"):
        text = format_conversation(cfg.model.chat_template, [(p.turns[0], None)], tokenizer)
        ids = tokenizer(text, return_tensors="pt").input_ids.to(rt.device)
        for tr in decoder.generate(ids, e.calibration.max_new_tokens, tokenizer.eos_token_id).trace:
            counts[tr["exit_layer"]] += 1
    if not sum(counts):
        raise SpeceeError("the calibration prompts produced no decoded tokens to profile; "
                          "raise experiment.calibration.max_new_tokens or add prompts")
    exits = counts[: rt.num_layers - 1]
    profile = {
        "model": cfg.model.name, "num_layers": rt.num_layers, "exit_counts": counts,
        "tokens": sum(counts), "tokens_without_exit": counts[-1],
        "calibration_prompt_ids": [p.id for p in prompts], "data_files": files,
        "predictors": str(cfg.early_exit.predictors_path), "k": cfg.early_exit.k,
        "threshold": cfg.early_exit.threshold, "kv_policy": cfg.early_exit.kv_policy,
        "command": results.command_line(),
        "default_offline_set": offline_set(exits, *offline_rule(cfg.placement, rt.num_layers)[:2]),
        "offline_rule": offline_rule(cfg.placement, rt.num_layers)[2],
    }
    out = project_path(e.out_dir)
    with atomic_dir(out) as tmp:
        import json
        (tmp / PROFILE).write_text(json.dumps(profile, indent=1))
    print(f"exit profile over {profile['tokens']} tokens -> {out}; offline set "
          f"(M={len(profile['default_offline_set'])}): {profile['default_offline_set']}")
    results.save(results.output_dir(), cfg, {"exit_counts": counts,
                                            "offline_set": profile["default_offline_set"]})
    return profile
