"""Recipe: speed at a loss budget — each exit policy's speed–quality frontier, the oracle's, and
an operating point calibrated with a guarantee (Learn-then-Test).

    python run.py experiment=frontier model=tiny

1. Prompts (the dataset group) split into calibration and test (``experiment.calibration_share``);
   dense greedy output for each.
2. One teacher-forced pass per prompt (and per lm-eval request, ``experiment.tasks``) records what
   every policy would see at every layer (specee/frontier/record.py).
3. Each policy's grid of operating points is replayed from the records (specee/frontier/replay.py):
   layers, token disagreement, sequence identity, task accuracy and bits/byte, and the speedup the
   cost model gives for the replayed work with unit costs measured here.
4. Per policy, the fastest point whose *real decoder's* loss is <= delta with probability
   >= 1 - epsilon (Learn-then-Test on real runs over the calibration prompts, each point under each
   K/V policy, conservative first, stopping at the first point not certified:
   specee/frontier/certify.py); its real loss on the held-out test prompts. A fitted policy (the
   tuned bank) is fitted on its own share of the calibration prompts, which its test never sees.
5. Real runs, timed beside dense step by step on a stratified sample of the test prompts, at several
   points per policy (the certified one included), at tree SpecEE's points (not replayable) and for
   the lossless peers: measured speedup with its paired interval, and replay against reality.
6. The verdict per policy (specee/frontier/pages.py): confirmed (certified, measured faster),
   refuted (every point whose speed could reach 1x loses more than delta, jointly bounded), else
   inconclusive, saying which side is short.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from specee import ablations, results
from specee.cost_model import priced_work as cm
from specee.bench.inputs import generation_eos, load_prompts
from specee.bench.speed import match_rate, paired_speedup_ci, time_sides
from specee.builders import build_decoder
from specee.decoding import modes
from specee.decoding.dense import DenseDecoder
from specee.errors import SpeceeError
from specee.evaluation.lm import SpeceeLM
from specee.frontier import calibrate, certify, pages
from specee.frontier.policies import build_policies, policy_config, set_operating_point
from specee.frontier.record import record_generation
from specee.frontier.replay import (as_generations, generation_metrics, knob_thresholds, oracle_exits,
                                    oracle_orders, replay)
from specee.frontier.tasks import certify_task, record_tasks, task_point
from specee.io import project_path
from specee.models.loader import load_model
from specee.prompts import PromptEncoder
from specee.runtime.build import build_runtime


def split(prompts: list[dict], seed: int, share: float = 0.5) -> tuple[list[dict], list[dict]]:
    """Calibration and test splits, seeded, ``share`` of the prompts in calibration, each split keeping
    every category's share."""
    rng = random.Random(seed)
    by_cat: dict = {}
    for p in prompts:
        by_cat.setdefault(p["category"], []).append(p)
    calib, test = [], []
    # one running count across categories, so even one prompt per category splits at the share; a
    # prompt goes to calibration when it lifts ceil(share * count) (at 0.5: every other prompt)
    turn = 0
    for cat in sorted(by_cat):
        ps = by_cat[cat][:]
        rng.shuffle(ps)
        for p in ps:
            (calib if math.ceil((turn + 1) * share) > math.ceil(turn * share) else test).append(p)
            turn += 1
    return calib, test


def stratified_sample(prompts: list[dict], k: int, seed: int) -> list[dict]:
    """A seeded sample of ``k`` prompts (at least one per category) taken round-robin over the
    categories in a seeded order, each category's prompts shuffled: every category is timed, none
    twice before each has been once."""
    rng = random.Random(seed + 1)
    by_cat: dict = {}
    for p in prompts:
        by_cat.setdefault(p["category"], []).append(p)
    cats = sorted(by_cat)
    rng.shuffle(cats)
    for c in cats:
        rng.shuffle(by_cat[c])
    k = min(max(k, len(cats)), len(prompts))
    out, depth = [], 0
    while len(out) < k:
        for c in cats:
            if depth < len(by_cat[c]) and len(out) < k:
                out.append(by_cat[c][depth])
        depth += 1
    return out


