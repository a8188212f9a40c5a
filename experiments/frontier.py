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
4. Per policy, the fastest point whose loss is <= delta with probability >= 1 - epsilon on the
   calibration split (specee/frontier/calibrate.py), reported on the test split.
5. Real runs, timed beside dense step by step on the test prompts, at several points per policy
   (the calibrated one included), at tree SpecEE's points (not replayable) and for the lossless
   peers: measured speedup with its paired interval, and replay against reality.
"""
from __future__ import annotations

import math
import random
import time

import numpy as np
import torch
from tqdm import tqdm

from specee import ablations, results
from specee.bench import cost_model as cm
from specee.bench.inputs import generation_eos, load_prompts
from specee.bench.oracle import own_oracle
from specee.bench.speed import match_rate, paired_speedup_ci, time_sides
from specee.decoding import build_decoder, modes
from specee.decoding.dense import DenseDecoder
from specee.errors import SpeceeError
from specee.frontier import calibrate, pages
from specee.frontier.policies import build_policies, policy_config, set_operating_point
from specee.frontier.record import record_generation
from specee.frontier.replay import (as_generations, generation_metrics, layer_thresholds, oracle_exits,
                                    oracle_orders, replay)
from specee.frontier.tasks import record_tasks, task_point
from specee.io import project_path
from specee.models.loader import load_model
from specee.prompts import PromptEncoder
from specee.runtimes import build_runtime


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


def modelled(counts_fn, gens, dense_counts, units) -> dict:
    m = cm.modelled_speedup(counts_fn(gens), dense_counts, units)
    return {"modelled_speedup": m["value"], "modelled_band": m["band"]}


def evaluate_point(policy, value, calib_recs, test_recs, units, dense_counts, L) -> dict:
    """One operating point replayed on both halves."""
    thr = layer_thresholds(policy, value, calib_recs) if policy.kind == "specee" else value
    row = {"policy": policy.name, "label": policy.label, "knob": policy.knob, "value": value}
    mode = policy.mode
    for half, recs in (("calibration", calib_recs), ("test", test_recs)):
        ex = [replay(r, policy, thr) for r in recs]
        g = generation_metrics(recs, ex)
        gens = as_generations(ex, policy.kind)
        row[half] = {**{k: v for k, v in g.items()},
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
    """LTT over a policy's grid (ordered conservative -> fast); the fastest certified point."""
    losses = [np.asarray(loss_of(r, "calibration")) for r in rows]
    lt = calibrate.fixed_sequence(losses, delta, epsilon, bound)
    n = len(losses[0]) if losses else 0
    out = {"delta": delta, "epsilon": epsilon, "bound": bound, "calibration_units": n,
           "units_needed_at_zero_loss": calibrate.min_units(delta, epsilon, bound),
           "p_values": lt["p_values"], "certified_points": lt["certified"], "chosen": None}
    if not lt["certified"]:
        first = losses[0] if losses else np.zeros(0)
        # the most conservative point's loss, both ways: a lower bound above delta says no point of
        # this policy keeps the budget; below it, more calibration units could still certify one
        out.update({"first_point_loss": float(first.mean()) if len(first) else None,
                    "first_point_upper": calibrate.upper_bound(first, epsilon, bound),
                    "first_point_lower": calibrate.lower_bound(first, epsilon, bound)})
        out["why_none"] = (f"no point certified: the first point's loss bound is not below {delta:g} "
                           f"with {n} calibration units (certifying a loss of 0 needs "
                           f"{out['units_needed_at_zero_loss']})" if n < out["units_needed_at_zero_loss"] else
                           f"no point certified: the most conservative point's calibration loss "
                           f"{out['first_point_loss']:.4f} has a {1 - epsilon:g} bound of "
                           f"[{out['first_point_lower']:.4f}, {out['first_point_upper']:.4f}], "
                           f"{'all above' if out['first_point_lower'] > delta else 'not all below'} {delta:g}")
        return out
    best = max(range(lt["certified"]), key=lambda j: rows[j]["calibration"]["modelled_speedup"])
    r = rows[best]
    test_loss = float(np.mean(loss_of(r, "test")))
    out.update({"chosen": best, "value": r["value"],
                "calibration_loss": float(np.mean(losses[best])),
                "calibration_bound": calibrate.upper_bound(losses[best], epsilon, bound),
                "test_loss": test_loss, "guarantee_held": bool(test_loss <= delta),
                "modelled_speedup": r["test"]["modelled_speedup"], "avg_layers": r["test"]["avg_layers"]})
    return out


