"""Task quality at every operating point, from one recorded pass through lm-eval.

lm-eval builds each task's requests and scores dense once (:class:`RecordingLM`, the harness's
lm-eval model, answering with the full stack's log-likelihoods while it records every layer of
every request). An operating point's answers are then replayed from the records and handed to the
task's own ``process_results`` (lm-eval's scoring: acc, acc_norm, bits per byte), item by item.
"""
from __future__ import annotations

import math
import os
import random

import numpy as np
from lm_eval import utils as lm_utils
from tqdm import tqdm

from specee.evaluation import registry
from specee.evaluation.lm import SpeceeLM
from specee.frontier.record import record_continuations
from specee.frontier.replay import layer_thresholds, oracle_exits, replay
from specee.io import project_path


class RecordingLM(SpeceeLM):
    """lm-eval model answering with dense log-likelihoods while recording every layer."""

    GROUP = 8  # requests recorded together at most (their layer logits are held until the draft runs)

    def __init__(self, rt, tokenizer, parts: dict, k: int, max_length=None):
        from specee.decoding.dense import DenseDecoder
        super().__init__(DenseDecoder(rt), tokenizer, max_length=max_length, prefix_reuse=False)
        self.parts, self.k = parts, k
        self.recorded: dict[tuple, list] = {}

    def _fit_pair(self, ctx, cont):
        ctx, _ = self._fit(ctx, self.max_length + 1 - len(cont), f"a {len(cont)}-token continuation")
        return ctx, cont

    def _record_pair(self, ctx, cont):
        return self._record_pairs([(ctx, cont)])[0]

    def _record_pairs(self, pairs):
        return record_continuations(self.rt, self.parts["draft"], self.parts["banks"], self.k,
                                    [self._fit_pair(*p) for p in pairs], self.parts.get("svm"), self.parts.get("crf"),
                                    self.parts.get("rules"))

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        # a multiple-choice item's requests share their context: recorded together, one LM head
        # product per layer over all its choices (see record_requests)
        groups: dict[str, list[int]] = {}
        for n, req in enumerate(requests):
            groups.setdefault(req.args[0], []).append(n)
        out = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="record loglikelihood", disable=disable_tqdm)
        for members in groups.values():
            for chunk in (members[i: i + self.GROUP] for i in range(0, len(members), self.GROUP)):
                recs = self._record_pairs([self.encode_pair(*requests[n].args) for n in chunk])
                for n, rec in zip(chunk, recs):
                    req = requests[n]
                    self.recorded[(req.task_name, req.doc_id, req.idx)] = [rec]
                    out[n] = (float(rec.logp[:, -1].sum()), bool((rec.final == rec.targets).all()))
                bar.update(len(chunk))
        bar.close()
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        out = []
        for req in tqdm(requests, desc="record rolling", disable=disable_tqdm):
            windows = map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(req.args[0]), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            recs = [self._record_pair(ctx, cont) for ctx, cont in windows]
            self.recorded[(req.task_name, req.doc_id, req.idx)] = recs
            out.append(float(sum(r.logp[:, -1].sum() for r in recs)))
        return out


