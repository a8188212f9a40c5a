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

Recipes: ``experiment.recipe=harness`` (the default: the fields as set, 15 epochs, batch 256, the
label from norm(h_l) -- the harness's own, not the authors') or ``paper`` (the SpecEE authors'
recipe, PAPER_RECIPE below). Options beyond the paper:

* ``label=verified``: positive when the layer's argmax is the final token AND that token is in the
  draft's top-K S — a fire the LM-head verification confirms and that emits the right token
  (``final``, the paper's, also counts fires that verification then refutes).
* ``target_precision=P``: per-layer thresholds, stored in the card (``layer_thresholds``) for
  ``early_exit.calibration=per_layer``. The held-out prompts are split in two halves: on the first,
  layer l gets the lowest threshold whose precision (for the label) reaches P with at least
  ``threshold_min_fires`` fires (1.0 = never fire where none does); the card reports precision and
  recall at those thresholds on the second half, which took no part in choosing them.
"""
from __future__ import annotations

import hashlib
import time

import numpy as np
import torch
from omegaconf import OmegaConf, open_dict
from tqdm import tqdm

from specee import data, results
from specee.decoding.adainfer import AdaInferSVM, train_crf
from specee.early_exit.training_data import collect_prompt
from specee.early_exit.features import FEATURE_DEFINITION
from specee.early_exit.predictor import THRESHOLDS, PredictorBank, binary_metrics, select_threshold, train_layer
from specee.errors import SpeceeError
from specee.io import atomic_dir, project_path
from specee.models.draft import load_draft
from specee.models.loader import load_model
from specee.prompts import format_conversation
from specee.runtime.layerwise import LayerwiseLM


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


LABELS = {
    "final": "argmax(lm_head(norm(h_l))) == final-layer token, dense greedy decoding",
    "unnormed": "argmax(lm_head(h_l)) == final-layer token (the un-normed state, as the SpecEE authors' "
                "collection script labels it; the features still read norm(h_l)), dense greedy decoding",
    "verified": "argmax(lm_head(norm(h_l))) == final-layer token AND that token is in the draft's top-K S "
                "(a fire the LM-head verification confirms), dense greedy decoding",
}


# The SpecEE authors' predictor recipe (public repository MathsCode/ISCA25-SpecEE, AutoEE/Classifier:
# collect_data/model_llama_ee.py labels, train.py trains): one 12->512->1 MLP per layer, BCE, Adam
# 1e-3, 100 epochs, batch 1024, an 80/20 split, threshold 0.5 (their .round()), the label from the
# un-normed state, ~20 K calibration tokens (theirs: 80 summarization questions x 256 new tokens).
# What differs, and why: their 80/20 split is over rows, here over prompts (a token's rows never sit on
# both sides); their calibration questions and their "sum" speed set come from the same source, here
# the calibration prompts are Spec-Bench summarization, QA, RAG and translation prompts from offset 10
# on (the speed runs and the paper speed preset read offsets below 10; MT-Bench and math are left
# out because the paper speed preset evaluates MT-Bench and GSM8K), taken in that order until 20,000
# tokens are collected; their first layer's delta feature is softmax(z) - 0, here softmax(z) - 1/K.
PAPER_RECIPE = {"hidden": 512, "epochs": 100, "lr": 1e-3, "batch_size": 1024, "pos_weight": "none",
                "held_out_share": 0.2, "label": "unnormed", "target_precision": None,
                "calibration": {"spec_bench_categories": ["summarization", "qa", "rag", "translation"],
                                "spec_bench_offset": 10, "spec_bench_count": 70, "story_prompts": 0,
                                "max_new_tokens": 256, "min_tokens": 20000}}
PAPER_THRESHOLD = 0.5
RECIPE_SOURCES = {
    "harness": "the harness's defaults (15 epochs, batch 256, label from norm(h_l), split by prompt); "
               "not the authors' recipe",
    "paper": "the SpecEE authors' recipe (MathsCode/ISCA25-SpecEE AutoEE/Classifier: 100 epochs, batch 1024, "
             "Adam 1e-3, 80/20, threshold 0.5, label from the un-normed state, ~20 K tokens); split by prompt "
             "and calibration disjoint from evaluation here",
}


def resolve_recipe(cfg) -> None:
    """``experiment.recipe=paper`` sets every field of the authors' recipe; a field the user set to
    something else is refused (the card must not say "paper" for a recipe that is not)."""
    from specee.config import CalibrationConfig, TrainPredictorsExperiment
    e = cfg.experiment
    if e.recipe == "harness":
        return
    if e.recipe != "paper":
        raise SpeceeError(f"experiment.recipe={e.recipe!r} is unknown; valid: harness (the defaults), paper")
    defaults = {**vars(TrainPredictorsExperiment()), "calibration": vars(CalibrationConfig())}
    clashes = []
    for key, want in PAPER_RECIPE.items():
        pairs = want.items() if key == "calibration" else [(None, want)]
        for sub, value in pairs:
            have = e[key][sub] if sub else e[key]
            default = defaults[key][sub] if sub else defaults[key]
            have = list(have) if OmegaConf.is_list(have) else have
            if have != value and have != default:
                clashes.append(f"experiment.{key}{'.' + sub if sub else ''}={have} (the recipe: {value})")
    if cfg.early_exit.threshold != PAPER_THRESHOLD:
        clashes.append(f"early_exit.threshold={cfg.early_exit.threshold} (the recipe: {PAPER_THRESHOLD})")
    if clashes:
        raise SpeceeError("experiment.recipe=paper fixes the authors' settings; drop or match "
                          + "; ".join(clashes) + " (or use experiment.recipe=harness)")
    with open_dict(e):
        for key, want in PAPER_RECIPE.items():
            if key == "calibration":
                for sub, value in want.items():
                    e.calibration[sub] = value
            else:
                e[key] = want


def bank_dir(cfg) -> str:
    """Where the bank is written: ``experiment.out_dir``; the paper recipe, left at the default
    (early_exit.predictors_path), writes ``<model>_predictors_paper``, the folder
    ``ablation=specee_t1_t2_paper`` reads (a paper bank never replaces the harness-default one)."""
    e = cfg.experiment
    raw = OmegaConf.to_container(e, resolve=False).get("out_dir")
    out = str(e.out_dir)
    if e.recipe == "paper" and raw == "${early_exit.predictors_path}" and not out.rstrip("/").endswith("_paper"):
        return out.rstrip("/") + "_paper"
    return out


def run(cfg) -> dict:
    resolve_recipe(cfg)
    e, k = cfg.experiment, cfg.early_exit.k
    if e.target_precision is not None and not 0 < e.target_precision <= 1:
        raise SpeceeError(f"experiment.target_precision={e.target_precision} must lie in (0, 1] "
                          "(null: no per-layer thresholds)")
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    rt = LayerwiseLM(model)
    draft, draft_card = load_draft(project_path(cfg.draft.path), rt)
    prompts, files = data.calibration_prompts(project_path(cfg.paths.data_root), e.calibration)

    inputs = [tokenizer(format_conversation(cfg.model.chat_template, [(p.turns[0], None)], tokenizer),
                        return_tensors="pt").input_ids.to(rt.device) for p in prompts]
    unnormed = e.label == "unnormed"  # only the authors' label reads the un-normed states' heads
    cache_key = _collection_key(rt, draft, inputs, e.calibration.max_new_tokens, k, tokenizer.eos_token_id,
                                unnormed) \
        if e.features_cache else None
    per_prompt = _read_features_cache(project_path(e.features_cache), cache_key) if e.features_cache else None
    visited = len(inputs)
    if per_prompt is not None and e.calibration.min_tokens:
        per_prompt = None  # which prompts a token target used is not stored with the cache
    if per_prompt is None:
        per_prompt = []
        bar, collected = tqdm(inputs, desc="collect exit features"), 0
        for visited, ids in enumerate(bar, 1):
            got = collect_prompt(rt, draft, ids, e.calibration.max_new_tokens, k, tokenizer.eos_token_id, unnormed)
            if got:
                per_prompt.append(got)
                collected += len(got["label"])
                bar.set_postfix(tokens=collected)
            if e.calibration.min_tokens and collected >= e.calibration.min_tokens:
                break  # the prompts after this one are not used (the card lists those that were)
        if e.calibration.min_tokens and collected < e.calibration.min_tokens:
            print(f"warning: the calibration prompts gave {collected} tokens, fewer than "
                  f"experiment.calibration.min_tokens={e.calibration.min_tokens}")
        if e.features_cache and per_prompt:
            _write_features_cache(project_path(e.features_cache), cache_key, per_prompt)
    if not per_prompt:
        raise SpeceeError("calibration produced no tokens; check the calibration prompt settings")
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(per_prompt))
    n_va = max(1, int(len(order) * e.held_out_share))
    va, tr = [per_prompt[i] for i in order[:n_va]], [per_prompt[i] for i in order[n_va:]]
    if e.label == "verified":  # the exit the decoder would take: right token, and in S to pass verification
        for r in per_prompt:
            r["target"] = r["label"] & r["in_spec"]
    elif e.label == "unnormed":
        for r in per_prompt:
            r["target"] = r["label_unnormed"]
    else:
        for r in per_prompt:
            r["target"] = r["label"]
    cat = lambda rows, key: np.concatenate([r[key] for r in rows])  # noqa: E731
    X_tr, Y_tr, X_va, Y_va = cat(tr, "feats"), cat(tr, "target"), cat(va, "feats"), cat(va, "target")
    Yf_tr, Yf_va = cat(tr, "label"), cat(va, "label")  # the final-token label (AdaInfer's SVM)
    per_layer_t = e.target_precision is not None
    if per_layer_t:  # thresholds chosen on held-out half A, reported on half B (no optimism)
        if len(va) < 2:
            raise SpeceeError(f"experiment.target_precision needs at least 2 held-out prompts to choose thresholds "
                              f"on one half and report on the other; {len(va)} held out: raise "
                              "experiment.held_out_share or add calibration prompts")
        n_sel = len(va) // 2
        cut = sum(len(r["label"]) for r in va[:n_sel])
        sel, rep = slice(0, cut), slice(cut, None)
    data_hash = hashlib.sha256(np.ascontiguousarray(cat(per_prompt, "feats")).tobytes()
                               + np.ascontiguousarray(cat(per_prompt, "label")).tobytes()).hexdigest()

    L = rt.num_layers
    bank = PredictorBank(L, k, e.hidden, cfg.early_exit.threshold)
    layer_metrics, t0 = [], time.perf_counter()
    thresholds = [1.0] * L  # the last layer always emits: no threshold of its own
    for layer in tqdm(range(L - 1), desc="train predictors"):  # the last layer always emits
        mlp, m = train_layer(X_tr[:, layer], Y_tr[:, layer], X_va[:, layer], Y_va[:, layer], k,
                             e.hidden, e.epochs, e.lr, e.batch_size, e.pos_weight,
                             cfg.early_exit.threshold, cfg.seed + layer)
        bank.put(layer, mlp)
        layer_metrics.append({"layer": layer, **{f"{split}_{key}": v for split in m
                                                 for key, v in m[split].items()}})
        if per_layer_t:
            with torch.no_grad():
                p_va = torch.sigmoid(mlp(torch.as_tensor(X_va[:, layer], dtype=torch.float32)).squeeze(-1)).numpy()
            y_va = np.asarray(Y_va[:, layer])
            t = thresholds[layer] = select_threshold(p_va[sel], y_va[sel], e.target_precision, e.threshold_min_fires)
            chose, shown = binary_metrics(p_va[sel], y_va[sel], t), binary_metrics(p_va[rep], y_va[rep], t)
            layer_metrics[-1].update({"threshold": t, **{f"select_{key}": chose[key] for key in ("n", "precision", "recall")},
                                      "select_fires": int((p_va[sel] > t).sum()),
                                      **{f"report_{key}": shown[key] for key in ("n", "precision", "recall")},
                                      "report_fires": int((p_va[rep] > t).sum()),
                                      "report_true_fires": int(((p_va[rep] > t) & (y_va[rep] == 1)).sum()),
                                      "report_positives": int((y_va[rep] == 1).sum())})
    # Share of tokens whose final token was among the draft's K (an exit needs it there).
    final_in_spec = float(np.mean([r["in_spec"][:, -1].mean() for r in per_prompt]))

    A_tr, A_va = cat(tr, "ada")[:, : L - 1].reshape(-1, 2), cat(va, "ada")[:, : L - 1].reshape(-1, 2)
    svm, svm_info = train_svm(A_tr, Yf_tr[:, : L - 1].reshape(-1), e.svm_max_samples, cfg.seed)
    with torch.no_grad():
        dec = (torch.as_tensor(A_va, dtype=torch.float32) @ svm.w + svm.b).numpy()
    svm_metrics = binary_metrics(1 / (1 + np.exp(-dec)), Yf_va[:, : L - 1].reshape(-1), 0.5)
    # AdaInfer's other classifier: a CRF over the sequence of layers, same features and labels
    crf, crf_info = train_crf(cat(tr, "ada")[:, : L - 1], Yf_tr[:, : L - 1], e.svm_max_samples, cfg.seed)
    with torch.no_grad():
        p_crf = crf.filtered(torch.as_tensor(cat(va, "ada")[:, : L - 1], dtype=torch.float32)).numpy()
    crf_metrics = binary_metrics(p_crf.reshape(-1), Yf_va[:, : L - 1].reshape(-1), 0.5)

    common = {
        "model": cfg.model.name, "num_layers": L, "k": k, "base_weights_fingerprint":
            draft_card.get("base_weights_fingerprint"), "draft": str(cfg.draft.path),
        "command": results.command_line(), "seed": cfg.seed,
        "recipe": OmegaConf.to_container(e, resolve=True), "recipe_name": e.recipe,
        "recipe_source": RECIPE_SOURCES[e.recipe], "data_files": files,
        "calibration_prompt_ids": [p.id for p in prompts[:visited]], "collected_tokens": int(sum(len(r["label"]) for r in per_prompt)),
        "train_prompts": len(tr), "held_out_prompts": len(va), "data_sha256": data_hash,
        "label": LABELS["final"],
    }
    card = {**common, "feature_definition": FEATURE_DEFINITION, "threshold": cfg.early_exit.threshold,
            "pos_weight": e.pos_weight, "hidden": e.hidden, "epochs": e.epochs,
            "final_token_in_spec_share": final_in_spec, "per_layer": layer_metrics,
            "train_seconds": round(time.perf_counter() - t0, 1)}
    if e.label != "final":
        card["label"] = LABELS[e.label]
    if per_layer_t:
        card[THRESHOLDS] = thresholds
        card["threshold_selection"] = _selection_summary(e, layer_metrics, va, n_sel, L)
    out_dir = bank_dir(cfg)
    with atomic_dir(project_path(out_dir)) as tmp:
        bank.save(tmp, card)
    with atomic_dir(project_path(e.adainfer_out_dir)) as tmp:
        svm.save(tmp, {**common, "features": "[gap = p1 - p2, top_prob = p1] of the full LM head",
                       "classifier": "sklearn LinearSVC(C=1), one for all layers", **svm_info,
                       "held_out": svm_metrics})
        crf.save(tmp, {**common, "features": "[gap = p1 - p2, top_prob = p1] of the full LM head, per layer",
                       "classifier": "linear-chain CRF over layers 0..L-2 (labels continue/stop), maximum "
                                     "likelihood by L-BFGS; decides online from the filtered P(stop | layers so far)",
                       **crf_info, "held_out": crf_metrics})
    print(f"collected {common['collected_tokens']} tokens from {len(common['calibration_prompt_ids'])} prompts; "
          f"final token in draft top-{k}: {final_in_spec:.3f}")
    for r in layer_metrics:
        print(f"layer {r['layer']:2d}: pos rate {r['held_out_positive_rate']:.3f}  acc {r['held_out_accuracy']:.3f}  "
              f"prec {r['held_out_precision']:.3f}  rec {r['held_out_recall']:.3f}"
              + (f"  | t {r['threshold']:.3f}: report prec {r['report_precision']:.3f}  rec {r['report_recall']:.3f}"
                 if per_layer_t else ""))
    if per_layer_t:
        print(f"per-layer thresholds (target precision {e.target_precision}, label {e.label}): "
              f"{card['threshold_selection']['report']}")
    print(f"AdaInfer SVM held-out: {svm_metrics}")
    print(f"AdaInfer CRF held-out: {crf_metrics}")
    print(f"saved {out_dir} and {e.adainfer_out_dir}")
    results.save(results.output_dir(), cfg, {"per_layer": layer_metrics, "adainfer_svm": svm_metrics,
                                            "adainfer_crf": crf_metrics, "bank_dir": str(out_dir),
                                            "final_token_in_spec_share": final_in_spec})
    return card


def _selection_summary(e, layer_metrics: list[dict], va: list[dict], n_sel: int, num_layers: int) -> dict:
    """How the per-layer thresholds were chosen, and what they give on the half that did not choose."""
    fires = sum(r["report_fires"] for r in layer_metrics)
    true_fires = sum(r["report_true_fires"] for r in layer_metrics)
    positives = sum(r["report_positives"] for r in layer_metrics)
    return {
        "target_precision": e.target_precision, "label": e.label, "min_fires": e.threshold_min_fires,
        "rule": "per layer, the lowest t (fire: prob > t) whose precision on the selection half reaches "
                "target_precision with >= min_fires fires; else 1.0 (never fire)",
        "selection_half": {"prompts": n_sel, "tokens": int(sum(len(r["label"]) for r in va[:n_sel]))},
        "report_half": {"prompts": len(va) - n_sel, "tokens": int(sum(len(r["label"]) for r in va[n_sel:]))},
        "note": "thresholds chosen on the selection half of the held-out prompts; 'report' metrics come from "
                "the other half, which took no part in choosing them (the selection-half precision is optimistic)",
        "never_fire_layers": [r["layer"] for r in layer_metrics if r["threshold"] >= 1.0],
        # pooled over layers 0..L-2 (the last always emits) on the report half
        "report": {"fires": fires, "precision": true_fires / fires if fires else None,
                   "recall": true_fires / positives if positives else None},
    }


_CACHED = ("feats", "argmax", "argmax_unnormed", "ada", "spec", "label", "label_unnormed", "in_spec")


def _collection_key(rt, draft, inputs, max_new_tokens: int, k: int, eos_id, unnormed: bool = False) -> str:
    """What the collected features are a function of: base and draft weights, the prompts' token ids
    and the decoding settings (so a cache from other weights, prompts or settings is never reused)."""
    h = hashlib.sha256(repr((max_new_tokens, k, eos_id, str(rt.dtype), str(rt.device))
                            + (("unnormed",) if unnormed else ())).encode())
    for module in (rt.model, draft):
        for name, t in sorted(module.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    for ids in inputs:
        h.update(ids.cpu().numpy().astype(np.int64).tobytes() + b"|")
    return h.hexdigest()


def _read_features_cache(path, key: str):
    """The per-prompt collections stored at ``path`` when they were made from the same inputs (same
    key), else None (collected afresh, then stored there)."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["key"]) != key:
                print(f"features cache {path} was collected from other weights, prompts or settings; recollecting")
                return None
            n = int(z["prompts"])
            return [{name: z[f"{i}_{name}"] for name in _CACHED if f"{i}_{name}" in z} for i in range(n)]
    except (OSError, ValueError, KeyError) as err:
        print(f"features cache {path} is unreadable ({type(err).__name__}); recollecting")
        return None


def _write_features_cache(path, key: str, per_prompt: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"{i}_{name}": r[name] for i, r in enumerate(per_prompt) for name in _CACHED if name in r}
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, key=np.array(key), prompts=np.array(len(per_prompt)), **arrays)
    tmp.replace(path)
