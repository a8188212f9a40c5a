"""Any operating point's exits replayed from :class:`~specee.frontier.record.LayerRecord` s.

An exit policy is a decision rule over the recorded per-layer scores and one knob (its operating
point). Replay walks each request's steps in order, as the decoder does — the schedule's state
(SpecEE T2's online windows around the last exits) advances with the replayed exits — and gives
per step the exit layer, the emitted token (that layer's argmax) and the work it did (predictor
evaluations, verification heads, p_prev probes) for the cost model.

Exact where the decoder's inputs equal dense's: a sequence's steps up to and including its first
exit (after it, the decoder's K/V holes and its draft feature norm(h_exit) change later states).
``tests/test_frontier.py`` pins that equality against the real decoder; the frontier job measures
replay against real runs at several points per policy and reports the gap.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from specee.early_exit.features import delta_probe_layers
from specee.early_exit.predictor import logit_threshold, select_threshold


@dataclass
class Policy:
    """One exit policy: how it decides (``kind``: specee | svm | crf | rule), on which recorded
    scores, and its knob swept over ``grid`` (ordered from the most conservative point to the
    fastest). ``rule``: the :class:`~specee.exit_rules.ExitRule` a ``rule`` policy decides with."""
    name: str  # the ablation it replays
    label: str
    kind: str
    knob: str  # what the grid values are: threshold | target_precision | margin | p_stop
    grid: list[float]
    bank: str | None = None  # key of the recorded scores (specee)
    schedule: Any = None  # the decoder's schedule object (specee): new_request / active / record
    can_exit: list[bool] = field(default_factory=list)  # layers with a predictor (below the last)
    per_layer: bool = False  # the knob picks one threshold per layer (tuned bank: target precision)
    min_fires: int = 5  # per_layer: fires a layer's threshold needs on the calibration split
    mode: str = ""  # the replayed ablation's mode (its work is counted as that mode's)
    rule: Any = None  # kind rule: the exit rule (its scores are recorded under the policy's name)
    identity: dict = field(default_factory=dict)  # what its points hold for (specee/decoding/operating_point.py)


@dataclass
class Exits:
    """One request's replayed decisions: exit layer (0-based), token emitted, work per step."""
    layer: np.ndarray
    token: np.ndarray
    pred_calls: np.ndarray
    verify_calls: np.ndarray
    delta_probes: np.ndarray
    last_layer: int  # the stack's last layer (an exit is a layer below it)


def layer_thresholds(policy: Policy, value: float, records: list) -> np.ndarray:
    """Per-layer logit thresholds of ``policy`` at knob ``value``. A global threshold is the same
    at every layer; a target precision picks each layer's lowest threshold whose precision on
    ``records`` (the calibration split: every step at that layer, label = already the final
    token) reaches it (:func:`~specee.early_exit.predictor.select_threshold`)."""
    L = records[0].argmax.shape[1] if records else len(policy.can_exit)
    if not policy.per_layer:
        return np.full(L, logit_threshold(value))
    thr = np.full(L, math.inf)
    for i in range(L):
        if not policy.can_exit[i]:
            continue
        s = np.concatenate([r.scores[policy.bank][r.exitable, i] for r in records])
        y = np.concatenate([(r.argmax[r.exitable, i] == r.final[r.exitable]) for r in records])
        prob = 1 / (1 + np.exp(-s.astype(np.float64)))
        thr[i] = logit_threshold(select_threshold(prob, y, value, policy.min_fires))
    return thr


class SpecEEBank:
    """SpecEE's predictors under their schedule: the scheduled layers' logits against per-layer
    thresholds, a fire confirmed by the verification head (recorded per layer), the schedule's state
    advancing with the replayed exits; p_prev probes where a predictor's previous layer has none."""
    is_specee = True  # its rows test the paper's own claim (the others test a peer's)

    def thresholds(self, policy: Policy, value: float, fit_recs: list) -> np.ndarray:
        return layer_thresholds(policy, value, fit_recs)

    def replay(self, rec, policy: Policy, thr) -> Exits:
        T, L = rec.argmax.shape
        layer = np.full(T, L - 1)
        pred, ver, probes = (np.zeros(T, dtype=np.int64) for _ in range(3))
        verified, scores = rec.verified, rec.scores[policy.bank]
        state = policy.schedule.new_request()
        for t in range(T):
            active = policy.schedule.active(state)
            eligible = [policy.can_exit[i] and active[i] for i in range(L)]
            probe_only = delta_probe_layers(eligible, "previous_layer")
            exit_at = L - 1
            if rec.exitable[t]:
                for i in range(L - 1):
                    if eligible[i]:
                        pred[t] += 1
                        if scores[t, i] > thr[i]:
                            ver[t] += 1
                            if verified[t, i]:
                                exit_at = i
                                break
                    elif probe_only[i]:
                        probes[t] += 1
            layer[t] = exit_at
            policy.schedule.record(state, exit_at)
        return Exits(layer, rec.argmax[np.arange(T), layer], pred, ver, probes, L - 1)

    def host_reads(self, pred_calls: int, verify_calls: int) -> int:
        """Its speculative set, each predictor decision, each verification argmax and the token."""
        return pred_calls + 1 + 1 + verify_calls


