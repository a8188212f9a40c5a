"""Task quality at every operating point, from one recorded pass through lm-eval, and the real
decoder's item loss where a point is certified.

lm-eval builds each task's requests — shipped tasks, the user's own YAMLs under
``experiment.include_path``, or lm-eval's registry — and scores dense once (:class:`RecordingLM`, the
harness's lm-eval model, answering as dense while it records every layer of every request: each
scored continuation, and each generation teacher-forced on dense's own tokens). An operating point's
answers are then replayed from the records and scored by the task's own filters and
``process_results``, item by item: exactly for log-likelihood requests (teacher-forced by
construction); as a screen for generations (an item counts as lost where dense answered right and
any replayed token differs, since the text past a difference is unknown). :func:`certify_task` then
runs Learn-then-Test on the *real* decoder's answers, scored the same way, item by item.
"""
from __future__ import annotations

import math
import os
import random

import numpy as np
from lm_eval import utils as lm_utils
from tqdm import tqdm

from specee.decoding.dense import DenseDecoder
from specee.errors import SpeceeError
from specee.evaluation import registry
from specee.evaluation.answer_figures import task_labels
from specee.evaluation.lm import SpeceeLM
from specee.frontier import certify
from specee.frontier.record import record_continuations, record_generation
from specee.frontier.replay import Exits, knob_thresholds, oracle_exits, replay
from specee.io import project_path


