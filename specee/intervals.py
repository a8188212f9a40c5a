"""The statistics every page and verdict reads: paired differences over items, exact binomial
intervals, and the word an interval earns against a bound. One module, imported by the report's
pages (specee/report_figures.py) and the verdicts (specee/verdicts.py) alike."""
from __future__ import annotations

import math

import numpy as np


def paired_change(dense: dict | None, mode: dict | None, scale: float = 100.0) -> dict | None:
    """Item by item against dense (the same items): the mean difference of the per-item metric with
    its 95 % interval (normal, paired: the items' own spread, not two independent samples), how
    many answers changed, and how many items the mode got wrong that dense got right and back."""
    if not dense or not mode:
        return None
    common = sorted(set(dense) & set(mode))
    if len(common) < 2:
        return None
    diff = np.array([mode[i]["value"] - dense[i]["value"] for i in common]) * scale
    half = 1.96 * diff.std(ddof=1) / np.sqrt(len(diff))
    return {"n": len(common), "delta": float(diff.mean()), "lo": float(diff.mean() - half),
            "hi": float(diff.mean() + half),
            "changed": sum(mode[i]["answer"] != dense[i]["answer"] for i in common),
            "worse": sum(mode[i]["value"] < dense[i]["value"] for i in common),
            "better": sum(mode[i]["value"] > dense[i]["value"] for i in common)}


def word_for_interval(lo: float, hi: float, bound: float, above_is_good: bool = True) -> str:
    if (lo > bound) if above_is_good else (hi < bound):
        return "confirmed"
    if (hi < bound) if above_is_good else (lo > bound):
        return "refuted"
    return "inconclusive"


def _binomial_upper_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in log space (n of a few thousand items)."""
    if k <= 0:
        return 1.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq
            for i in range(k, n + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


def exact_interval(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Clopper-Pearson interval of a proportion k/n (bisection on the binomial tails): exact
    coverage where the normal approximation is too narrow near 0, 1 and at small n."""
    a = (1 - level) / 2

    def solve(f, target):  # f rises with p
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return (lo + hi) / 2
    lower = 0.0 if k == 0 else solve(lambda p: _binomial_upper_tail(k, n, p), a)
    upper = 1.0 if k == n else solve(lambda p: _binomial_upper_tail(k + 1, n, p), 1 - a)
    return lower, upper
