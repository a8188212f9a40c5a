"""Recipe: lm-eval accuracy of the configured decoding mode on the local tasks, offline.

    python run.py experiment=accuracy ablation=dense experiment.tasks=[boolq,copa] experiment.limit=20 threads=1

Writes ``results.json`` (``metrics.accuracy.<task>``: accuracy and lm-eval's metrics with
stderr, n, mean decoder layers used while scoring, truncated requests) and lm-eval's per-sample
log ``samples_<task>.jsonl`` into the run dir. ``experiment.update_baseline=true`` evaluates
twice (measuring run-to-run spread) and writes the drift baseline; ``experiment.check_baseline=true``
compares with it and exits 2 beyond tolerance (:mod:`specee.evaluation.drift`).
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

from specee import results
from specee.builders import build_decoder
from specee.decoding import modes
from specee.env import environment
from specee.errors import SpeceeError
from specee.evaluation import answer_figures, drift, registry
from specee.io import project_path
from specee.models.loader import load_model
from specee.runtime.build import build_runtime


def _key(metric: str, filt: str) -> str:
    """lm-eval's "metric,filter" -> one name (the filter is appended unless it is the default)."""
    return metric if filt == "none" else f"{metric}_{filt}"


def evaluate(cfg, lm, names: list[str], tm) -> tuple[dict, dict, float]:
    """Per-task metrics, lm-eval's per-sample logs (with specee's per-request layers), seconds."""
    from lm_eval import simple_evaluate

    e = cfg.experiment
    lm.records.clear()
    loaded = _capture_tasks(tm)  # the task objects lm-eval builds: their declared labels, all items
    t0 = time.perf_counter()
    from jinja2.exceptions import TemplateError
    try:
        # num_fewshot None: each task keeps its own (lm-eval's "Overwriting default num_fewshot"
        # happens only for a number the user gave).
        out = simple_evaluate(model=lm, tasks=names, task_manager=tm, num_fewshot=e.num_fewshot,
                              apply_chat_template=bool(e.chat_template),
                              limit=e.limit, log_samples=True, random_seed=cfg.seed,
                              numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed,
                              fewshot_random_seed=cfg.seed)
    except TemplateError as err:  # a user's task whose template names a field its data lacks
        raise SpeceeError(f"a prompt template of task(s) {names} cannot be filled from its data ({err}); "
                          "check doc_to_text / doc_to_target against the fields of the data file") from None
    seconds = time.perf_counter() - t0
    stats = lm.task_stats()
    per_doc = {}
    for (task, doc, idx), r in sorted(lm.records.items()):
        per_doc.setdefault((task, doc), []).append({"idx": idx, **r})
    metrics, samples = {}, {}
    for name in names:
        m = {_key(*k.split(",", 1)): float(v) for k, v in out["results"][name].items()
             if "," in k and isinstance(v, (int, float))}
        metric, filt = registry.primary_metric(name, out["results"][name], e.task_source).split(",")
        n = out["n-samples"][name]
        primary = _key(metric, filt)
        metrics[name] = {"accuracy": m[primary], "accuracy_stderr": m.get(_key(f"{metric}_stderr", filt)),
                         "primary_metric": primary,
                         "lower_is_better": registry.lower_is_better(name, primary, e.task_source), **m, "n": n["effective"], "n_available": n["original"],
                         **stats.get(name, {})}
        samples[name] = [{**s, "specee": per_doc.get((name, s["doc_id"]), [])} for s in out["samples"][name]]
        task_cfg = out.get("configs", {}).get(name, {})
        metrics[name]["num_fewshot"] = fewshot_used(task_cfg, out, name, e.num_fewshot)
        metrics[name]["chance"] = _chance(task_cfg, samples[name])  # what guessing scores: a verdict's floor
        if task_cfg.get("output_type") == "generate_until" and metric == "exact_match":
            meta = task_cfg.get("metadata") or {}
            own = answer_figures.task_labels(loaded[name]) if name in loaded else {}
            figs = answer_figures.figures(samples[name], metric, meta, cfg.ablation.mode, own.get("labels"))
            if own.get("labels_from"):
                figs["answer_labels_from"] = own["labels_from"]
            chance = metrics[name]["chance"]
            metrics[name].update(figs)
            # declared chance, else the task's own label set (all its items), else the evaluated golds'
            metrics[name]["chance"] = next((c for c in (chance, own.get("chance"), figs["chance"]) if c is not None),
                                           None)
            if meta.get("protocol"):  # a template changes the prompt: a different protocol, named so
                metrics[name]["protocol"] = meta["protocol"] + ("+chat_template" if e.chat_template else "")
    return metrics, samples, seconds


def _capture_tasks(tm) -> dict:
    """Keep the task objects ``simple_evaluate`` loads through ``tm`` (their datasets are read once)."""
    loaded = {}
    load = getattr(tm, "_specee_load", None) or tm.load

    def capture(*args, **kwargs):
        res = load(*args, **kwargs)
        loaded.update((res or {}).get("tasks", {}) if isinstance(res, dict) else {})
        return res
    tm._specee_load, tm.load = load, capture
    return loaded