def timed(rt, dense, decoder, prompts_ids, n_new, eos, seed) -> dict:
    """The decoder beside dense, step by step in turn on every test prompt: measured speedup with
    its paired interval, real layers, sequence identity and token disagreement at its own context."""
    rows, gens, dgens = [], [], []
    for slot, (pid, ids) in enumerate(prompts_ids):
        out = time_sides({"dense": dense, "mode": decoder}, ids, n_new, eos, "step", slot, seed)
        g, d = out["mode"], out["dense"]
        gens.append(g)
        dgens.append(d)
        rows.append({"id": pid, "tokens": len(g.tokens), "decode_s": g.decode_s,
                     "dense_tokens": len(d.tokens), "dense_decode_s": d.decode_s})
    tok = sum(len(g.tokens) - 1 for g in gens)
    dtok = sum(len(d.tokens) - 1 for d in dgens)
    speed = (tok / sum(g.decode_s for g in gens)) / (dtok / sum(d.decode_s for d in dgens))
    layers = [x for g in gens for x in g.layers_run[1:]]
    wrong = total = 0
    for (pid, ids), g in zip(prompts_ids, gens):  # own context: the full stack's token there
        _, differs = own_oracle(rt, ids, g.tokens)
        wrong += sum(differs)
        total += len(differs)
    return {"speedup": speed, "speedup_ci": paired_speedup_ci(rows, seed=seed),
            "avg_layers": sum(layers) / max(len(layers), 1),
            "sequence_identity": sum(g.tokens == d.tokens for g, d in zip(gens, dgens)) / max(len(gens), 1),
            "token_match_vs_dense": match_rate([d.tokens for d in dgens], [g.tokens for g in gens]),
            "own_context_disagreement": wrong / max(total, 1)}


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