def fit_split(units: list, share: float, seed: int) -> tuple[set, set]:
    """The ids a fitted policy is fitted on and the ids its Learn-then-Test uses: disjoint, seeded,
    ``share`` of the calibration prompts (at least one) for fitting."""
    ids = sorted(u.id for u in units)
    random.Random(seed + 2).shuffle(ids)
    n_fit = min(max(1, round(share * len(ids))), len(ids) - 1)
    return set(ids[:n_fit]), set(ids[n_fit:])


def modelled(counts_fn, gens, dense_counts, units) -> dict:
    m = cm.modelled_speedup(counts_fn(gens), dense_counts, units)
    return {"modelled_speedup": m["value"], "modelled_band": m["band"]}


def evaluate_point(policy, value, fit_recs, calib_recs, test_recs, units, dense_counts, L) -> dict:
    """One operating point replayed on both halves. A fitted policy's thresholds come from
    ``fit_recs`` only; ``calib_recs`` are the units its calibration reads (never the fitted ones)."""
    thr = knob_thresholds(policy, value, fit_recs)
    row = {"policy": policy.name, "label": policy.label, "knob": policy.knob, "value": value}
    mode = policy.mode
    for half, recs in (("calibration", calib_recs), ("test", test_recs)):
        ex = [replay(r, policy, thr) for r in recs]
        g = generation_metrics(recs, ex)
        gens = as_generations(ex, policy)
        row[half] = {**{k: v for k, v in g.items()},
                     "first_exit_wrong": [certify.first_exit_wrong(r, x) for r, x in zip(recs, ex)],
                     "exits": [certify.exits_at_all(r, x) for r, x in zip(recs, ex)],
                     **modelled(lambda gs: cm.count_work(gs, L, mode), gens, dense_counts, units)}
    row["thresholds"] = thr.tolist() if hasattr(thr, "tolist") else thr
    return row


def oracle_curve(test_recs, budgets, units, dense_counts, L) -> list[dict]:
    out = []
    for b in budgets:
        orders = oracle_orders(test_recs, b)
        ex = [oracle_exits(r, o) for r, o in zip(test_recs, orders)]
        g = generation_metrics(test_recs, ex)
        counts = dict(dense_counts)
        counts["layer_steps"] = counts["avg_layers"] = g["avg_layers"]
        m = cm.modelled_speedup(counts, dense_counts, units)
        out.append({"budget": b, **{k: v for k, v in g.items() if k != "per_request_loss"},
                    "modelled_speedup": m["value"], "modelled_band": m["band"]})
    return out


def calibrate_policy(rows: list[dict], delta: float, epsilon: float, bound: str, loss_of) -> dict:
    """LTT over a policy's grid (ordered conservative -> fast) on *replayed* losses: the screen that
    says where to look (and a task's item flips), not the guarantee on real decoding."""
    losses = [np.asarray(loss_of(r, "calibration")) for r in rows]
    lt = calibrate.fixed_sequence(losses, delta, epsilon, bound)
    n = len(losses[0]) if losses else 0
    out = {"delta": delta, "epsilon": epsilon, "bound": bound, "calibration_units": n, "on": "replay",
           "units_needed_at_zero_loss": calibrate.min_units(delta, epsilon, bound),
           "p_values": lt["p_values"], "certified_points": lt["certified"], "chosen": None}
    if not lt["certified"]:
        first = losses[0] if losses else np.zeros(0)
        out.update({"first_point_loss": float(first.mean()) if len(first) else None})
        out["why_none"] = (f"no point passes: {n} calibration units, and a loss of 0 needs "
                           f"{out['units_needed_at_zero_loss']}" if n < out["units_needed_at_zero_loss"] else
                           f"no point passes: the most conservative point's replayed loss is "
                           f"{out['first_point_loss']:.4f} (p = {lt['p_values'][0]:.3g} > {epsilon:g})")
        return out
    best = max(range(lt["certified"]), key=lambda j: rows[j]["calibration"]["modelled_speedup"])
    r = rows[best]
    test = np.asarray(loss_of(r, "test"), dtype=np.float64)
    lo, hi = calibrate.interval(test, epsilon, bound)
    out.update({"chosen": best, "value": r["value"],
                "calibration_loss": float(np.mean(losses[best])),
                "calibration_bound": calibrate.upper_bound(losses[best], epsilon, bound),
                "test_loss": float(test.mean()), "test_interval": [lo, hi],
                "held_out_within_budget": bool(test.mean() <= delta),
                "modelled_speedup": r["test"]["modelled_speedup"], "avg_layers": r["test"]["avg_layers"]})
    return out