def fewshot_used(task_cfg: dict, out: dict, name: str, asked: int | None) -> int | None:
    """The shots lm-eval actually put before each item: its resolved task config (the task's own
    unless the user gave a number; a task fixing 0 keeps 0)."""
    for v in (task_cfg.get("num_fewshot"), (out.get("n-shot") or {}).get(name)):
        if isinstance(v, int):
            return v
    return asked


def _chance(task_cfg: dict, rows: list[dict]) -> float | None:
    """The accuracy of guessing: the task's ``metadata.chance``, else for multiple choice the mean of
    1 / choices over its items; None where it is not defined (free-form answers, perplexity)."""
    meta = task_cfg.get("metadata") or {}
    if meta.get("chance") is not None:
        return float(meta["chance"])
    if task_cfg.get("output_type") == "multiple_choice" and rows:
        return sum(1 / max(len(r.get("resps") or [1]), 1) for r in rows) / len(rows)
    return None


def item_records(samples: dict) -> dict[str, dict]:
    """Per task, per item: the chosen answer (multiple choice: the index of the highest
    log-likelihood; generation: the filtered text), its log-likelihood and the mean layers used."""
    out = {}
    for task, rows in samples.items():
        items = {}
        for srow in rows:
            fr = srow.get("filtered_resps")
            if isinstance(fr, list) and fr and isinstance(fr[0], (list, tuple)) and isinstance(fr[0][0], (int, float)):
                lls = [float(x[0]) for x in fr]
                answer = max(range(len(lls)), key=lls.__getitem__)
                loglik = round(lls[answer], 4)
            else:
                answer = fr[0] if isinstance(fr, list) and fr else fr
                loglik = None
            recs = srow.get("specee") or []
            layers = round(sum(r["mean_layers"] for r in recs) / len(recs), 4) if recs else None
            items[str(srow["doc_id"])] = {"answer": answer, "loglik": loglik, "layers": layers}
        out[task] = items
    return out


def per_item(metrics: dict, samples: dict) -> dict[str, dict]:
    """Per task, per item (doc id): the primary metric's value for that item and the chosen answer,
    so that two modes can be compared item by item (paired differences, answers changed). For
    perplexity-like tasks the value is the document's bits per byte (its own, unweighted)."""
    answers = item_records(samples)
    out = {}
    for task, rows in samples.items():
        primary, items = metrics[task]["primary_metric"], {}
        for srow in rows:
            v = None
            for name in srow.get("metrics", []):
                if primary in (name, f"{name}_{srow.get('filter', 'none')}"):
                    v = srow.get(name)
            if isinstance(v, (list, tuple)) and len(v) == 2:  # (log-likelihood, bytes or words)
                v = -float(v[0]) / max(float(v[1]), 1.0) / math.log(2)
            if isinstance(v, bool) or isinstance(v, (int, float)):
                doc = str(srow["doc_id"])
                items[doc] = {"value": round(float(v), 6), "answer": answers[task][doc]["answer"]}
        out[task] = items
    return out


def calibration_overlap(cfg, samples: dict) -> int | None:
    """GSM8K items that were also predictor/SVM calibration prompts (Spec-Bench math = GSM8K test)."""
    card = project_path(cfg.early_exit.predictors_path) / "predictors_card.json"
    if modes.of(cfg.ablation).reference or "gsm8k" not in samples or not card.is_file():
        return None
    from specee.artifact_checks import check_card_values
    from specee.cards import read_card
    from specee.data import SPEC_BENCH, read_jsonl
    fix = "retrain the predictors (experiment=train_predictors) or point early_exit.predictors_path at another"
    doc = read_card(card, fix, what="predictors card")  # typed here too: a mode without a bank skips preflight's
    check_card_values(doc, card, "predictors card", {"calibration_prompt_ids": "ids"}, fix)
    ids = set(doc.get("calibration_prompt_ids", []))
    spec = project_path(cfg.paths.data_root) / SPEC_BENCH
    calib = {q["turns"][0].strip() for q in read_jsonl(spec, {"question_id": "id", "turns": "turns"})
             if q["question_id"] in ids}
    return sum(s["doc"]["question"].strip() in calib for s in samples["gsm8k"])


def on_reuse(cfg, done: dict) -> dict:
    """A reused accuracy result (specee/launch.py skips the run) is still checked for drift: a
    skipped run must not hide it."""
    e, out = cfg.experiment, results.output_dir()
    if e.check_baseline:
        baseline = project_path(e.baseline)
        samples = {t: [json.loads(l) for l in (out / f"samples_{t}.jsonl").read_text().splitlines()]
                   for t in done["metrics"]["accuracy"] if (out / f"samples_{t}.jsonl").is_file()}
        rows, ok, gate = drift.check(baseline, cfg.ablation.name, done["settings"], done["metrics"]["accuracy"],
                                     item_records(samples), e.drift_gate, done.get("env"))
        _verdict(baseline, rows, ok, gate)
    return done["metrics"]