def run(cfg) -> dict:
    e = cfg.experiment
    from omegaconf import open_dict
    with open_dict(cfg):  # the experiment's prompt count and length replace the dataset group's
        cfg.dataset.count, cfg.dataset.max_new_tokens = e.count, e.max_new_tokens
    out = results.output_dir()
    if not cfg.force and (done := results.finished(out)):
        print(f"results exist, skipping (force=true reruns): {out / results.RESULTS}")
        pages.write_report(done, project_path(e.report_dir or f"reports/frontier_{cfg.model.name}"))
        return done["metrics"]
    t_start = time.perf_counter()
    prompts = load_prompts(cfg)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    rt = build_runtime(cfg.runtime, model)
    eos = generation_eos(cfg, tokenizer)
    L = rt.num_layers
    policies, parts = build_policies(cfg, rt)
    held = parts["calibration_prompt_ids"]
    dropped = [p["id"] for p in prompts if p["id"] in held]
    prompts = [p for p in prompts if p["id"] not in held]
    if dropped:
        print(f"note: {len(dropped)} prompt(s) the predictors were trained on are left out")
    calib, test = split(prompts, cfg.seed, e.calibration_share)
    if len(calib) < 2 or len(test) < 2:
        raise SpeceeError(f"experiment=frontier needs at least 4 prompts (2 per split); {len(prompts)} are left "
                          "after the predictors' training prompts: raise experiment.count")
    encode = PromptEncoder.for_runtime(tokenizer, rt, cfg.dataset.max_new_tokens)
    dense = DenseDecoder(rt)
    n_new = cfg.dataset.max_new_tokens

    def recs_of(ps, desc):
        out_recs = []
        for p in tqdm(ps, desc=desc):
            ids = encode(p["text"], p["id"])
            gen = dense.generate(ids, n_new, eos)
            r = record_generation(rt, parts["draft"], parts["banks"], cfg.early_exit.k, ids, gen.tokens,
                                  parts.get("svm"), parts.get("crf"))
            if r is not None:
                out_recs.append(r)
        return out_recs

    t0 = time.perf_counter()
    calib_recs, test_recs = recs_of(calib, "record calibration"), recs_of(test, "record test")
    record_s = time.perf_counter() - t0
    ids0 = encode(test[0]["text"], test[0]["id"])
    print("measuring unit costs (interleaved rounds)")
    units = cm.measure_unit_costs(rt, parts["unit_decoder"], dense, ids0, n_new, rounds=e.cost_rounds)
    if parts.get("ada_decoder") is not None:
        ada = cm.measure_unit_costs(rt, parts["ada_decoder"], dense, ids0, n_new, rounds=e.cost_rounds)
        units["samples_us"]["adainfer_probe"] = ada["samples_us"]["adainfer_probe"]
    dense_counts = cm.count_work([type("G", (), {"tokens": [0] * (n_new + 1), "trace": []})()], L,
                                 modes.reference().name)

    curves = {}
    for pol in tqdm(policies, desc="replay policies"):
        curves[pol.name] = [evaluate_point(pol, v, calib_recs, test_recs, units, dense_counts, L) for v in pol.grid]
    oracle = oracle_curve(test_recs, list(e.oracle_budgets), units, dense_counts, L)

    gen_loss = lambda r, half: r[half]["per_request_loss"]  # noqa: E731
    deltas = [e.delta] + [d for d in e.extra_deltas if d != e.delta]
    calibration_at = {str(d): {name: calibrate_policy(rows, d, e.epsilon, "hoeffding_bentkus", gen_loss)
                               for name, rows in curves.items()} for d in deltas}
    calibration = calibration_at[str(e.delta)]

    tasks = {}
    if e.tasks:
        tasks = record_tasks(cfg, rt, tokenizer, parts, out)
        for task in tasks.values():
            task["points"] = {pol.name: [task_point(task, pol, v, calib_recs) for v in pol.grid] for pol in policies}
            task["oracle"] = task_point(task, None, 0.0, None)
            if task["testable"]:
                task["calibration_at"] = {str(d): {pol.name: calibrate_task(task, pol, curves, d, e.epsilon)
                                                   for pol in policies} for d in deltas}
                task["calibration"] = task["calibration_at"][str(e.delta)]

    # Real runs beside dense on the test prompts
    timed_prompts = [(p["id"], encode(p["text"], p["id"])) for p in test[: e.timed_prompts]]
    for _, ids in timed_prompts[:1]:  # warm-up, untimed
        dense.generate(ids, min(8, n_new), eos)
    measured = {}
    for pol in tqdm(policies, desc="real runs"):
        pcfg = policy_config(cfg, pol.name)
        decoder = build_decoder(pcfg, rt)
        pts = []
        chosen = {c[pol.name]["chosen"] for c in calibration_at.values()}
        chosen |= {c[pol.name]["chosen"] for t in tasks.values() for c in t.get("calibration_at", {}).values()}
        for j in measured_indices(len(pol.grid), e.measured_points, chosen - {None}):
            row = curves[pol.name][j]
            set_operating_point(decoder, pol, row["value"], row["thresholds"])
            r = timed(rt, dense, decoder, timed_prompts, n_new, eos, cfg.seed)
            pts.append({"index": j, "value": row["value"], **r})
        measured[pol.name] = pts
    for name in e.real_only:  # not replayable (tree SpecEE): measured at each grid value
        pcfg = policy_config(cfg, name)
        decoder = build_decoder(pcfg, rt)
        pts = []
        for v in tqdm(sorted(e.real_only_grid, reverse=True), desc=f"real runs {name}"):
            decoder.predictors.set_threshold(float(v))
            pts.append({"value": float(v), **timed(rt, dense, decoder, timed_prompts, n_new, eos, cfg.seed)})
        measured[name] = pts
    peers = {}
    for name in e.lossless_peers:
        pcfg = policy_config(cfg, name)
        decoder = build_decoder(pcfg, rt, eos_id=eos)
        peers[name] = {"label": ablations.of(pcfg.ablation).label,
                       **timed(rt, dense, decoder, timed_prompts, n_new, eos, cfg.seed)}

    agreement = pages.replay_vs_real(curves, measured)
    m = {"num_layers": L, "prompts": {"calibration": len(calib_recs), "test": len(test_recs),
                                      "timed": len(timed_prompts), "left_out_trained_on": dropped},
         "max_new_tokens": n_new, "delta": e.delta, "epsilon": e.epsilon,
         "left_out": parts["left_out"],
         "policies": {p.name: {"label": p.label, "knob": p.knob, "grid": list(p.grid)} for p in policies},
         "curves": curves, "oracle": oracle, "calibration": calibration, "calibration_at": calibration_at,
         "measured": measured,
         "lossless_peers": peers, "replay_vs_real": agreement,
         "tasks": {k: {kk: vv for kk, vv in v.items() if kk not in ("task", "items", "calibration_ids")}
                   for k, v in tasks.items()},
         "unit_costs_us": units["median_us"], "record_s": record_s,
         "seconds": time.perf_counter() - t_start}
    m["verdicts"] = pages.verdicts(m, cfg.model.name)
    path = results.save(out, cfg, m, {"replay_method": "teacher-forced under dense's trajectory; exact up to "
                                                       "each sequence's first exit"})
    print(f"wrote {path}")
    doc = results.read_results(path, "rerun experiment=frontier with force=true")
    pages.write_report(doc, project_path(e.report_dir or f"reports/frontier_{cfg.model.name}"))
    return m
