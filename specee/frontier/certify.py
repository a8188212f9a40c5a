"""Learn-then-Test on the real decoder, and the refutation of an exit policy by a sound rule.

Replay (specee/frontier/replay.py) scores every operating point cheaply, but it is teacher-forced:
after a sequence's first exit the real decoder reads other states (the skipped layers' K/V, the
draft's feature), so replayed loss is not the loss a user gets. What is certified here is the real
decoder's loss at each point it tests:

- a calibration unit is one prompt; its loss is the share of the real decoder's emitted tokens that
  the full stack, at the same prefix (the decoder's *own* context), would not emit. One definition,
  used in calibration, held-out figures, tables and plots: the mean over prompts of this share;
- the hypotheses are tested in an order fixed before any data is seen: the policy's grid from its
  most conservative point to its fastest, each point under every K/V policy in turn (the configured
  one first), stopping at the first hypothesis not rejected (fixed-sequence testing: every rejected
  hypothesis holds with probability >= 1 - epsilon jointly, no correction needed);
- real runs are needed only at the hypotheses tested, and a hypothesis stops running units as soon
  as even zero loss on the rest could not pass it (:func:`~specee.frontier.calibrate.cannot_pass`).

Refutation reads replay only where replay is exact: a sequence's steps up to and including its first
exit. If the first exit emits a token the full stack would not, the real decoder emits it too, at
dense's context, so that prompt's real loss is at least 1 / (max_new_tokens - 1). The share of such
prompts therefore bounds the real loss from below, under either K/V policy, with no real run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from specee.bench.oracle import layer_predictions
from specee.frontier import calibrate


@dataclass
class Unit:
    """One prompt: its id, encoded ids, category and dense's greedy tokens."""
    id: str
    ids: torch.Tensor
    dense_tokens: list[int]
    category: str = ""


def full_stack_tokens(rt, prompt_ids: torch.Tensor, tokens: list[int]) -> list[int]:
    """The full stack's greedy token at each of ``tokens[1:]``'s prefixes (prompt + tokens[:t]),
    from one teacher-forced pass that reads only the last layer's head."""
    return layer_predictions(rt, prompt_ids, tokens, last_only=True)[:, -1].tolist()


def dense_result(rt, unit: Unit) -> dict:
    """What :func:`own_context_loss` returns for a run that never exits: dense's tokens, every layer."""
    steps = len(unit.dense_tokens) - 1
    return {"loss": 0.0, "identical": True, "exited": False, "steps": steps, "layers": steps * rt.num_layers}


def own_context_loss(rt, unit: Unit, tokens: list[int], layers_run: list[int]) -> dict:
    """A real generation's loss against the full stack at its own context, with its identity to
    dense's output and whether it exited at all. Output identical to dense's has loss 0 (every prefix
    is dense's, where the full stack emits dense's token), without the extra pass."""
    steps = max(len(tokens) - 1, 1)
    identical = tokens == unit.dense_tokens
    wrong = 0 if identical else sum(t != f for t, f in zip(tokens[1:], full_stack_tokens(rt, unit.ids, tokens)))
    return {"loss": wrong / steps, "identical": identical, "exited": any(x < rt.num_layers for x in layers_run[1:]),
            "steps": len(tokens) - 1, "layers": sum(layers_run[1:])}


