"""Learn-then-Test and the verdict rule (specee/frontier/calibrate.py, certify.py, pages.py), tested so
that the procedure's known failure modes break them: p-values against independent reference values,
the family-wise error on grids whose true losses are known (non-monotone, over-budget points reached),
each broken variant of the procedure shown to fail the same check, the order fixed before the data,
the refutation rule on constructed cases both ways, and power (a clearly safe point is certified)."""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from specee.frontier import calibrate, certify
from specee.frontier.pages import joint_verdict


def _binom_cdf_exact(k: int, n: int, p: float) -> float:
    """P(Binom(n, p) <= k) summed term by term in exact rational arithmetic (independent of scipy)."""
    q = Fraction(p).limit_denominator(10 ** 12)
    return float(sum(math.comb(n, i) * q ** i * (1 - q) ** (n - i) for i in range(k + 1)))


def _hb_reference(losses, delta: float) -> float:
    """Hoeffding-Bentkus written out from Bates et al. (2021), eq. 9, independently of the code."""
    n = len(losses)
    mu = sum(losses) / n
    a = min(mu, delta)
    if a <= 0:
        h = -math.log(1 - delta)
    else:
        h = a * math.log(a / delta) + (1 - a) * math.log((1 - a) / (1 - delta))
    return min(1.0, math.exp(-n * h), math.e * _binom_cdf_exact(math.ceil(n * mu - 1e-9), n, delta))


@pytest.mark.parametrize("k, n, delta", [(0, 299, 0.01), (0, 300, 0.01), (3, 300, 0.01), (1, 100, 0.05),
                                         (10, 100, 0.05), (0, 59, 0.05)])
def test_binomial_p_value_equals_the_exact_tail(k, n, delta):
    losses = np.r_[np.ones(k), np.zeros(n - k)]
    assert calibrate.binomial_p(losses, delta) == pytest.approx(_binom_cdf_exact(k, n, delta), rel=1e-9, abs=1e-15)


def test_published_sample_sizes_hold():
    """Zero failures in n trials certify p <= delta at 1 - epsilon from n = ln(epsilon) / ln(1 - delta):
    299 at (0.01, 0.05) and 59 at (0.05, 0.05), the 'rule of three' sizes."""
    assert calibrate.min_units(0.01, 0.05, "binomial") == 299
    assert calibrate.min_units(0.05, 0.05, "binomial") == 59
    assert calibrate.min_units(0.01, 0.05, "hoeffding_bentkus") == 299  # the Hoeffding term at zero loss


HB_CASES = [(300, 0, 0.01, 1 / 3), (345, 2, 0.01, 1 / 3), (400, 4, 0.02, 1 / 3), (120, 3, 0.05, 1 / 3),
            (80, 0, 0.05, 1 / 3), (300, 6, 0.05, 1 / 3), (50, 5, 0.2, 1 / 3), (1000, 3, 0.01, 1 / 3),
            (300, 9, 0.05, 1.0), (300, 12, 0.05, 1.0)]


@pytest.mark.parametrize("n, wrong, delta, share", HB_CASES)
def test_hoeffding_bentkus_equals_an_independent_computation(n, wrong, delta, share):
    """Shares of tokens (bounded losses): each wrong prompt loses ``share`` of its tokens. The cases
    cover both terms being the smaller one, so a missing e factor or a wrong h fails here."""
    losses = [share] * wrong + [0.0] * (n - wrong)
    got = calibrate.hoeffding_bentkus_p(np.asarray(losses), delta)
    assert got == pytest.approx(_hb_reference(losses, delta), rel=1e-6, abs=1e-12)


def test_both_hoeffding_bentkus_terms_are_exercised():
    """The reference cases above include ones where the Bentkus term (with its e factor) is the
    smaller: otherwise a dropped e could pass them."""
    bentkus_wins = 0
    for n, wrong, delta, share in HB_CASES:
        if not wrong:
            continue
        losses = [share] * wrong + [0.0] * (n - wrong)
        mu = sum(losses) / n
        a = min(mu, delta)
        hoeff = math.exp(-n * (a * math.log(a / delta) + (1 - a) * math.log((1 - a) / (1 - delta))))
        bentkus = math.e * _binom_cdf_exact(math.ceil(n * mu - 1e-9), n, delta)
        bentkus_wins += bentkus < hoeff
    assert bentkus_wins >= 2


def _fwer(procedure, true, delta, eps, n, seeds, kind, seed=0) -> float:
    """The share of seeds in which any certified point's true loss exceeds delta."""
    rng = np.random.default_rng(seed)
    bad = 0
    for _ in range(seeds):
        if kind == "binary":
            losses = [(rng.random(n) < p).astype(float) for p in true]
        else:  # a share of 10 Bernoulli tokens per prompt
            losses = [rng.binomial(10, p, n) / 10 for p in true]
        certified = procedure(losses, delta, eps)
        bad += any(true[j] > delta for j in certified)
    return bad / seeds