class RecordingLM(SpeceeLM):
    """lm-eval model answering as dense while recording every layer of every request."""

    GROUP = 8  # requests recorded together at most (their layer logits are held until the draft runs)

    def __init__(self, rt, tokenizer, parts: dict, k: int, max_gen_toks: int = 128, max_length=None):
        super().__init__(DenseDecoder(rt), tokenizer, max_gen_toks=max_gen_toks, max_length=max_length,
                         prefix_reuse=False)
        self.parts, self.k = parts, k
        self.recorded: dict[tuple, list] = {}
        self.requests: dict[tuple, tuple] = {}  # each request's arguments: the real decoder answers the same

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
                    key = (req.task_name, req.doc_id, req.idx)
                    self.recorded[key], self.requests[key] = [rec], req.args
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
            key = (req.task_name, req.doc_id, req.idx)
            self.recorded[key], self.requests[key] = recs, req.args
            out.append(float(sum(r.logp[:, -1].sum() for r in recs)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        """Dense's generation (the task's stop sequences and length), then its steps teacher-forced."""
        out = []
        for req in tqdm(requests, desc="record generate_until", disable=disable_tqdm):
            out += self._generate_until([req], True)
            ctx, gen = self.last_generation
            rec = record_generation(self.rt, self.parts["draft"], self.parts["banks"], self.k, self._ids(ctx),
                                    gen.tokens, self.parts.get("svm"), self.parts.get("crf"), self.parts.get("rules"))
            key = (req.task_name, req.doc_id, req.idx)
            self.recorded[key], self.requests[key] = ([rec] if rec is not None else []), req.args
        return out


def _exact_ci(k: int, n: int) -> tuple[float, float]:
    from scipy.stats import beta
    lo = 0.0 if k == 0 else float(beta.ppf(0.025, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(0.975, k + 1, n - k))
    return lo, hi


SETTINGS = ("output_type", "num_fewshot", "target_delimiter", "fewshot_delimiter", "filter_list", "metric_list",
            "generation_kwargs", "repeats", "description")


def task_settings(obj) -> dict:
    """The task's own settings as lm-eval ran them (shots, delimiters, filters, metrics, generation)."""
    conf = obj.config.to_dict() if hasattr(obj.config, "to_dict") else dict(vars(obj.config))
    return {k: conf.get(k) for k in SETTINGS if conf.get(k) is not None}


def record_tasks(cfg, rt, tokenizer, parts: dict, out) -> dict:
    """Per task: its items (requests, records, dense's score), lm-eval's task object, its settings,
    the halves and whether dense is above chance."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import get_task_dict
    e = cfg.experiment
    names = list(e.tasks)
    if e.task_source == "shipped":
        os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")  # local files only
    os.environ.setdefault("HF_DATASETS_CACHE", str(out / "hf_datasets_cache"))
    include = project_path(e.include_path) if e.include_path else None
    tm = registry.task_manager(names, project_path(cfg.paths.data_root), out / "lm_eval_tasks", include, e.task_source)
    objs = get_task_dict(names, tm)
    missing = [n for n in names if n not in objs]
    if missing:
        raise SpeceeError(f"experiment.tasks: {missing} name task groups, not tasks; name their tasks one by one")
    lm = RecordingLM(rt, tokenizer, parts, cfg.early_exit.k, e.max_gen_tokens)
    res = {"results": {}, "samples": {}}
    # whole documents (perplexity-like: every token a decision) take their own, smaller limit
    docs = [n for n in names if objs[n].OUTPUT_TYPE == "loglikelihood_rolling"]
    for group, limit in (([n for n in names if n not in docs], e.task_limit), (docs, e.document_limit)):
        if not group:
            continue
        r = simple_evaluate(model=lm, tasks=group, task_manager=tm, limit=limit, log_samples=True,
                            random_seed=cfg.seed, numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed,
                            fewshot_random_seed=cfg.seed)
        res["results"].update(r["results"])
        res["samples"].update(r["samples"])
    tasks = {}
    for name in names:
        primary_key = registry.primary_metric(name, res["results"][name], e.task_source)
        primary, _, filt = primary_key.partition(",")
        filt = filt or "none"
        lower = registry.lower_is_better(name, primary, e.task_source)
        obj = objs[name]
        items = []
        for s in res["samples"][name]:
            if s.get("filter", "none") != filt:  # one entry per filter: the primary metric's
                continue
            keys = [(name, s["doc_id"], i) for i in range(len(s["arguments"]))]
            items.append({"doc_id": s["doc_id"], "doc": s["doc"], "records": [lm.recorded[k] for k in keys],
                          "requests": [lm.requests[k] for k in keys],
                          "dense": float(s[primary]) if not isinstance(s[primary], (list, tuple)) else None})
        ids = sorted(i["doc_id"] for i in items)
        rng = random.Random(cfg.seed)
        rng.shuffle(ids)
        calib = set(ids[: int(len(ids) * e.calibration_share)])
        source = ("shipped" if e.task_source == "shipped" and name in registry.available() else
                  "experiment.include_path" if include is not None and name not in registry.available() else e.task_source)
        task = {"name": name, "primary": primary, "filter": filt, "lower_is_better": lower, "task": obj,
                "output_type": obj.OUTPUT_TYPE, "settings": task_settings(obj), "source": source,
                "items": items, "calibration_ids": calib, "n": len(items), "rolling": lower}
        if not task["rolling"]:  # the real answers are scored as lm-eval scored dense's: checked on dense's
            task["scoring_checked"] = check_scoring(task, res["samples"][name])
        task["dense"] = task_point(task, None, None, None, dense=True)
        if task["rolling"]:
            task["testable"], task["chance"] = False, None
            task["why_not_testable"] = "a perplexity-like metric: reported as a change, no accuracy budget"
        else:
            chance = chance_of(task)
            k = int(round(sum(i["dense"] for i in items)))
            lo, hi = _exact_ci(k, len(items))
            task.update({"chance": chance, "dense_ci": [lo, hi], "testable": bool(lo > chance)})
            if not task["testable"]:
                task["why_not_testable"] = (f"dense at chance: {100 * k / len(items):.1f} % "
                                            f"[{100 * lo:.1f}, {100 * hi:.1f}] against {100 * chance:.1f} %")
        tasks[name] = task
    return tasks


def chance_of(task: dict) -> float:
    """What guessing scores: a multiple-choice item's 1 / choices; for a generative task what
    experiment=accuracy takes (:func:`~specee.evaluation.answer_figures.task_labels`: the declared
    ``metadata.chance``, else 1 / its label set), else 0 (free-form answers)."""
    if task["output_type"] == "generate_until":
        return task_labels(task["task"])["chance"] or 0.0
    return float(np.mean([1 / max(len(i["records"]), 1) for i in task["items"]]))


def check_scoring(task: dict, samples: list[dict]) -> int:
    """:func:`score_item` on dense's own answers (lm-eval's logged responses) gives lm-eval's score
    for every item; a difference is a harness bug, stopped here rather than certified. Returns the
    number of items checked."""
    by_doc = {s["doc_id"]: s for s in samples if s.get("filter", "none") == task["filter"]}
    for item in task["items"]:
        answers = [r[0] for r in by_doc[item["doc_id"]]["resps"]]
        if task["output_type"] != "generate_until":
            answers = [tuple(a) for a in answers]
        got = score_item(task, item, answers)
        if got != item["dense"]:
            raise SpeceeError(f"task {task['name']}: item {item['doc_id']} scores {got} here and {item['dense']} "
                              "in lm-eval; this task's scoring cannot be reproduced item by item, so it cannot be certified")
    return len(task["items"])


def score_item(task: dict, item: dict, answers: list) -> float:
    """One item's primary metric from its requests' raw answers, as lm-eval's evaluator scores it:
    the task's filter ensembles, then its ``process_results`` on the primary metric's filter."""
    from lm_eval.api.instance import Instance
    insts = [Instance(request_type=task["output_type"], doc=item["doc"], arguments=args, idx=i, resps=[a],
                      metadata=(task["name"], item["doc_id"], 1))
             for i, (args, a) in enumerate(zip(item["requests"], answers))]
    for ensemble in getattr(task["task"], "_filters", []):
        ensemble.apply(insts)
    out = task["task"].process_results(item["doc"], [inst.filtered_resps.get(task["filter"], inst.resps[0])
                                                     for inst in insts])
    return float(out[task["primary"]])


def _item_value(task, item, exits_of) -> tuple[float, float, object, bool]:
    """(metric value, mean layers, (log-likelihood, bytes) for a document, whether any request exits)
    of one item with each request's exits from ``exits_of``. A generation's value is dense's where
    every replayed token is dense's, else 0 (its text past the first difference is unknown)."""
    answers, layers, exits, changed = [], [], False, False
    for recs in item["records"]:
        ll, greedy = 0.0, True
        for rec in recs:
            ex = exits_of(rec)
            t = np.arange(rec.steps)
            ll += float(rec.logp[t, ex.layer].sum())
            greedy &= bool((rec.argmax[t, ex.layer] == rec.targets).all())
            changed |= bool((ex.token != rec.final).any())
            exits |= certify.exits_at_all(rec, ex)
            layers += (ex.layer + 1).tolist()
        answers.append(ll if task["rolling"] else (ll, greedy))
    mean_layers = float(np.mean(layers)) if layers else float("nan")
    if task["output_type"] == "generate_until":
        return (item["dense"] if not changed else 0.0), mean_layers, None, exits
    if task["rolling"]:  # (log-likelihood, bytes): this item's bits per byte
        pair = task["task"].process_results(item["doc"], answers)[task["primary"]]
        return -float(pair[0]) / max(float(pair[1]), 1.0) / math.log(2), mean_layers, pair, exits
    return score_item(task, item, answers), mean_layers, None, exits


def task_point(task, policy, value, calib_recs, dense: bool = False) -> dict:
    """The task at one operating point (replayed): accuracy (or bits per byte) per half, paired against
    dense item by item, per item whether dense was right and the policy wrong (``flips``) and whether
    replay exits at all (``exits``: where it does not, the real decoder answers as dense)."""
    if dense:
        exits_of = lambda rec: _dense_exits(rec)  # noqa: E731
    elif policy is None:
        exits_of = lambda rec: oracle_exits(rec)  # noqa: E731
    else:
        thr = knob_thresholds(policy, value, calib_recs)
        exits_of = lambda rec: replay(rec, policy, thr)  # noqa: E731
    out = {"value": value}
    for half, items in halves(task).items():
        vals, layers, pairs, exits = [], [], [], []
        for it in items:
            v, lay, pair, ex = _item_value(task, it, exits_of)
            vals.append(v)
            layers.append(lay)
            exits.append(ex)
            if pair is not None:
                pairs.append(pair)
        row = {"n": len(items), "avg_layers": float(np.nanmean(layers)) if layers else float("nan"), "exits": exits}
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


def halves(task: dict) -> dict[str, list]:
    return {h: [i for i in task["items"] if (i["doc_id"] in task["calibration_ids"]) == (h == "calibration")]
            for h in ("calibration", "test")}


def real_answers(lm, task: dict, item: dict) -> list:
    """The item's requests answered by ``lm``'s decoder (as lm-eval would ask them)."""
    from lm_eval.api.instance import Instance
    reqs = [Instance(request_type=task["output_type"], doc=item["doc"], arguments=args, idx=i,
                     metadata=(task["name"], item["doc_id"], 1)) for i, args in enumerate(item["requests"])]
    if task["output_type"] == "generate_until":
        return lm.generate_until(reqs, disable_tqdm=True)
    return lm.loglikelihood(reqs, disable_tqdm=True)


def certify_task(task: dict, pol, decoder, lm, rows: list[dict], kv_order: list[str], num_layers: int,
                 delta: float, epsilon: float) -> dict:
    """Learn-then-Test on the real decoder's answers (:func:`~specee.frontier.certify.certify_grid`): an
    item's loss is 1 where dense answers right and the real decoder, at the point, wrong — scored by the
    task's own filters and metric; exact binomial. ``rows``: the task's points with the generation
    frontier's modelled speedups and the policy's fitted thresholds at the same knob values."""
    from specee.decoding.operating_point import set_point
    items = halves(task)

    def real(j, kv, half, u):
        set_point(decoder, pol.kind, rows[j]["value"], pol.per_layer, rows[j]["thresholds"], kv)
        item = items[half][u]
        v = score_item(task, item, real_answers(lm, task, item))
        recs = [lm.records[(task["name"], item["doc_id"], i)] for i in range(len(item["requests"]))]
        steps = sum(r["tokens"] for r in recs)
        layers = sum(r["mean_layers"] * r["tokens"] for r in recs)
        return {"loss": float(item["dense"] > 0.5 and v < 0.5), "identical": v == item["dense"],
                "exited": layers < steps * num_layers - 1e-9, "steps": steps, "layers": layers}

    def dense(half, u):
        steps = sum(rec.steps for recs in items[half][u]["records"] for rec in recs)
        return {"loss": 0.0, "identical": True, "exited": False, "steps": steps, "layers": steps * num_layers}

    return certify.certify_grid(rows, pol.knob, kv_order, len(items["calibration"]), len(items["test"]), real,
                                lambda j, half, u: rows[j][half]["exits"][u], dense, delta, epsilon, "binomial",
                                "item", f"certify {pol.name} on {task['name']} (real answers)")


def _dense_exits(rec):
    T, L = rec.argmax.shape
    z = np.zeros(T, dtype=np.int64)
    return Exits(np.full(T, L - 1), rec.final, z, z, z, L - 1)