def certify_sequence(hypotheses: list, n_units: int, run_unit: Callable[[object, int], dict], delta: float,
                     epsilon: float, bound: str = "hoeffding_bentkus", progress=None) -> dict:
    """Fixed-sequence Learn-then-Test over ``hypotheses`` (already in their fixed order) on real
    losses: ``run_unit(h, u)`` runs unit ``u`` at hypothesis ``h`` and returns its :func:`own_context_loss`.
    Returns per tested hypothesis its losses (complete or stopped early), p-value and decision, and how
    many hypotheses (a prefix) are certified."""
    needed = calibrate.min_units(delta, epsilon, bound)
    out = {"delta": delta, "epsilon": epsilon, "bound": bound, "calibration_units": n_units,
           "units_needed_at_zero_loss": needed, "tested": [], "certified": 0}
    if n_units < needed:  # not even zero loss could pass: no run is spent
        return out
    for h in hypotheses:
        losses, identical, layers, steps = [], [], 0, 0
        stopped = False
        for u in range(n_units):
            r = run_unit(h, u)
            losses.append(r["loss"])
            identical.append(r["identical"])
            layers += r["layers"]
            steps += r["steps"]
            if progress is not None:
                progress()
            if calibrate.cannot_pass(losses, n_units, delta, epsilon, bound):
                stopped = u + 1 < n_units
                break
        p = calibrate.p_value(losses, delta, bound) if not stopped else None
        passed = p is not None and p <= epsilon
        out["tested"].append({"hypothesis": h, "units_run": len(losses), "stopped_early": stopped,
                              "loss": float(np.mean(losses)), "losses": losses,
                              "sequence_identity": float(np.mean(identical)),
                              "avg_layers": layers / max(steps, 1), "p_value": p, "certified": passed})
        if not passed:
            break
        out["certified"] += 1
    return out


def first_exit_wrong(rec, exits) -> int:
    """1 where the request's first exit emits a token the full stack would not (replay is exact up
    to and including that step, so the real decoder emits it too, at dense's context), else 0."""
    L = rec.argmax.shape[1]
    hit = np.flatnonzero(exits.layer < L - 1)
    return int(len(hit) > 0 and exits.token[hit[0]] != rec.final[hit[0]])


def exits_at_all(rec, exits) -> bool:
    """Whether the replayed request exits at any step. Replay is exact up to the first exit, so a
    request that never exits in replay runs as dense does on the real decoder (:func:`dense_result`)."""
    return bool((exits.layer < rec.argmax.shape[1] - 1).any())


def refutation(points: list[dict], delta: float, epsilon: float, max_new_tokens: int) -> dict:
    """Is every point whose speed could reach 1x shown to lose more than ``delta``?

    ``points``: per grid point ``{"index", "value", "fast": bool, "first_exit_wrong": [0/1 per unit]}``.
    Each fast point's real loss has the lower bound (1 / (max_new_tokens - 1)) x the exact
    (Clopper-Pearson) lower bound on its share of prompts whose first exit is wrong, each at
    epsilon / (number of fast points) (Bonferroni over the fast points), so all hold jointly with
    probability >= 1 - epsilon. Refuted when every fast point's bound exceeds ``delta``; with no fast
    point at all, the grid never reaches dense's speed."""
    fast = [p for p in points if p["fast"]]
    m = len(fast)
    c = 1.0 / max(max_new_tokens - 1, 1)
    rows = []
    for p in fast:
        w = np.asarray(p["first_exit_wrong"])
        lb = c * calibrate.clopper_pearson_lower(int(w.sum()), len(w), epsilon / m)
        rows.append({"index": p["index"], "value": p["value"], "wrong_first_exits": int(w.sum()), "units": len(w),
                     "loss_lower_bound": lb, "over_budget": bool(lb > delta)})
    return {"fast_points": m, "correction": f"Bonferroni over {m} fast point(s): each bound at epsilon/{m}" if m else
            "none (no fast point)", "per_token_floor": c, "points": rows,
            "refuted": all(r["over_budget"] for r in rows), "short": [r["value"] for r in rows if not r["over_budget"]]}