def _exact_ci(k: int, n: int) -> tuple[float, float]:
    from scipy.stats import beta
    lo = 0.0 if k == 0 else float(beta.ppf(0.025, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(0.975, k + 1, n - k))
    return lo, hi


def record_tasks(cfg, rt, tokenizer, parts: dict, out) -> dict:
    """Per task: its items' records, lm-eval's task object, dense's answers, the halves."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import get_task_dict
    e = cfg.experiment
    names = list(e.tasks)
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    os.environ.setdefault("HF_DATASETS_CACHE", str(out / "hf_datasets_cache"))
    tm = registry.task_manager(names, project_path(cfg.paths.data_root), out / "lm_eval_tasks", None, "shipped")
    lm = RecordingLM(rt, tokenizer, parts, cfg.early_exit.k)
    res = {"results": {}, "samples": {}}
    # whole documents (perplexity-like: every token a decision) take their own, smaller limit
    docs = [n for n in names if registry.lower_is_better(n, registry.primary_metric(n, None, "shipped"), "shipped")]
    for group, limit in (([n for n in names if n not in docs], e.task_limit), (docs, e.document_limit)):
        if not group:
            continue
        r = simple_evaluate(model=lm, tasks=group, task_manager=tm, limit=limit, log_samples=True,
                            random_seed=cfg.seed, numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed,
                            fewshot_random_seed=cfg.seed)
        res["results"].update(r["results"])
        res["samples"].update(r["samples"])
    objs = get_task_dict(names, tm)
    tasks = {}
    for name in names:
        primary = registry.primary_metric(name, res["results"][name], "shipped").split(",")[0]
        lower = registry.lower_is_better(name, primary, "shipped")
        items = []
        for s in res["samples"][name]:
            n_req = len(s["arguments"])
            recs = [lm.recorded[(name, s["doc_id"], i)] for i in range(n_req)]
            items.append({"doc_id": s["doc_id"], "doc": s["doc"], "records": recs,
                          "dense": float(s[primary]) if not isinstance(s[primary], (list, tuple)) else None})
        ids = sorted(i["doc_id"] for i in items)
        rng = random.Random(cfg.seed)
        rng.shuffle(ids)
        calib = set(ids[: int(len(ids) * e.calibration_share)])
        rolling = lower
        task = {"name": name, "primary": primary, "lower_is_better": lower, "task": objs[name],
                "items": items, "calibration_ids": calib, "n": len(items), "rolling": rolling}
        dense = task_point(task, None, None, None, dense=True)
        task["dense"] = dense
        if rolling:
            task["testable"], task["chance"] = False, None
            task["why_not_testable"] = "a perplexity-like metric: reported as a change, no accuracy budget"
        else:
            chance = float(np.mean([1 / max(len(i["records"]), 1) for i in items]))
            k = int(round(sum(i["dense"] for i in items)))
            lo, hi = _exact_ci(k, len(items))
            task.update({"chance": chance, "dense_ci": [lo, hi], "testable": bool(lo > chance)})
            if not task["testable"]:
                task["why_not_testable"] = (f"dense at chance: {100 * k / len(items):.1f} % "
                                            f"[{100 * lo:.1f}, {100 * hi:.1f}] against {100 * chance:.1f} %")
        tasks[name] = task
    return tasks


def _item_value(task, item, exits_of) -> tuple[float, float]:
    """(metric value, mean layers) of one item with each request's exits from ``exits_of``."""
    results, layers = [], []
    for recs in item["records"]:
        ll, greedy = 0.0, True
        for rec in recs:
            ex = exits_of(rec)
            t = np.arange(rec.steps)
            ll += float(rec.logp[t, ex.layer].sum())
            greedy &= bool((rec.argmax[t, ex.layer] == rec.targets).all())
            layers += (ex.layer + 1).tolist()
        results.append(ll if task["rolling"] else (ll, greedy))
    out = task["task"].process_results(item["doc"], results)
    v = out[task["primary"]]
    if isinstance(v, (list, tuple)):  # (log-likelihood, bytes): this item's bits per byte
        v = -float(v[0]) / max(float(v[1]), 1.0) / math.log(2)
        return v, float(np.mean(layers)) if layers else float("nan"), out[task["primary"]]
    return float(v), float(np.mean(layers)) if layers else float("nan"), None


def task_point(task, policy, value, calib_recs, dense: bool = False) -> dict:
    """The task at one operating point: accuracy (or bits per byte) per half, paired against dense
    item by item, and per item whether dense was right and the policy wrong (``flips``)."""
    if dense:
        exits_of = lambda rec: _dense_exits(rec)  # noqa: E731
    elif policy is None:
        exits_of = lambda rec: oracle_exits(rec)  # noqa: E731
    else:
        thr = layer_thresholds(policy, value, calib_recs) if policy.kind == "specee" else value
        exits_of = lambda rec: replay(rec, policy, thr)  # noqa: E731
    out = {"value": value}
    for half in ("calibration", "test"):
        items = [i for i in task["items"] if (i["doc_id"] in task["calibration_ids"]) == (half == "calibration")]
        vals, layers, pairs = [], [], []
        for it in items:
            v, lay, pair = _item_value(task, it, exits_of)
            vals.append(v)
            layers.append(lay)
            if pair is not None:
                pairs.append(pair)
        row = {"n": len(items), "avg_layers": float(np.nanmean(layers)) if layers else float("nan")}
        if task["rolling"]:
            ll = sum(float(p[0]) for p in pairs)
            nbytes = sum(float(p[1]) for p in pairs)
            row["bits_per_byte"] = -ll / max(nbytes, 1.0) / math.log(2)
            row["per_item"] = vals
        else:
            row["accuracy"] = float(np.mean(vals)) if vals else float("nan")
            row["per_item"] = vals
        if not dense and "dense" in task:
            ref = task["dense"][half]["per_item"]
            d = np.asarray(vals) - np.asarray(ref)
            scale = 1.0 if task["rolling"] else 100.0
            half_w = 1.96 * d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
            row["delta"] = float(d.mean() * scale)
            row["delta_ci"] = [float((d.mean() - half_w) * scale), float((d.mean() + half_w) * scale)]
            if task["rolling"]:
                row["delta_bits_per_byte"] = row["bits_per_byte"] - task["dense"][half]["bits_per_byte"]
            else:
                row["flips"] = [int(r > 0.5 and v < 0.5) for r, v in zip(ref, vals)]
                row["changed"] = int(np.sum(np.asarray(vals) != np.asarray(ref)))
        out[half] = row
    return out


def _dense_exits(rec):
    from specee.frontier.replay import Exits
    T, L = rec.argmax.shape
    z = np.zeros(T, dtype=np.int64)
    return Exits(np.full(T, L - 1), rec.final, z, z, z, L - 1)