def certify_real(pol, decoder, rt, curve: list[dict], kv_order: list[str], calib_units: list, test_units: list,
                 n_new: int, eos, delta: float, epsilon: float) -> dict:
    """Learn-then-Test on the real decoder over the prompts (specee/frontier/certify.py
    :func:`~specee.frontier.certify.certify_grid`): a prompt's loss is its own-context disagreement."""
    units = {"calibration": calib_units, "test": test_units}

    def real(j, kv, half, u):
        set_operating_point(decoder, pol, curve[j]["value"], curve[j]["thresholds"], kv)
        g = decoder.generate(units[half][u].ids, n_new, eos)
        return certify.own_context_loss(rt, units[half][u], g.tokens, g.layers_run)

    return certify.certify_grid(curve, pol.knob, kv_order, len(calib_units), len(test_units), real,
                                lambda j, half, u: curve[j][half]["exits"][u],
                                lambda half, u: certify.dense_result(rt, units[half][u]),
                                delta, epsilon, "hoeffding_bentkus", "prompt", f"certify {pol.name} on real runs")


def refute_policy(curve: list[dict], measured: list[dict], delta: float, epsilon: float, n_new: int) -> dict:
    """The sound refutation (specee/frontier/certify.py): a point is fast when its speed could reach
    1x — the upper end of its modelled band (under ``holes``, which does less work than ``propagate``, so
    it bounds both) or of its measured interval."""
    meas = {p["index"]: p for p in measured}
    pts = [{"index": j, "value": r["value"],
            "fast": bool(max(r["calibration"]["modelled_band"][1], r["test"]["modelled_band"][1]) >= 1.0
                         or (j in meas and meas[j]["speedup_ci"][1] >= 1.0)),
            "first_exit_wrong": r["calibration"]["first_exit_wrong"]} for j, r in enumerate(curve)]
    return certify.refutation(pts, delta, epsilon, n_new)


def timed(rt, dense, decoder, units: list, n_new, eos, seed) -> dict:
    """The decoder beside dense, step by step in turn on every timed prompt: measured speedup with
    its paired interval, real layers, sequence identity and the loss at its own context (the mean
    over prompts of the share of tokens the full stack would not emit there)."""
    rows, gens, dgens, losses = [], [], [], []
    for slot, u in enumerate(units):
        out = time_sides({"dense": dense, "mode": decoder}, u.ids, n_new, eos, "step", slot, seed)
        g, d = out["mode"], out["dense"]
        gens.append(g)
        dgens.append(d)
        rows.append({"id": u.id, "tokens": len(g.tokens), "decode_s": g.decode_s,
                     "dense_tokens": len(d.tokens), "dense_decode_s": d.decode_s})
        losses.append(certify.own_context_loss(rt, certify.Unit(u.id, u.ids, d.tokens), g.tokens, g.layers_run)["loss"])
    tok = sum(len(g.tokens) - 1 for g in gens)
    dtok = sum(len(d.tokens) - 1 for d in dgens)
    speed = (tok / sum(g.decode_s for g in gens)) / (dtok / sum(d.decode_s for d in dgens))
    layers = [x for g in gens for x in g.layers_run[1:]]
    return {"speedup": speed, "speedup_ci": paired_speedup_ci(rows, seed=seed),
            "avg_layers": sum(layers) / max(len(layers), 1),
            "sequence_identity": sum(g.tokens == d.tokens for g, d in zip(gens, dgens)) / max(len(gens), 1),
            "token_match_vs_dense": match_rate([d.tokens for d in dgens], [g.tokens for g in gens]),
            "own_context_disagreement": float(np.mean(losses)) if losses else 0.0}