def certify_grid(curve: list[dict], knob: str, kv_order: list[str], n_calib: int, n_test: int, real: Callable,
                 replay_exits: Callable, dense: Callable, delta: float, epsilon: float, bound: str,
                 unit: str = "prompt", desc: str = "certify") -> dict:
    """Learn-then-Test on the real decoder over one policy's grid: hypotheses (point ``j``, K/V policy),
    the grid's order (conservative first), the configured K/V policy first at each point. The chosen
    hypothesis is the certified one with the highest modelled speedup (the configured K/V policy on a
    tie: it does less work); its real loss is then measured on every held-out unit.

    ``real(j, kv, half, u)`` runs unit ``u`` of ``half`` (calibration | test) on the real decoder and
    returns ``{"loss", "identical", "exited", "steps", "layers"}``; ``replay_exits(j, half, u)`` says
    whether replay exits at all there (replay is exact up to the first exit, so where it never exits the
    real run is dense's: ``dense(half, u)``, no run); a run with no exit is the same under every K/V
    policy. ``bound``: hoeffding_bentkus (a loss in [0, 1]) or binomial (0/1 losses, e.g. answer flips)."""
    cache: dict = {}

    def run_unit_of(half):
        def run_unit(h, u):
            j, kv = h
            key = (half, j, kv, u)
            if key not in cache:
                same = next((cache[k] for k in ((half, j, o, u) for o in kv_order) if k in cache
                             and not cache[k]["exited"]), None)
                if same is None and not replay_exits(j, half, u):
                    same = dense(half, u)
                if same is None:
                    same = real(j, kv, half, u)
                cache[key] = same
            return cache[key]
        return run_unit

    hyps = [(j, kv) for j in range(len(curve)) for kv in kv_order]
    bar = tqdm(desc=desc, unit=unit, leave=False)
    lt = certify_sequence(hyps, n_calib, run_unit_of("calibration"), delta, epsilon, bound,
                          progress=lambda: bar.update(1))
    bar.close()
    out = {k: v for k, v in lt.items() if k != "tested"}
    out.update({"on": "real decoding", "kv_policies": list(kv_order), "chosen": None,
                "tested": [{"index": t["hypothesis"][0], "value": curve[t["hypothesis"][0]]["value"],
                            "kv_policy": t["hypothesis"][1], **{k: v for k, v in t.items() if k != "hypothesis"}}
                           for t in lt["tested"]]})
    certified = out["tested"][: lt["certified"]]
    units = f"{unit}s"
    if not certified:
        if lt["calibration_units"] < lt["units_needed_at_zero_loss"]:
            out["why_none"] = (f"no point certified: {lt['calibration_units']} calibration {units}, and a loss of 0 "
                               f"needs {lt['units_needed_at_zero_loss']}")
        else:
            t = out["tested"][0]
            n = lt["calibration_units"]
            p0 = calibrate.p_value(np.zeros(n), delta, bound)
            out["why_none"] = (f"no point certified: the most conservative point ({knob} = {t['value']:g}, "
                               f"{t['kv_policy']}) lost {t['loss']:.4f} on real runs over the first {t['units_run']} "
                               f"of {n} calibration {units}, more than {delta:g} can absorb from {n} (p at zero "
                               f"loss {p0:.3f} against {epsilon:g})")
        return out
    best = max(certified, key=lambda t: (curve[t["index"]]["calibration"]["modelled_speedup"],
                                          -kv_order.index(t["kv_policy"])))
    run_test = run_unit_of("test")
    held = [run_test((best["index"], best["kv_policy"]), u) for u in range(n_test)]
    losses = np.asarray([h["loss"] for h in held])
    lo, hi = calibrate.interval(losses, epsilon, bound) if len(losses) else (float("nan"), float("nan"))
    out.update({"chosen": best["index"], "value": best["value"], "kv_policy": best["kv_policy"],
                "calibration_loss": best["loss"], "p_value": best["p_value"],
                "test_loss": float(losses.mean()) if len(losses) else float("nan"), "test_interval": [lo, hi],
                "test_units": len(held),
                "test_sequence_identity": float(np.mean([h["identical"] for h in held])) if held else float("nan"),
                "held_out_within_budget": bool(len(losses) and losses.mean() <= delta),
                "modelled_speedup": curve[best["index"]]["test"]["modelled_speedup"],
                "avg_layers": sum(h["layers"] for h in held) / max(sum(h["steps"] for h in held), 1)})
    return out