def _ltt(bound):
    def run(losses, delta, eps):
        return list(range(calibrate.fixed_sequence(losses, delta, eps, bound)["certified"]))
    return run


def _no_stopping(bound):
    def run(losses, delta, eps):
        return [j for j, l in enumerate(losses) if calibrate.p_value(l, delta, bound) <= eps]
    return run


def _sorted_by_observed(bound):
    def run(losses, delta, eps):
        order = sorted(range(len(losses)), key=lambda j: losses[j].mean())
        lt = calibrate.fixed_sequence([losses[j] for j in order], delta, eps, bound)
        return [order[i] for i in range(lt["certified"])]
    return run


def _clt(losses, delta, eps):
    """Normal-approximation p-values in the fixed sequence (the anti-conservative shortcut)."""
    from scipy.stats import norm
    out = []
    for l in losses:
        se = l.std(ddof=1) / math.sqrt(len(l))
        p = 0.0 if se == 0 else float(norm.cdf((l.mean() - delta) / se))
        if p > eps:
            break
        out.append(len(out))
    return out


# A non-monotone grid (conservative -> fast): safe points between points just over the budget, so
# the over-budget ones are reached and each passes its own test now and then.
GRID = np.array([0.0, 0.02, 0.051, 0.01, 0.051, 0.02, 0.051, 0.03, 0.051, 0.051, 0.051, 0.051])
SEEDS = 400


# binary losses: the worst case for a bounded-loss bound (shares of tokens are less spread), where
# an over-budget point passes Hoeffding-Bentkus often enough to be seen
@pytest.mark.parametrize("bound, kind", [("binomial", "binary"), ("hoeffding_bentkus", "binary")])
def test_ltt_controls_the_family_wise_error_on_a_non_monotone_grid(bound, kind):
    """The real procedure keeps P(any certified point over budget) <= epsilon where over-budget
    points are reached; dropping the stopping rule or ordering by observed loss breaks it on the
    same draws (so this check can fail)."""
    delta, eps, n = 0.05, 0.1, 300
    err = _fwer(_ltt(bound), GRID, delta, eps, n, SEEDS, kind)
    assert err <= eps
    assert _fwer(_no_stopping(bound), GRID, delta, eps, n, SEEDS, kind) > 1.5 * eps
    assert _fwer(_sorted_by_observed(bound), GRID, delta, eps, n, SEEDS, kind) > 1.5 * eps


def test_ltt_with_exact_p_values_holds_where_clt_p_values_do_not():
    """Rare losses (the paper's 1 % budget): a point just over budget passes an exact test at most
    epsilon of the time, a normal-approximation test far more often."""
    true = np.array([0.0, 0.013])
    delta, eps, n = 0.01, 0.05, 300
    assert _fwer(_ltt("binomial"), true, delta, eps, n, SEEDS, "binary", seed=3) <= eps
    assert _fwer(_clt, true, delta, eps, n, SEEDS, "binary", seed=3) > 2 * eps


def test_ltt_has_power_where_a_point_is_clearly_safe():
    """A point with true loss a tenth of the budget, with enough units, is certified nearly always
    (a procedure whose p-values are all 1 keeps its guarantee and fails this)."""
    rng = np.random.default_rng(5)
    hits = 0
    for _ in range(100):
        losses = [rng.binomial(10, 0.002, 400) / 10, rng.binomial(10, 0.3, 400) / 10]
        hits += calibrate.fixed_sequence(losses, 0.02, 0.05, "hoeffding_bentkus")["certified"] == 1
    assert hits >= 95


def test_the_order_is_the_given_one_not_the_observed_losses():
    """A first point that fails stops the sequence even when a later one has no loss at all; the later
    point is never run (real runs are spent only on the points tested)."""
    losses = [np.r_[np.ones(20), np.zeros(380)], np.zeros(400)]
    assert calibrate.fixed_sequence(losses, 0.01, 0.05, "binomial")["certified"] == 0
    runs = []

    def run_unit(h, u):
        runs.append(h)
        loss = 0.5 if h == "first" else 0.0
        return {"loss": loss, "identical": loss == 0, "exited": True, "steps": 10, "layers": 100}
    out = certify.certify_sequence(["first", "second"], 400, run_unit, 0.01, 0.05)
    assert out["certified"] == 0 and [t["hypothesis"] for t in out["tested"]] == ["first"]
    assert "second" not in runs and len(runs) < 400  # the failing point stopped as soon as it could not pass