class EveryLayerDecides:
    """A decision after every layer below the last, each on its own recorded score (AdaInfer's SVM
    margin or CRF P(stop), an exit rule's score): the first layer that fires is the exit."""
    is_specee = False

    def __init__(self, fires):
        self.fires = fires  # (rec, policy, value) -> bool array (steps, layers)

    def thresholds(self, policy: Policy, value: float, fit_recs: list) -> float:
        return value

    def replay(self, rec, policy: Policy, thr) -> Exits:
        T, L = rec.argmax.shape
        fire = np.array(self.fires(rec, policy, thr), dtype=bool)
        fire[:, L - 1] = False
        fire &= rec.exitable[:, None]
        any_fire = fire.any(1)
        layer = np.where(any_fire, fire.argmax(1), L - 1)
        pred = np.where(rec.exitable, np.where(any_fire, layer + 1, L - 1), 0)
        z = np.zeros(T, dtype=np.int64)
        return Exits(layer, rec.argmax[np.arange(T), layer], pred, z, z, L - 1)

    def host_reads(self, pred_calls: int, verify_calls: int) -> int:
        """Each decision and the token."""
        return pred_calls + 1


def _rule_fires(rec, policy, value):
    with np.errstate(invalid="ignore"):  # NaN at the last layer, which never decides
        return np.asarray(policy.rule.fires(rec.rules[policy.name], value), dtype=bool)


# How each kind of policy decides, by the ``kind`` its Policy carries: the one place a kind is read.
DECIDERS = {"specee": SpecEEBank(),
            "svm": EveryLayerDecides(lambda rec, policy, thr: rec.svm > thr),
            "crf": EveryLayerDecides(lambda rec, policy, thr: rec.crf > thr),
            "rule": EveryLayerDecides(_rule_fires)}


def knob_thresholds(policy: Policy, value: float, fit_recs: list):
    """What :func:`replay` takes at knob ``value``: per-layer logit thresholds for SpecEE (fitted on
    ``fit_recs`` for a target precision), the value itself for the others."""
    return DECIDERS[policy.kind].thresholds(policy, value, fit_recs)


def replay(rec, policy: Policy, thr: np.ndarray | float) -> Exits:
    """Exits of one request at one operating point (``thr`` from :func:`knob_thresholds`)."""
    return DECIDERS[policy.kind].replay(rec, policy, thr)


def oracle_exits(rec, order: np.ndarray | None = None) -> Exits:
    """The oracle: each step exits at the earliest layer whose argmax is already the full stack's
    (no predictor, draft or verification cost). ``order`` (from :func:`oracle_orders`): the steps
    a loss budget buys, which exit at layer 0 instead, wrong or not."""
    T, L = rec.argmax.shape
    same = rec.argmax == rec.final[:, None]
    first = np.where(rec.exitable, same.argmax(1), L - 1)
    layer = first.copy()
    if order is not None and len(order):
        layer[order] = 0
    token = rec.argmax[np.arange(T), layer]
    z = np.zeros(T, dtype=np.int64)
    return Exits(layer, token, z, z, z, L - 1)


def oracle_orders(records: list, budget: float) -> list[np.ndarray]:
    """Per request, its steps the budget buys (the ``budget`` share of all steps, largest savings
    first across requests)."""
    L = records[0].argmax.shape[1]
    rows = []
    for r_i, rec in enumerate(records):
        same = rec.argmax == rec.final[:, None]
        first = np.where(rec.exitable, same.argmax(1), L - 1)
        rows += [(int(first[t]), r_i, t) for t in range(rec.steps) if rec.exitable[t] and first[t] > 0]
    n = int(budget * sum(r.steps for r in records))
    rows.sort(reverse=True)
    out = [[] for _ in records]
    for _, r_i, t in rows[:n]:
        out[r_i].append(t)
    return [np.asarray(o, dtype=np.int64) for o in out]


def trace_of(ex: Exits, policy: Policy) -> list[dict]:
    """The step traces :func:`specee.cost_model.priced_work.count_work` reads, from replayed exits. Host
    reads as the decoder does them: SpecEE reads its speculative set, each predictor decision,
    each verification argmax and the emitted token; AdaInfer and an exit rule each decision and the
    token. An exit rule that does not read the LM head runs one where it exits (``emit_heads``)."""
    out = []
    emit_head = policy.rule is not None and not policy.rule.reads_head
    for e, p, v, d in zip(ex.layer.tolist(), ex.pred_calls.tolist(), ex.verify_calls.tolist(),
                          ex.delta_probes.tolist()):
        syncs = DECIDERS[policy.kind].host_reads(p, v)
        t = {"exit_layer": e, "layers": e + 1, "pred_calls": p, "verify_calls": v, "delta_probes": d, "syncs": syncs}
        if emit_head:
            t["emit_heads"] = int(e < ex.last_layer)
        out.append(t)
    return out


def as_generations(exits: list[Exits], policy: Policy) -> list:
    """Replayed exits in the shape of decoder Generations (tokens, trace) for the cost model."""
    return [SimpleNamespace(tokens=[0] + ex.token.tolist(), trace=trace_of(ex, policy)) for ex in exits]


def generation_metrics(records: list, exits: list[Exits]) -> dict:
    """Speed-free figures of one point on generation requests: layers per token, the share of
    tokens that differ from the full stack's under dense's trajectory, and the share of requests
    whose every token agrees (their greedy output equals dense's where replay is exact)."""
    n = sum(r.steps for r in records)
    layers = sum(int((e.layer + 1).sum()) for e in exits)
    wrong = [int((e.token != r.final).sum()) for r, e in zip(records, exits)]
    return {"avg_layers": layers / max(n, 1), "token_disagreement": sum(wrong) / max(n, 1),
            "sequence_identity": sum(w == 0 for w in wrong) / max(len(records), 1),
            "per_request_loss": [w / max(r.steps, 1) for w, r in zip(wrong, records)]}
