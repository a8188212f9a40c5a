"""A certified operating point as a setting, and the one way a decoder is put at a point.

``experiment=frontier`` certifies, per exit policy, the fastest point whose real loss is <= delta with
probability >= 1 - epsilon. ``early_exit.operating_point=<report folder or results.json>`` makes a
speed, accuracy or main job run exactly that point for its ablation: the knob value (a global
threshold, the tuned bank's per-layer thresholds, an SVM margin, a CRF P(stop), an exit rule's
value) and the K/V policy it was certified under. It refuses, in one line, a file that is not a
frontier result, a policy the frontier did not calibrate, a budget it did not certify on real
decoding, a point certified for another model, draft, bank, classifier, rule or placement (each
artifact compared by the digest of its files), and a frontier where nothing was certified.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from specee.data import sha256
from specee.errors import SpeceeError
from specee.io import project_path

RESULT_FILES = ("frontier.json", "results.json")  # a report folder's copy, or the job's own


def folder_digest(path) -> str | None:
    """sha256 over a folder's files (relative names and contents, sorted); None when it is absent."""
    folder = project_path(path)
    if not folder.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(f.relative_to(folder).as_posix().encode())
        h.update(sha256(f).encode())
    return h.hexdigest()[:16]


def identity(cfg) -> dict:
    """What a policy's point holds only for: the model, and each artifact the ablation's decoder
    reads (path and the digest of its files), with the settings that change its decisions. The bank's
    and classifiers' cards pin the base model's weights, so their digests pin the model too."""
    from specee.decoding import modes
    spec, ee = modes.of(cfg.ablation), cfg.early_exit
    out: dict = {"model": cfg.model.name, "model_init": cfg.model.init, "mode": cfg.ablation.mode}
    if spec.needs_draft:
        out["draft"] = {"path": str(cfg.draft.path), "vocab_size": int(cfg.draft.vocab_size),
                        "digest": folder_digest(cfg.draft.path)}
    if spec.needs_bank:
        out["bank"] = {"path": str(ee.predictors_path), "digest": folder_digest(ee.predictors_path),
                       "calibration": ee.calibration, "k": int(ee.k), "delta_from": ee.delta_from}
        out["placement"] = {k: v for k, v in OmegaConf.to_container(cfg.placement, resolve=True).items()
                            if k != "profile_path"}
    if spec.needs_adainfer:
        out["classifier"] = {"kind": cfg.ablation.classifier, "path": str(ee.adainfer_path),
                             "digest": folder_digest(ee.adainfer_path)}
    if spec.exit_rule is not None and spec.exit_rule.fitted_on:
        out["rule"] = {"path": str(ee.exit_rules_path), "digest": folder_digest(ee.exit_rules_path)}
    return out


def _differences(theirs, mine, at: str = "") -> list[str]:
    if isinstance(theirs, dict) and isinstance(mine, dict):
        return [d for k in sorted(set(theirs) | set(mine))
                for d in _differences(theirs.get(k), mine.get(k), f"{at}.{k}" if at else k)]
    return [] if theirs == mine else [f"{at}: {theirs!r} there, {mine!r} here"]


def _set_bank(decoder, value, per_layer, thresholds):
    if per_layer:  # the tuned bank: each layer's logit threshold, fitted on the frontier's fit split
        decoder.predictors.set_layer_thresholds([float(1 / (1 + math.exp(-t))) if math.isfinite(t)
                                                 else (1.0 if t > 0 else 0.0) for t in map(float, thresholds)])
    else:
        decoder.predictors.set_threshold(float(value))


# How a decoder of each policy kind takes its knob: the one place a kind is read on this side.
SETTERS = {"specee": _set_bank,
           "rule": lambda decoder, value, *_: setattr(decoder, "value", float(value)),
           "svm": lambda decoder, value, *_: setattr(decoder.svm, "margin", float(value)),
           "crf": lambda decoder, value, *_: setattr(decoder.svm, "p_stop", float(value))}


def set_point(decoder, kind: str, value: float, per_layer: bool = False, thresholds=None,
              kv_policy: str | None = None) -> None:
    """Put a real decoder at a point: its knob ``value``, or for a target precision the per-layer
    logit ``thresholds`` fitted on the frontier's fit split; and, where given, what an exit leaves in
    the skipped layers' K/V (part of the operating point: it changes what later tokens read)."""
    if kind not in SETTERS:
        raise SpeceeError(f"an operating point of kind {kind!r} cannot be set (known: {', '.join(SETTERS)})")
    if kv_policy is not None:
        decoder.kv_policy = kv_policy
    SETTERS[kind](decoder, value, per_layer, thresholds)