def test_stopping_a_point_early_reaches_the_full_runs_decision():
    """Over random loss sequences, the early-stopped test certifies exactly when the full test does."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = int(rng.integers(300, 420))
        p = float(rng.choice([0.0, 0.0005, 0.002, 0.01]))
        losses = rng.binomial(20, p, n) / 20
        full = calibrate.hoeffding_bentkus_p(losses, 0.01) <= 0.05
        out = certify.certify_sequence([0], n, lambda h, u: {"loss": losses[u], "identical": True, "exited": False,
                                                             "steps": 20, "layers": 0}, 0.01, 0.05)
        assert bool(out["certified"]) == full


def test_no_run_is_spent_where_even_zero_loss_cannot_pass():
    out = certify.certify_sequence([0, 1], 100, lambda h, u: pytest.fail("ran a unit"), 0.01, 0.05)
    assert out["certified"] == 0 and out["tested"] == [] and out["units_needed_at_zero_loss"] == 299


def _refute(wrong_shares, fast, n=400, max_new=32, delta=0.01, eps=0.05):
    pts = [{"index": j, "value": 1 - j / 10, "fast": f, "first_exit_wrong": [1] * int(w * n) + [0] * (n - int(w * n))}
           for j, (w, f) in enumerate(zip(wrong_shares, fast))]
    return certify.refutation(pts, delta, eps, max_new)


def test_refutation_needs_every_fast_point_over_budget():
    """A slow point's loss does not matter; every fast point's lower bound must clear delta, and the
    bounds carry the correction for how many fast points there are."""
    r = _refute([0.0, 0.9, 0.9], [False, True, True])
    assert r["refuted"] and r["fast_points"] == 2 and "epsilon/2" in r["correction"]
    assert all(p["loss_lower_bound"] > 0.01 for p in r["points"])
    r = _refute([0.0, 0.9, 0.1], [False, True, True])  # 10 % wrong first exits: at most 0.3 % of tokens shown
    assert not r["refuted"] and r["short"] == [0.8]
    one = _refute([0.45], [True])["points"][0]["loss_lower_bound"]
    many = _refute([0.45] * 8, [True] * 8)["points"][0]["loss_lower_bound"]
    assert many < one  # the Bonferroni correction widens each bound


def _cal(chosen=0, test_loss=0.0):
    return {"chosen": chosen, "value": 0.9, "kv_policy": "holes", "test_loss": test_loss, "modelled_speedup": 0.9,
            "why_none": "no point certified: 80 calibration prompts, and a loss of 0 needs 299"}


def test_a_slow_certified_point_with_a_fast_point_in_budget_is_inconclusive_not_refuted():
    """The LTT-chosen point is slower than dense, but a faster point is not shown over budget: the
    existential claim stays open."""
    slow = {"speedup": 0.88, "speedup_ci": [0.87, 0.89]}
    refute = _refute([0.0, 0.9, 0.01], [False, True, True])
    v, why = joint_verdict(_cal(), slow, refute, 0.01)
    assert v == "inconclusive" and "slower than dense" in why and "not shown over budget" in why
    v, _ = joint_verdict(_cal(), slow, _refute([0.0, 0.9, 0.9], [False, True, True]), 0.01)
    assert v == "refuted"


def test_confirmed_needs_a_certified_point_measured_faster():
    fast = {"speedup": 1.2, "speedup_ci": [1.1, 1.3]}
    assert joint_verdict(_cal(), fast, None, 0.01)[0] == "confirmed"
    assert joint_verdict(_cal(), {"speedup": 1.05, "speedup_ci": [0.97, 1.12]}, None, 0.01)[0] == "inconclusive"
    v, why = joint_verdict(_cal(chosen=None), fast, _refute([0.01], [True]), 0.01)
    assert v == "inconclusive" and why.startswith("units:")


def test_a_grid_that_never_reaches_dense_speed_is_refuted_and_a_grid_that_exits_at_once_says_so():
    r = _refute([0.0, 0.0], [False, False])
    v, why = joint_verdict(_cal(chosen=None), None, r, 0.01, never_exit_first=False)
    assert v == "refuted" and "no grid point's speed reaches 1x" in why and "not the never-exit point" in why


def test_the_stratified_timing_sample_covers_every_category():
    from experiments.frontier import stratified_sample
    cats = {"mt_bench": 40, "translation": 40, "summarization": 40, "qa": 40, "math_reasoning": 40, "rag": 40}
    prompts = [{"id": f"{c}{i}", "category": c} for c, n in sorted(cats.items()) for i in range(n)]
    for k in (3, 6, 8, 13):
        s = stratified_sample(prompts, k, seed=0)
        assert {p["category"] for p in s} == set(cats) and len(s) == max(k, 6)
        counts = [sum(p["category"] == c for p in s) for c in cats]
        assert max(counts) - min(counts) <= 1
    assert stratified_sample(prompts, 8, 0) == stratified_sample(prompts, 8, 0) != stratified_sample(prompts, 8, 1)


def test_the_fit_split_and_the_calibration_split_are_disjoint():
    from experiments.frontier import fit_split
    units = [certify.Unit(f"p{i}", None, []) for i in range(40)]
    fit, ltt = fit_split(units, 0.25, seed=0)
    assert fit and ltt and not fit & ltt and fit | ltt == {u.id for u in units} and len(fit) == 10
