"""Recipe: collect exit features on calibration prompts, train per-layer predictors and the
AdaInfer SVM, save both with metadata.

    python run.py experiment=train_predictors model=tiny

Calibration prompts are disjoint from evaluation ones: Spec-Bench prompts from
``calibration.spec_bench_offset`` on (speed runs read offsets below it; the speed recipe checks) plus
openings of held-out TinyStories. The split into train / held-out is by prompt, so tokens of
one answer never sit on both sides.

Class imbalance: most (token, layer) pairs are negative in early layers and positive in late
ones. By default (``pos_weight=none``) the MLP learns the natural prior, so threshold 0.5 means
"more likely than not already final" — favouring precision, because a false exit that passes
verification changes the output. ``pos_weight=balanced`` weights positives by n_neg/n_pos.
"""
from __future__ import annotations

import hashlib
import time

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from specee import data, results
from specee.decoding.adainfer import AdaInferSVM
from specee.early_exit.collect import collect_prompt
from specee.early_exit.features import FEATURE_DEFINITION
from specee.early_exit.predictor import PredictorBank, binary_metrics, train_layer
from specee.errors import SpeceeError
from specee.io import atomic_dir, project_path
from specee.models.draft import load_draft
from specee.models.loader import load_model
from specee.prompts import format_conversation
from specee.runtime import LayerwiseLM


def train_svm(x: np.ndarray, y: np.ndarray, max_samples: int, seed: int) -> tuple[AdaInferSVM, dict]:
    from sklearn.svm import LinearSVC
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(x))[:max_samples]
    if len(np.unique(y[idx])) < 2:  # e.g. a model whose every layer already agrees with the last
        only = bool(y[idx][0])
        return AdaInferSVM([0.0, 0.0], 1.0 if only else -1.0), {
            "samples": int(len(idx)), "degenerate": f"single class ({only}) in the labels: constant decision"}
    svm = LinearSVC(C=1.0, dual=False).fit(x[idx], y[idx])
    return AdaInferSVM(svm.coef_[0].tolist(), float(svm.intercept_[0])), {"samples": int(len(idx))}


def run(cfg) -> dict:
    e, k = cfg.experiment, cfg.early_exit.k
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    rt = LayerwiseLM(model)
    draft, draft_card = load_draft(project_path(cfg.draft.path), rt)
    prompts, files = data.calibration_prompts(project_path(cfg.paths.data_root), e.calibration)

    per_prompt = []
    for p in tqdm(prompts, desc="collect exit features"):
        text = format_conversation(cfg.model.chat_template, [(p.turns[0], None)], tokenizer)
        ids = tokenizer(text, return_tensors="pt").input_ids.to(rt.device)
        got = collect_prompt(rt, draft, ids, e.calibration.max_new_tokens, k, tokenizer.eos_token_id)
        if got:
            per_prompt.append(got)
    if not per_prompt:
        raise SpeceeError("calibration produced no tokens; check the calibration prompt settings")
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(per_prompt))
    n_va = max(1, int(len(order) * e.held_out_share))
    va, tr = [per_prompt[i] for i in order[:n_va]], [per_prompt[i] for i in order[n_va:]]
    cat = lambda rows, key: np.concatenate([r[key] for r in rows])  # noqa: E731
    X_tr, Y_tr, X_va, Y_va = cat(tr, "feats"), cat(tr, "label"), cat(va, "feats"), cat(va, "label")
    data_hash = hashlib.sha256(np.ascontiguousarray(cat(per_prompt, "feats")).tobytes()
                               + np.ascontiguousarray(cat(per_prompt, "label")).tobytes()).hexdigest()

    L = rt.num_layers
    bank = PredictorBank(L, k, e.hidden, cfg.early_exit.threshold)
    layer_metrics, t0 = [], time.perf_counter()
    for layer in tqdm(range(L - 1), desc="train predictors"):  # the last layer always emits
        mlp, m = train_layer(X_tr[:, layer], Y_tr[:, layer], X_va[:, layer], Y_va[:, layer], k,
                             e.hidden, e.epochs, e.lr, e.batch_size, e.pos_weight,
                             cfg.early_exit.threshold, cfg.seed + layer)
        bank.put(layer, mlp)
        layer_metrics.append({"layer": layer, **{f"{split}_{key}": v for split in m
                                                 for key, v in m[split].items()}})
    # Share of tokens whose final token was among the draft's K (an exit needs it there).
    final_in_spec = float(np.mean([r["in_spec"][:, -1].mean() for r in per_prompt]))

    A_tr, A_va = cat(tr, "ada")[:, : L - 1].reshape(-1, 2), cat(va, "ada")[:, : L - 1].reshape(-1, 2)
    svm, svm_info = train_svm(A_tr, Y_tr[:, : L - 1].reshape(-1), e.svm_max_samples, cfg.seed)
    with torch.no_grad():
        dec = (torch.as_tensor(A_va, dtype=torch.float32) @ svm.w + svm.b).numpy()
    svm_metrics = binary_metrics(1 / (1 + np.exp(-dec)), Y_va[:, : L - 1].reshape(-1), 0.5)

    common = {
        "model": cfg.model.name, "num_layers": L, "k": k, "base_weights_fingerprint":
            draft_card.get("base_weights_fingerprint"), "draft": str(cfg.draft.path),
        "command": results.command_line(), "seed": cfg.seed,
        "recipe": OmegaConf.to_container(e, resolve=True), "data_files": files,
        "calibration_prompt_ids": [p.id for p in prompts], "collected_tokens": int(sum(len(r["label"]) for r in per_prompt)),
        "train_prompts": len(tr), "held_out_prompts": len(va), "data_sha256": data_hash,
        "label": "argmax(lm_head(norm(h_l))) == final-layer token, dense greedy decoding",
    }
    card = {**common, "feature_definition": FEATURE_DEFINITION, "threshold": cfg.early_exit.threshold,
            "pos_weight": e.pos_weight, "hidden": e.hidden, "epochs": e.epochs,
            "final_token_in_spec_share": final_in_spec, "per_layer": layer_metrics,
            "train_seconds": round(time.perf_counter() - t0, 1)}
    with atomic_dir(project_path(e.out_dir)) as tmp:
        bank.save(tmp, card)
    with atomic_dir(project_path(e.adainfer_out_dir)) as tmp:
        svm.save(tmp, {**common, "features": "[gap = p1 - p2, top_prob = p1] of the full LM head",
                       "classifier": "sklearn LinearSVC(C=1), one for all layers", **svm_info,
                       "held_out": svm_metrics})
    print(f"collected {common['collected_tokens']} tokens from {len(prompts)} prompts; "
          f"final token in draft top-{k}: {final_in_spec:.3f}")
    for r in layer_metrics:
        print(f"layer {r['layer']:2d}: pos rate {r['held_out_positive_rate']:.3f}  acc {r['held_out_accuracy']:.3f}  "
              f"prec {r['held_out_precision']:.3f}  rec {r['held_out_recall']:.3f}")
    print(f"AdaInfer SVM held-out: {svm_metrics}")
    print(f"saved {e.out_dir} and {e.adainfer_out_dir}")
    results.save(results.output_dir(), cfg, {"per_layer": layer_metrics, "adainfer_svm": svm_metrics,
                                            "final_token_in_spec_share": final_in_spec})
    return card