def run(cfg) -> dict:
    out = results.output_dir()
    e = cfg.experiment
    names = list(e.tasks)
    registry.check_fewshot(names, e.num_fewshot, e.task_source)
    if e.task_source == "shipped":
        os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")  # local files only
    # lm-eval's datasets cache goes to the run dir unless the user chose one.
    os.environ.setdefault("HF_DATASETS_CACHE", str(out / "hf_datasets_cache"))
    from specee.evaluation.lm import SpeceeLM
    from specee.evaluation.tasks.utils import FEWSHOT_POOL

    include = project_path(e.include_path) if e.include_path else None
    tm = registry.task_manager(names, project_path(cfg.paths.data_root), out / "lm_eval_tasks",
                               include, e.task_source)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    rt = build_runtime(cfg.runtime, model)
    if e.chat_template and not getattr(tokenizer, "chat_template", None):
        raise SpeceeError(f"experiment.chat_template=true, but the tokenizer of {cfg.model.name} carries no chat "
                          f"template; set experiment.chat_template=false (plain-text prompts)")
    lm = SpeceeLM(build_decoder(cfg, rt), tokenizer, e.max_gen_tokens, e.max_length, e.on_overflow,
                  prefix_reuse=e.prefix_reuse)
    metrics, samples, seconds = evaluate(cfg, lm, names, tm)
    seconds = [seconds]
    if (overlap := calibration_overlap(cfg, samples)) is not None:
        metrics["gsm8k"]["calibration_overlap"] = overlap
        if overlap:
            print(f"warning: {overlap} evaluated gsm8k items were calibration prompts of the predictors")

    used = sorted({m.get("num_fewshot") for m in metrics.values()}, key=str)
    # One number where every task ran with it (the drift baselines' form), else per task.
    fewshot = used[0] if len(used) == 1 else {t: m.get("num_fewshot") for t, m in metrics.items()}
    settings = {"limit": e.limit, "num_fewshot": fewshot, "fewshot_pool": FEWSHOT_POOL,
                "chat_template": bool(e.chat_template),
                "task_source": e.task_source, "include_path": str(include) if include else None,
                "seed": cfg.seed, "max_gen_tokens": e.max_gen_tokens, "max_length": lm.max_length,
                "on_overflow": e.on_overflow, "dtype": cfg.model.dtype}
    extra = {"settings": settings, "device": str(rt.device)}
    baseline = project_path(e.baseline)
    if e.update_baseline:  # a second identical run measures run-to-run variation
        again, again_samples, secs = evaluate(cfg, lm, names, tm)
        seconds.append(secs)
        spread = {t: abs(again[t]["accuracy"] - metrics[t]["accuracy"]) for t in names}
        extra["repeat"] = {t: {"spread": spread[t], "identical_responses":
                               [s["resps"] for s in samples[t]] == [s["resps"] for s in again_samples[t]]}
                           for t in names}
        env = environment()
        drift.update(baseline, cfg.model.name, cfg.ablation.name, settings, metrics, spread,
                     {"packages": env["packages"], "cpu": env["cpu"], "gpus": env["gpus"],
                      "device": str(rt.device)}, item_records(samples))
        print(f"updated baseline {baseline} ({cfg.ablation.name}): spread {spread}")
    if e.check_baseline:
        rows, ok, gate = drift.check(baseline, cfg.ablation.name, settings, metrics, item_records(samples),
                                     e.drift_gate, environment())
        extra["drift"] = {"baseline": str(baseline), "ok": ok, **gate, "rows": rows}

    for name, logged in samples.items():
        with open(out / f"samples_{name}.jsonl", "w") as f:
            f.writelines(json.dumps(s, default=str) + "\n" for s in logged)
    extra["items"] = per_item(metrics, samples)
    m = {"accuracy": metrics, "num_layers": rt.num_layers, "mode": cfg.ablation.mode,
         "eval_seconds": seconds, "operating_point": getattr(lm.decoder, "operating_point", None)}
    if lm.prefix is not None:  # how much prompt prefill the shared prefixes saved
        m["prefix_reuse"] = {"reused_tokens": lm.prefix.reused_tokens, "prefilled_tokens": lm.prefix.prefilled_tokens}
    path = results.save(out, cfg, m, extra)
    for name, t in metrics.items():
        print(f"{cfg.ablation.name} {name}: accuracy {t['accuracy']:.3f} +- {t['accuracy_stderr'] or 0:.3f} "
              f"(n={t['n']}), mean layers {t.get('mean_layers', float('nan')):.2f}/{rt.num_layers}, "
              f"truncated {t.get('truncated', 0)}")
    print(f"wrote {path}")
    if e.check_baseline:
        _verdict(baseline, rows, ok, gate)
    return m


def _verdict(baseline: Path, rows: list[dict], ok: bool, gate: dict) -> None:
    print(f"drift gate: {gate['gate']} ({gate['reason']})")
    print(drift.table(rows))
    if not ok:
        raise SpeceeError(f"accuracy drifted from {baseline} ({gate['gate']} gate: {gate['reason']}):\n"
                          f"{drift.table(rows)}")
