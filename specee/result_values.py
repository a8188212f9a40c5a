"""The types of the values a report reads from a results.json, checked as the file is read.

The results contract (``specee.table.check_results``) says a document is a specee result; this
says its values are what the report computes with: names are text, a speed result's metrics are
numbers (their units declared in ``specee.bench.metrics_catalog``), shares lie in [0, 1], an
accuracy result's accuracies are numbers and its item counts whole. A hand-edited or foreign value is named with its key, and the
report skips that file and renders the rest (``specee.results.read_sweep``).
"""
from __future__ import annotations

import math
from pathlib import Path

from specee.errors import SpeceeError

# Catalog units whose values are quantities: a number, null, or a mapping of numbers (statistics
# such as latency_ms_per_token's mean and percentiles).
_QUANTITY_UNITS = {"ratio", "share 0-1", "tokens/s", "layers", "ms", "s", "calls/token", "syncs/token",
                   "prompts", "tokens", "tokens/step", "steps", "calls/step", "fires/token", "turns", "count"}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _quantity(v) -> bool:
    return v is None or _number(v) or isinstance(v, float) and not math.isfinite(v) \
        or isinstance(v, dict) and all(x is None or isinstance(x, (int, float)) and not isinstance(x, bool)
                                       for x in v.values())


def _share(v) -> bool:
    return v is None or not _number(v) and _quantity(v) or _number(v) and 0 <= v <= 1


def _interval(v) -> bool:
    return v is None or isinstance(v, list) and len(v) == 2 and all(x is None or _number(x) for x in v)


_BY_UNIT = {
    "share 0-1": (_share, "a share in [0, 1] (or null)"),
    "[lo, hi]": (_interval, "an interval [lo, hi] of two numbers (or null)"),
    "bool": (lambda v: v is None or isinstance(v, bool), "true or false"),
    "text": (lambda v: v is None or isinstance(v, str), "text"),
    "list of text": (lambda v: v is None or isinstance(v, list) and all(isinstance(x, str) for x in v),
                     "a list of text"),
}


def _rule(unit: str):
    if unit in _BY_UNIT:
        return _BY_UNIT[unit]
    if unit in _QUANTITY_UNITS:
        return _quantity, f"a number ({unit}) or null"
    return None


def _shown(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def check_result_values(path: Path, doc: dict) -> None:
    """SpeceeError naming ``path`` and the first key whose value the report cannot use."""
    from specee.bench.metrics_catalog import SIDE, SIDES, TOP

    def bad(key, value, expected):
        raise SpeceeError(f"{path}: {key} holds {_shown(value)}; expected {expected}; fix or remove that file "
                          "(or rerun that job with force=true)")

    cfg = doc["config"]
    for group, key in (("model", "name"), ("ablation", "name"), ("ablation", "mode")):
        if key in cfg[group] and not (isinstance(cfg[group][key], str) and cfg[group][key]):
            bad(f"config.{group}.{key}", cfg[group][key], "a name (text)")
    for key in ("runtime", "dataset", "early_exit", "draft"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            bad(f"config.{key}", cfg[key], "a mapping")
    env = doc["env"]
    if env.get("gpus") is not None and not (isinstance(env["gpus"], list) and all(isinstance(g, dict) for g in env["gpus"])):
        bad("env.gpus", env["gpus"], "a list of GPU records")
    if env.get("torch_threads") is not None and not (_number(env["torch_threads"]) and env["torch_threads"] >= 0):
        bad("env.torch_threads", env["torch_threads"], "a whole number")
    for key in ("cpu", "device"):
        holder = env if key == "cpu" else doc
        if holder.get(key) is not None and not isinstance(holder[key], str):
            bad(key if key == "device" else f"env.{key}", holder[key], "text")
    m = doc["metrics"]
    # The catalog declares the speed recipe's metrics; other recipes reuse some names for other shapes.
    recipe = str(cfg["experiment"].get("_target_", ""))
    if recipe == "experiments.speed.run":
        sides = {side: m.get(side) for side in SIDES if isinstance(m.get(side), dict)}
        for metrics, catalog, prefix in [(m, TOP, "metrics")] + [(v, SIDE, f"metrics.{s}") for s, v in sides.items()]:
            for entry in catalog:
                if entry.key in metrics and (rule := _rule(entry.unit)) and not rule[0](metrics[entry.key]):
                    bad(f"{prefix}.{entry.key}", metrics[entry.key], rule[1])
        for side in SIDES:
            if m.get(side) is not None and not isinstance(m[side], dict):
                bad(f"metrics.{side}", m[side], "a mapping of that side's metrics")
    acc = m.get("accuracy") if recipe == "experiments.accuracy.run" else None
    if acc is not None:
        if not isinstance(acc, dict):
            bad("metrics.accuracy", acc, "a mapping of task -> its metrics")
        for task, t in acc.items():
            if not isinstance(t, dict):
                bad(f"metrics.accuracy.{task}", t, "a mapping of that task's metrics")
            if "accuracy" in t and not _number(t["accuracy"]):
                bad(f"metrics.accuracy.{task}.accuracy", t["accuracy"], "a number")
            if t.get("accuracy_stderr") is not None and not _number(t["accuracy_stderr"]):
                bad(f"metrics.accuracy.{task}.accuracy_stderr", t["accuracy_stderr"], "a number or null")
            if "n" in t and not (_number(t["n"]) and float(t["n"]).is_integer() and t["n"] >= 0):
                bad(f"metrics.accuracy.{task}.n", t["n"], "a whole number of items")