def measured_indices(n: int, k: int, chosen: set) -> list[int]:
    """k grid points spread over the grid, the calibrated ones among them."""
    picks = {round(i * (n - 1) / max(k - 1, 1)) for i in range(k)} if k > 0 else set()
    return sorted(picks | set(chosen))


def calibrate_task(task: dict, pol, curves: dict, delta: float, epsilon: float) -> dict:
    """LTT on a task's items: loss 1 where dense answers right and the policy wrong (exact binomial);
    the point's speed is the generation frontier's at the same knob value."""
    rows = [{**p, "calibration": {**p["calibration"], "modelled_speedup": c["calibration"]["modelled_speedup"]},
             "test": {**p["test"], "modelled_speedup": c["test"]["modelled_speedup"]}}
            for p, c in zip(task["points"][pol.name], curves[pol.name])]
    return calibrate_policy(rows, delta, epsilon, "binomial", lambda r, half: r[half]["flips"])


def on_reuse(cfg, done: dict) -> dict:
    """A reused frontier result (specee/launch.py skips the run) still writes its report."""
    pages.write_report(done, project_path(cfg.experiment.report_dir or f"reports/frontier_{cfg.model.name}"))
    return done["metrics"]


@dataclass
class FrontierJob:
    """What every phase of the recipe reads, built once."""
    cfg: Any
    rt: Any
    tokenizer: Any
    dense: Any
    eos: Any
    encode: Any
    policies: list
    parts: dict

    @property
    def n_new(self) -> int:
        return self.cfg.dataset.max_new_tokens

    @property
    def L(self) -> int:
        return self.rt.num_layers


def record_prompts(job: FrontierJob, ps: list[dict], desc: str) -> tuple[list, list]:
    """Dense's greedy output per prompt, then its teacher-forced record (every policy's view)."""
    recs, units = [], []
    for p in tqdm(ps, desc=desc):
        ids = job.encode(p["text"], p["id"])
        gen = job.dense.generate(ids, job.n_new, job.eos)
        r = record_generation(job.rt, job.parts["draft"], job.parts["banks"], job.cfg.early_exit.k, ids, gen.tokens,
                              job.parts.get("svm"), job.parts.get("crf"), job.parts["rules"])
        if r is not None:
            recs.append(r)
            units.append(certify.Unit(p["id"], ids, gen.tokens, p["category"]))
    return recs, units


def price_units(job: FrontierJob, ids) -> tuple[dict, dict]:
    """Unit costs measured here, interleaved (shared ones, and each exit rule's decision apart)."""
    e, rt, parts = job.cfg.experiment, job.rt, job.parts
    print("measuring unit costs (interleaved rounds)")
    units = cm.measure_unit_costs(rt, parts["unit_decoder"], job.dense, ids, job.n_new, rounds=e.cost_rounds)
    if parts.get("ada_decoder") is not None:
        ada = cm.measure_unit_costs(rt, parts["ada_decoder"], job.dense, ids, job.n_new, rounds=e.cost_rounds)
        units["samples_us"]["adainfer_probe"] = ada["samples_us"]["adainfer_probe"]
    of_policy = {p.name: units for p in job.policies}
    for name, rdec in parts["rule_decoders"].items():  # each rule's decision has its own price
        ru = cm.measure_unit_costs(rt, rdec, job.dense, ids, job.n_new, rounds=e.cost_rounds)
        of_policy[name] = {**units, "samples_us": {**units["samples_us"], "rule_probe": ru["samples_us"]["rule_probe"]}}
    return units, of_policy


