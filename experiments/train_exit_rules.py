"""experiment=train_exit_rules: fit every registered exit rule that fits something
(specee/exit_rules/, ``fitted_on``) on the prompts SpecEE's predictors are trained on.

Data: each calibration prompt (``experiment.calibration``, the predictors' own set) is decoded
greedily by the dense model, then run teacher-forced once through every layer; each decode step and
layer below the last gives one row — the layer's hidden state and the consistency label (the layer's
argmax is already the full stack's token, the predictors' label). Prompts are split into train and
held-out (``held_out_share``); rows are subsampled to ``max_samples``. Each rule is written, with a
card (base weights' fingerprint, prompts, held-out metrics), to ``early_exit.exit_rules_path``.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from specee import data, results
from specee.decoding.dense import DenseDecoder
from specee.early_exit.predictor import binary_metrics
from specee.errors import SpeceeError
from specee.exit_rules import registered
from specee.io import atomic_dir, project_path
from specee.models.loader import load_model, weights_fingerprint
from specee.prompts import format_conversation
from specee.runtime.layerwise import LayerwiseLM


@torch.inference_mode()
def layer_rows(rt, prompt_ids: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, np.ndarray]:
    """Hidden states (T, L-1, d) after every layer below the last at each decode step of a dense
    generation, and their labels (T, L-1): the layer's argmax is the full stack's token."""
    ids = torch.cat([prompt_ids, torch.tensor([tokens[:-1]], device=prompt_ids.device)], 1)
    first = prompt_ids.shape[1]
    cache = rt.new_cache(ids.shape[1])
    pos = rt.positions(cache, ids.shape[1])
    h = rt.embed(ids)
    rope = rt.rope(h, pos)
    states, argmax = [], []
    for i in range(rt.num_layers):
        h = rt.run_layer(i, h, rope, cache, None, pos)
        rows = h[0, first:]
        argmax.append(rt.logits(rows).argmax(-1))
        states.append(rows.float())
    am = torch.stack(argmax, 1).cpu().numpy()
    return torch.stack(states[:-1], 1).cpu(), am[:, :-1] == am[:, -1:]


def run(cfg) -> dict:
    e = cfg.experiment
    fitted = {n: r for n, r in registered().items() if r.fitted_on}
    if not fitted:
        raise SpeceeError("no registered exit rule fits anything: nothing to train")
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    rt = LayerwiseLM(model)
    prompts, files = data.calibration_prompts(project_path(cfg.paths.data_root), e.calibration)
    dense = DenseDecoder(rt)
    per_prompt = []
    t0 = time.perf_counter()
    for p in tqdm(prompts, desc="collect hidden states"):
        ids = tokenizer(format_conversation(cfg.model.chat_template, [(p.turns[0], None)], tokenizer),
                        return_tensors="pt").input_ids.to(rt.device)
        gen = dense.generate(ids, e.calibration.max_new_tokens, tokenizer.eos_token_id)
        if len(gen.tokens) >= 2:
            per_prompt.append(layer_rows(rt, ids, gen.tokens))
    if not per_prompt:
        raise SpeceeError("the calibration prompts gave no decode steps; check experiment.calibration")
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(per_prompt))
    n_va = max(1, int(len(order) * e.held_out_share))
    if n_va >= len(order):
        raise SpeceeError(f"experiment.held_out_share={e.held_out_share} leaves no training prompt "
                          f"of {len(order)}: lower it")

    def rows(idx, cap):
        x = torch.cat([per_prompt[i][0].reshape(-1, per_prompt[i][0].shape[-1]) for i in idx])
        y = np.concatenate([per_prompt[i][1].reshape(-1) for i in idx])
        keep = rng.permutation(len(y))[:cap]
        return x[keep], y[keep]

    x_tr, y_tr = rows(order[n_va:], e.max_samples)
    x_va, y_va = rows(order[:n_va], e.max_samples)
    out, common = {}, {
        "model": cfg.model.name, "num_layers": rt.num_layers, "hidden_size": int(rt.config.hidden_size),
        "base_weights_fingerprint": weights_fingerprint(model), "command": results.command_line(), "seed": cfg.seed,
        "recipe": OmegaConf.to_container(e, resolve=True), "data_files": files,
        "calibration_prompt_ids": [p.id for p in prompts], "train_prompts": len(order) - n_va,
        "held_out_prompts": n_va, "samples": int(len(y_tr)), "held_out_samples": int(len(y_va)),
        "label": "argmax(lm_head(norm(h_l))) == final-layer token, dense greedy decoding (the predictors' label)",
        "positive_rate": float(y_tr.mean())}
    with atomic_dir(project_path(cfg.early_exit.exit_rules_path)) as tmp:
        for name, rule_cls in fitted.items():
            rule = rule_cls.fit(rule_cls.features(x_tr).numpy(), y_tr)
            with torch.no_grad():
                prob = rule.layer_scores(0, None, x_va, None).numpy()
            held = {str(t): binary_metrics(prob, y_va, t) for t in (0.5, 0.9)}
            rule.save(tmp, {**common, "rule": name, "fitted_on": rule_cls.fitted_on, "held_out": held,
                            "train_seconds": round(time.perf_counter() - t0, 1)})
            out[name] = held
            print(f"{name} held-out: {held}")
    print(f"saved {cfg.early_exit.exit_rules_path}")
    metrics = {"rules": out, "exit_rules_path": str(cfg.early_exit.exit_rules_path), "samples": int(len(y_tr)),
               "held_out_samples": int(len(y_va))}
    results.save(results.output_dir(), cfg, metrics)
    return metrics