@dataclass
class OperatingPoint:
    """The point a frontier certified for one policy at one budget, and where it came from."""
    source: str
    policy: str
    kind: str
    knob: str
    value: float
    kv_policy: str
    per_layer: bool
    thresholds: list | None
    delta: float
    epsilon: float
    held_out: dict
    measured: dict | None
    frontier_created: str
    certified_on: dict = field(default_factory=dict)  # the frontier's device, dtype and machine

    def apply(self, decoder) -> None:
        set_point(decoder, self.kind, self.value, self.per_layer, self.thresholds, self.kv_policy)
        decoder.operating_point = self.describe()

    def describe(self) -> dict:
        return {"source": self.source, "policy": self.policy, "knob": self.knob, "value": self.value,
                "kv_policy": self.kv_policy, "per_layer_thresholds": self.per_layer,
                "delta": self.delta, "epsilon": self.epsilon, "certified_on": "real decoding",
                "held_out": self.held_out, "measured_at_frontier": self.measured,
                "frontier_created": self.frontier_created, "frontier_ran_on": self.certified_on,
                "statement": self.statement()}

    def statement(self) -> str:
        h = self.held_out
        return (f"certified at δ = {self.delta:g} (1 - ε = {1 - self.epsilon:g}, real decoding, {self.policy} "
                f"{self.knob} = {self.value:g}, K/V {self.kv_policy}; held-out loss {h['loss']:.4f} "
                f"[{h['interval'][0]:.4f}, {h['interval'][1]:.4f}] over {h['units']} prompts) by {self.source}")


def _refuse(src: str, why: str, key: str = "early_exit.operating_point") -> SpeceeError:
    return SpeceeError(f"{key}={src}: {why}")


def read_frontier(src: str, key: str = "early_exit.operating_point") -> tuple[dict, Path]:
    """The frontier result at ``src`` (a report folder holding frontier.json, or a results.json);
    ``key``: the setting that named it, for the error."""
    path = project_path(src)
    file = next((path / n for n in RESULT_FILES if (path / n).is_file()), None) if path.is_dir() else path
    if file is None or not file.is_file():
        raise _refuse(src, "no frontier result there; give a frontier report folder (holding frontier.json) or "
                           "a frontier job's results.json, made by `python run.py experiment=frontier`", key)
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _refuse(src, f"{file.name} is not JSON ({err}); re-run experiment=frontier", key) from None
    m = doc.get("metrics") if isinstance(doc, dict) else None
    if not isinstance(m, dict) or not all(k in m for k in ("calibration", "curves", "policies", "delta")):
        raise _refuse(src, f"{file.name} is not a frontier result (no calibration, curves and policies); "
                           "give the folder experiment=frontier wrote", key)
    return doc, file


def read(cfg) -> OperatingPoint:
    """The point ``cfg.early_exit.operating_point`` names for this job's ablation, checked."""
    ee = cfg.early_exit
    src = str(ee.operating_point)
    doc, _ = read_frontier(src)
    m, policy = doc["metrics"], cfg.ablation.name
    if policy not in m["policies"]:
        raise _refuse(src, f"that frontier calibrated {', '.join(sorted(m['policies']))}, not ablation={policy}; "
                           "pick one of them with ablation=")
    delta = float(m["delta"])
    budget = float(ee.operating_budget) if ee.operating_budget is not None else delta
    if not math.isclose(budget, delta):
        raise _refuse(src, f"certified on real decoding at δ = {delta:g} only, not early_exit.operating_budget="
                           f"{budget:g} (its other budgets are a replay screen, no guarantee); re-run the frontier "
                           f"with experiment.delta={budget:g}")
    cal = m["calibration"][policy]
    if cal.get("on") != "real decoding":
        raise _refuse(src, "its certification is on teacher-forced replay, not real decoding; re-run experiment=frontier")
    if cal.get("chosen") is None:
        raise _refuse(src, f"nothing was certified for {policy} at δ = {delta:g}: {cal.get('why_none', 'no point passed')}")
    recorded = m["policies"][policy].get("identity")
    if recorded is None:
        raise _refuse(src, "it does not record which model, draft and bank each policy was calibrated with "
                           "(written by an older frontier); re-run experiment=frontier")
    diff = _differences(recorded, identity(cfg))
    if diff:
        raise _refuse(src, f"calibrated for another setting than this job's ({'; '.join(diff[:3])}); run with the "
                           "frontier's model, draft, artifacts and placement, or re-run the frontier for these")
    row = m["curves"][policy][cal["chosen"]]
    pol = m["policies"][policy]
    meas = next((p for p in m.get("measured", {}).get(policy, [])
                 if p["index"] == cal["chosen"] and p["kv_policy"] == cal["kv_policy"]), None)
    env, conf = doc.get("env", {}), doc.get("config", {})
    return OperatingPoint(
        source=src, policy=policy, kind=pol["kind"], knob=pol["knob"], value=float(cal["value"]),
        kv_policy=cal["kv_policy"], per_layer=bool(pol.get("fitted")), thresholds=row.get("thresholds"),
        delta=delta, epsilon=float(m["epsilon"]),
        held_out={"loss": cal["test_loss"], "interval": cal["test_interval"], "units": cal["test_units"]},
        measured=None if meas is None else {k: meas[k] for k in ("speedup", "speedup_ci", "avg_layers",
                                                                 "sequence_identity", "own_context_disagreement")},
        frontier_created=str(doc.get("created", "")),
        certified_on={"device": conf.get("model", {}).get("device"), "dtype": conf.get("model", {}).get("dtype"),
                      "machine": env.get("cpu") or env.get("gpu") or env.get("platform")})


def check(cfg) -> None:
    """At compose time: the setting is read and checked before any model loads."""
    if cfg.early_exit.get("operating_point"):
        read(cfg)