def certify_policies(job: FrontierJob, curves: dict, calib_of: dict, test_units: list) -> tuple[dict, dict, dict]:
    """Per policy: its real decoder, its K/V order (the ablation's own first: on a tie it is the one
    chosen, and the one timed) and its certification on real runs."""
    e = job.cfg.experiment
    calibration, decoders, kv_orders = {}, {}, {}
    for pol in job.policies:
        pcfg = policy_config(job.cfg, pol.name)
        decoders[pol.name] = dec = build_decoder(pcfg, job.rt)
        kv_orders[pol.name] = kv_order = sorted(e.kv_policies, key=lambda k: k != pcfg.early_exit.kv_policy)
        calibration[pol.name] = c = certify_real(pol, dec, job.rt, curves[pol.name], kv_order, calib_of[pol.name],
                                                 test_units, job.n_new, job.eos, e.delta, e.epsilon)
        print(f"  {pol.name}: " + (f"certified {pol.knob} = {c['value']:g} ({c['kv_policy']}), held-out real loss "
                                   f"{c['test_loss']:.4f}" if c["chosen"] is not None else c["why_none"]))
    return calibration, decoders, kv_orders


def task_frontiers(job: FrontierJob, out, fit_recs, curves: dict, decoders: dict, kv_orders: dict, deltas) -> dict:
    """Each task recorded through lm-eval, replayed at every point, screened at every budget and
    certified on the real decoder's answers at delta."""
    e = job.cfg.experiment
    tasks = record_tasks(job.cfg, job.rt, job.tokenizer, job.parts, out)
    for task in tasks.values():
        task["points"] = {pol.name: [task_point(task, pol, v, fit_recs) for v in pol.grid] for pol in job.policies}
        task["oracle"] = task_point(task, None, 0.0, None)
        if not task["testable"]:
            continue
        task["calibration_at"] = {str(d): {pol.name: calibrate_task(task, pol, curves, d, e.epsilon)
                                           for pol in job.policies} for d in deltas}
        task["calibration"] = {}
        for pol in job.policies:
            rows = [{**p, "thresholds": c["thresholds"],
                     "calibration": {**p["calibration"], "modelled_speedup": c["calibration"]["modelled_speedup"]},
                     "test": {**p["test"], "modelled_speedup": c["test"]["modelled_speedup"]}}
                    for p, c in zip(task["points"][pol.name], curves[pol.name])]
            lm = SpeceeLM(decoders[pol.name], job.tokenizer, e.max_gen_tokens, prefix_reuse=False)
            task["calibration"][pol.name] = c = certify_task(task, pol, decoders[pol.name], lm, rows,
                                                             kv_orders[pol.name], job.L, e.delta, e.epsilon)
            print(f"  {task['name']} / {pol.name}: " + (
                f"certified {pol.knob} = {c['value']:g} ({c['kv_policy']}), held-out real flips "
                f"{c['test_loss']:.4f}" if c["chosen"] is not None else c["why_none"]))
    return tasks


def measure(job: FrontierJob, timed_units: list, curves: dict, calibration: dict, screen_at: dict, tasks: dict,
            decoders: dict, kv_orders: dict) -> tuple[dict, dict]:
    """Real runs beside dense on the timed prompts: each replayed policy at spread and chosen points
    (under each K/V policy a chosen point was certified with), tree SpecEE at its grid, the peers."""
    e, rt, dense, n_new, eos, seed = job.cfg.experiment, job.rt, job.dense, job.n_new, job.eos, job.cfg.seed
    for u in timed_units[:1]:  # warm-up, untimed
        dense.generate(u.ids, min(8, n_new), eos)
    measured = {}
    for pol in tqdm(job.policies, desc="real runs"):
        decoder, own_kv = decoders[pol.name], kv_orders[pol.name][0]
        cals = [calibration[pol.name]] + [t["calibration"][pol.name] for t in tasks.values() if t.get("calibration")]
        chosen = {c[pol.name]["chosen"] for c in screen_at.values()}
        chosen |= {c[pol.name]["chosen"] for t in tasks.values() for c in t.get("calibration_at", {}).values()}
        chosen |= {c["chosen"] for c in cals}
        pts = []
        for j in measured_indices(len(pol.grid), e.measured_points, chosen - {None}):
            row = curves[pol.name][j]
            kvs = [own_kv] + sorted({c["kv_policy"] for c in cals if j == c["chosen"] and c["kv_policy"] != own_kv})
            for kv in kvs:
                set_operating_point(decoder, pol, row["value"], row["thresholds"], kv)
                pts.append({"index": j, "value": row["value"], "kv_policy": kv,
                            **timed(rt, dense, decoder, timed_units, n_new, eos, seed)})
        measured[pol.name] = pts
    for name in e.real_only:  # not replayable (tree SpecEE): measured at each grid value
        pcfg = policy_config(job.cfg, name)
        decoder = build_decoder(pcfg, rt)
        pts = []
        for v in tqdm(sorted(e.real_only_grid, reverse=True), desc=f"real runs {name}"):
            decoder.predictors.set_threshold(float(v))
            pts.append({"value": float(v), "kv_policy": pcfg.early_exit.kv_policy,
                        **timed(rt, dense, decoder, timed_units, n_new, eos, seed)})
        measured[name] = pts
    peers = {}
    for name in e.lossless_peers:
        pcfg = policy_config(job.cfg, name)
        decoder = build_decoder(pcfg, rt, eos_id=eos)
        peers[name] = {"label": ablations.of(pcfg.ablation).label, **timed(rt, dense, decoder, timed_units, n_new, eos, seed)}
    return measured, peers


