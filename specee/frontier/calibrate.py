"""An operating point with a guarantee: Learn-then-Test (Angelopoulos, Bates et al. 2021), as CALM
calibrates its exit thresholds (Schuster et al., NeurIPS 2022).

For each candidate point j, in a fixed order from the most conservative to the fastest, test
H0_j: "the expected loss at j exceeds delta" on the calibration split; reject while the p-value is
<= epsilon and stop at the first point that is not rejected. Every rejected point then has loss
<= delta with probability >= 1 - epsilon over the draw of the calibration split (fixed-sequence
testing controls the family-wise error without a multiplicity correction). The chosen point is the
fastest rejected one; its loss and speed are then measured on a disjoint test split.

p-values, for n exchangeable calibration units with losses in [0, 1]:
- binary losses (an item dense answers right and the policy wrong): the exact binomial tail
  P(Binom(n, delta) <= k);
- bounded losses (a request's share of tokens that differ): Hoeffding–Bentkus,
  min(exp(-n h(min(mean, delta), delta)), e P(Binom(n, delta) <= ceil(n mean))).
"""
from __future__ import annotations

import math

import numpy as np
from scipy.stats import binom



def binomial_p(losses: np.ndarray, delta: float) -> float:
    """Exact p-value of H0: P(loss) > delta, from binary losses."""
    losses = np.asarray(losses)
    return float(binom.cdf(int(losses.sum()), len(losses), delta)) if len(losses) else 1.0


def _h1(a: float, b: float) -> float:
    a = min(max(a, 1e-12), 1 - 1e-12)
    return a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))


def hoeffding_bentkus_p(losses: np.ndarray, delta: float) -> float:
    """p-value of H0: E[loss] > delta, from losses in [0, 1] (Bates et al., RCPS, eq. 9)."""
    losses = np.asarray(losses, dtype=np.float64)
    n = len(losses)
    if not n:
        return 1.0
    mean = float(losses.mean())
    hoeff = math.exp(-n * _h1(min(mean, delta), delta))
    bentkus = math.e * float(binom.cdf(math.ceil(n * mean - 1e-9), n, delta))
    return min(hoeff, bentkus, 1.0)


def p_value(losses, delta: float, bound: str) -> float:
    return binomial_p(losses, delta) if bound == "binomial" else hoeffding_bentkus_p(losses, delta)


def min_units(delta: float, epsilon: float, bound: str) -> int:
    """Calibration units needed to certify a point with no loss observed at all."""
    n = 1
    while p_value(np.zeros(n), delta, bound) > epsilon:
        n = n * 2 if n < 64 else n + max(1, n // 16)
        if n > 10 ** 7:
            break
    lo = max(1, n // 2)
    while lo < n:  # the smallest such n
        mid = (lo + n) // 2
        if p_value(np.zeros(mid), delta, bound) <= epsilon:
            n = mid
        else:
            lo = mid + 1
    return n


def fixed_sequence(losses_by_point: list, delta: float, epsilon: float, bound: str) -> dict:
    """LTT over points in order (conservative first). ``losses_by_point[j]``: the calibration units'
    losses at point j. Returns the p-values and how many points (a prefix) are certified."""
    p = [p_value(losses, delta, bound) for losses in losses_by_point]
    certified = 0
    while certified < len(p) and p[certified] <= epsilon:
        certified += 1
    return {"p_values": p, "certified": certified}


def cannot_pass(partial, n: int, delta: float, epsilon: float, bound: str) -> bool:
    """Whether a point whose first ``len(partial)`` of ``n`` calibration units have these losses is
    already sure to fail its test: both p-values grow with the units' total loss, and the units not
    run yet add at least 0, so if even zero loss on them leaves p > epsilon the point fails. A test
    stopped this way reaches the decision the full run would (it never stops a point that passes)."""
    partial = np.asarray(partial, dtype=np.float64)
    if len(partial) > n:
        raise ValueError(f"cannot_pass: {len(partial)} losses for {n} units")
    return p_value(np.r_[partial, np.zeros(n - len(partial))], delta, bound) > epsilon


def clopper_pearson_lower(k: int, n: int, alpha: float) -> float:
    """The exact one-sided (1 - alpha) lower confidence bound on a binomial share from k of n."""
    from scipy.stats import beta
    return 0.0 if k <= 0 or n <= 0 else float(beta.ppf(alpha, k, n - k + 1))


def interval(losses, epsilon: float, bound: str) -> tuple[float, float]:
    """A two-sided (1 - epsilon) interval on the expected loss: each side at epsilon / 2."""
    return lower_bound(losses, epsilon / 2, bound), upper_bound(losses, epsilon / 2, bound)


def upper_bound(losses, epsilon: float, bound: str) -> float:
    """The (1 - epsilon) upper confidence bound on the expected loss (inverting the same test)."""
    losses = np.asarray(losses, dtype=np.float64)
    if not len(losses):
        return 1.0
    lo, hi = float(losses.mean()), 1.0
    if p_value(losses, hi - 1e-9, bound) > epsilon:
        return 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if p_value(losses, mid, bound) <= epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def lower_bound(losses, epsilon: float, bound: str) -> float:
    """The (1 - epsilon) lower confidence bound on the expected loss: the upper bound on 1 - loss,
    also in [0, 1] (and binary where the loss is), turned round."""
    losses = np.asarray(losses, dtype=np.float64)
    return 1.0 - upper_bound(1.0 - losses, epsilon, bound) if len(losses) else 0.0