def run(cfg) -> dict:
    e = cfg.experiment
    from omegaconf import open_dict
    with open_dict(cfg):  # the experiment's prompt count and length replace the dataset group's
        cfg.dataset.count, cfg.dataset.max_new_tokens = e.count, e.max_new_tokens
    out = results.output_dir()
    t_start = time.perf_counter()
    prompts = load_prompts(cfg)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    rt = build_runtime(cfg.runtime, model)
    policies, parts = build_policies(cfg, rt)
    job = FrontierJob(cfg, rt, tokenizer, DenseDecoder(rt), generation_eos(cfg, tokenizer),
                      PromptEncoder.for_runtime(tokenizer, rt, cfg.dataset.max_new_tokens), policies, parts)
    L, n_new = job.L, job.n_new
    held = parts["calibration_prompt_ids"]
    dropped = [p["id"] for p in prompts if p["id"] in held]
    prompts = [p for p in prompts if p["id"] not in held]
    if dropped:
        print(f"note: {len(dropped)} prompt(s) the predictors were trained on are left out")
    calib, test = split(prompts, cfg.seed, e.calibration_share)
    if len(calib) < 2 or len(test) < 2:
        raise SpeceeError(f"experiment=frontier needs at least 4 prompts (2 per split); {len(prompts)} are left "
                          "after the predictors' training prompts: raise experiment.count")

    t0 = time.perf_counter()
    calib_recs, calib_units = record_prompts(job, calib, "record calibration")
    test_recs, test_units = record_prompts(job, test, "record test")
    record_s = time.perf_counter() - t0
    # a fitted policy is fitted on its own share of the calibration prompts and tested on the rest
    fitted = any(p.per_layer for p in policies)
    fit_ids, ltt_ids = fit_split(calib_units, e.fit_share, cfg.seed) if fitted else (set(), {u.id for u in calib_units})
    fit_recs = [r for r, u in zip(calib_recs, calib_units) if u.id in fit_ids]
    ltt_of = {True: [i for i, u in enumerate(calib_units) if u.id in ltt_ids], False: list(range(len(calib_units)))}
    units_of = {p.name: [calib_units[i].id for i in ltt_of[p.per_layer]] for p in policies}
    units, units_of_policy = price_units(job, test_units[0].ids)
    dense_counts = cm.count_work([type("G", (), {"tokens": [0] * (n_new + 1), "trace": []})()], L,
                                 modes.reference().name)

    curves = {}
    for pol in tqdm(policies, desc="replay policies"):
        cr = [calib_recs[i] for i in ltt_of[pol.per_layer]]
        curves[pol.name] = [evaluate_point(pol, v, fit_recs, cr, test_recs, units_of_policy[pol.name], dense_counts, L)
                            for v in pol.grid]
    oracle = oracle_curve(test_recs, list(e.oracle_budgets), units, dense_counts, L)

    # the replay screen at every budget (no guarantee on real decoding), the real certification at delta
    gen_loss = lambda r, half: r[half]["per_request_loss"]  # noqa: E731
    deltas = [e.delta] + [d for d in e.extra_deltas if d != e.delta]
    screen_at = {str(d): {name: calibrate_policy(rows, d, e.epsilon, "hoeffding_bentkus", gen_loss)
                          for name, rows in curves.items()} for d in deltas}
    dense_ms = units["median_us"].get("dense_step", 0.0) / 1000
    worst = sum(len(ltt_of[p.per_layer]) for p in policies) * n_new
    print(f"certifying on real runs: at most {len(policies)} policies x their tested points x {len(e.kv_policies)} K/V "
          f"policies; each certified point decodes its calibration prompts once ({worst} tokens over all policies"
          f", about {worst * dense_ms / 1000 / 60:.1f} min at dense speed; a point that cannot pass stops early)")
    calibration, decoders, kv_orders = certify_policies(
        job, curves, {p.name: [calib_units[i] for i in ltt_of[p.per_layer]] for p in policies}, test_units)
    tasks = task_frontiers(job, out, fit_recs, curves, decoders, kv_orders, deltas) if e.tasks else {}

    by_id = {u.id: u for u in test_units}  # timed: a stratified sample of the test prompts
    timed_units = [by_id[p["id"]] for p in stratified_sample([p for p in test if p["id"] in by_id],
                                                             e.timed_prompts, cfg.seed)]
    measured, peers = measure(job, timed_units, curves, calibration, screen_at, tasks, decoders, kv_orders)

    refutations = {pol.name: refute_policy(curves[pol.name], measured[pol.name], e.delta, e.epsilon, n_new)
                   for pol in policies}
    agreement = pages.replay_vs_real(curves, measured)
    m = {"num_layers": L, "prompts": {"calibration": len(calib_recs), "test": len(test_recs),
                                      "timed": len(timed_units), "left_out_trained_on": dropped,
                                      "fit": len(fit_ids), "calibration_for_fitted": len(ltt_of[True]),
                                      "timed_categories": sorted({u.category for u in timed_units}),
                                      "test_categories": sorted({u.category for u in test_units})},
         "units": {"fit": sorted(fit_ids), "calibration": units_of, "test": [u.id for u in test_units],
                   "timed": [u.id for u in timed_units]},
         "max_new_tokens": n_new, "delta": e.delta, "epsilon": e.epsilon, "kv_policies": list(e.kv_policies),
         "loss": "mean over prompts of the share of a prompt's emitted tokens that the full stack, at the same "
                 "prefix, would not emit (real runs: the decoder's own context; replay: dense's)",
         "left_out": parts["left_out"],
         "policies": {p.name: {"label": p.label, "kind": p.kind, "knob": p.knob, "grid": list(p.grid),
                                "fitted": p.per_layer, "identity": p.identity}
                      for p in policies},
         "curves": curves, "oracle": oracle, "calibration": calibration, "screen_at": screen_at,
         "refutation": refutations, "measured": measured,
         "lossless_peers": peers, "replay_vs_real": agreement,
         "tasks": {k: {kk: vv for kk, vv in v.items() if kk not in ("task", "items", "calibration_ids")}
                   for k, v in tasks.items()},
         "unit_costs_us": units["median_us"], "record_s": record_s,
         "seconds": time.perf_counter() - t_start}
    m["verdicts"] = pages.verdicts(m, cfg.model.name, scope=pages.scope_line(cfg, L))
    path = results.save(out, cfg, m, {"replay_method": "teacher-forced under dense's trajectory; exact up to "
                                                       "each sequence's first exit",
                                      "certification": "Learn-then-Test on real decoding at the points tested"})
    print(f"wrote {path}")
    doc = results.read_results(path, "rerun experiment=frontier with force=true")
    pages.write_report(doc, project_path(e.report_dir or f"reports/frontier_{cfg.model.name}"))
    return m
