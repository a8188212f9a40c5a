"""experiment=frontier: replay against the real decoder, monotone frontiers, Learn-then-Test's
guarantee on synthetic losses whose truth is known, and the recipe end to end on tiny."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, run_cli
from specee.frontier import calibrate
from specee.frontier.record import record_generation
from specee.frontier.replay import Policy, generation_metrics, layer_thresholds, oracle_exits, oracle_orders, replay


def _cfg(*over):
    from hydra import compose, initialize_config_dir
    from specee.config import register
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", ["model=tiny", *over])


@pytest.fixture(scope="module")
def tiny_setup(tiny):
    from specee.bench.inputs import load_prompts
    from specee.builders import build_decoder
    from specee.decoding.dense import DenseDecoder
    from specee.prompts import PromptEncoder
    from specee.runtime.layerwise import LayerwiseLM
    model, tok = tiny
    rt = LayerwiseLM(model)
    cfg_t2 = _cfg("ablation=specee_t1_t2", "dataset.count=1", "dataset.offset=30")
    cfg_t1 = _cfg("ablation=specee_t1")
    cfg_svm = _cfg("ablation=adainfer")
    decs = {"t2": build_decoder(cfg_t2, rt), "t1": build_decoder(cfg_t1, rt), "svm": build_decoder(cfg_svm, rt)}
    enc = PromptEncoder.for_runtime(tok, rt, 24)
    prompts = [enc(p["text"]) for p in load_prompts(cfg_t2)[:4]]
    dense = DenseDecoder(rt)
    gens = [dense.generate(ids, 24, None).tokens for ids in prompts]
    d = decs["t2"]
    recs = [record_generation(rt, d.draft, {"bank": d.predictors}, d.k, ids, g, svm=decs["svm"].svm)
            for ids, g in zip(prompts, gens)]
    return rt, decs, prompts, gens, recs


def _policy(dec, kind="specee"):
    if kind == "svm":
        return Policy("adainfer", "adainfer", "svm", "margin", [0.5, 0.0, -0.3])
    return Policy("p", "p", "specee", "threshold", [0.9, 0.5, 0.2], bank="bank", schedule=dec.schedule,
                  can_exit=list(dec.can_exit))


def test_records_taken_together_equal_records_taken_alone(tiny_setup):
    """A multiple-choice item's requests are recorded in one pass (one LM-head product per layer
    over all their rows): each record equals the one its request gets alone — the same argmax and
    speculative sets at every step and layer, scores and log-probabilities to float rounding."""
    from specee.frontier.record import record_request, record_requests
    rt, decs, prompts, gens, recs = tiny_setup
    d = decs["t2"]
    svm = decs["svm"].svm
    reqs = []
    for n, (ids, g) in enumerate(zip(prompts, gens)):  # scored from n tokens before the prompt's end
        full = torch.cat([ids, torch.tensor([g])], 1)
        first = ids.shape[1] - 1 - n
        reqs.append((full[:, :-1], first, full[0, first + 1:].tolist()))
    together = record_requests(rt, d.draft, {"bank": d.predictors}, d.k, reqs, svm=svm)
    assert len(together) == len(reqs)
    for (ids, first, targets), rec in zip(reqs, together):
        alone = record_request(rt, d.draft, {"bank": d.predictors}, d.k, ids, first, targets, svm=svm)
        assert rec.steps == alone.steps == ids.shape[1] - first == len(targets)
        np.testing.assert_array_equal(rec.argmax, alone.argmax)
        np.testing.assert_array_equal(rec.spec, alone.spec)
        np.testing.assert_array_equal(rec.exitable, alone.exitable)
        np.testing.assert_array_equal(rec.targets, alone.targets)
        np.testing.assert_allclose(rec.scores["bank"], alone.scores["bank"], rtol=1e-4, atol=1e-4, equal_nan=True)
        np.testing.assert_allclose(rec.logp, alone.logp, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(rec.svm, alone.svm, rtol=1e-4, atol=1e-4)


def test_recording_lm_answers_as_dense_lm_eval_does(tiny_setup, tiny):
    """The recording lm-eval model groups requests by context to record them together; its answers
    still come back in lm-eval's order and equal the dense decoder's (log-likelihood, greedy)."""
    from lm_eval.api.instance import Instance
    from specee.decoding.dense import DenseDecoder
    from specee.evaluation.lm import SpeceeLM
    from specee.frontier.tasks import RecordingLM
    rt, decs, *_ = tiny_setup
    _, tok = tiny
    d = decs["t2"]
    contexts = ["Once upon a time there was a", "The little dog ran to the"]
    conts = [" girl", " big red ball that", " park.", " house and"]
    args = [(contexts[n % 2], conts[n % 4]) for n in range(7)]  # two items' choices, interleaved
    reqs = [Instance("loglikelihood", {}, a, n, ("t", n % 2, 1)) for n, a in enumerate(args)]
    rec_lm = RecordingLM(rt, tok, {"draft": d.draft, "banks": {"bank": d.predictors}}, d.k)
    rec_lm.GROUP = 3  # an item's choices split over more than one pass, too
    got = rec_lm.loglikelihood(reqs, disable_tqdm=True)
    want = SpeceeLM(DenseDecoder(rt), tok, prefix_reuse=False).loglikelihood(reqs, disable_tqdm=True)
    assert [g[1] for g in got] == [w[1] for w in want]
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-4, atol=1e-4)
    assert len({round(g[0], 3) for g in got}) > 2  # the answers differ: order matters
    assert set(rec_lm.recorded) == {("t", n % 2, n) for n in range(7)}


@pytest.mark.parametrize("which", ["t1", "t2"])
@pytest.mark.parametrize("threshold", [0.2, 0.5, 0.9])
def test_replayed_exits_equal_real_exits_until_the_first_exit(tiny_setup, which, threshold):
    """Where replay is exact — every step up to and including a sequence's first exit (before it the
    decoder's K/V, draft feature and schedule are dense's) — the replayed exit layer, emitted token
    and work (predictor calls, verification heads) equal the real decoder's, step for step."""
    rt, decs, prompts, gens, recs = tiny_setup
    dec = decs[which]
    dec.predictors.set_threshold(threshold)
    pol = _policy(dec)
    thr = layer_thresholds(pol, threshold, recs)
    compared = exits_seen = 0
    for ids, rec in zip(prompts, recs):
        real = dec.generate(ids, 24, None)
        ex = replay(rec, pol, thr)
        for t, step in enumerate(real.trace):
            assert step["exit_layer"] == ex.layer[t], (t, step["exit_layer"], ex.layer[t])
            assert real.tokens[t + 1] == ex.token[t]
            assert step["pred_calls"] == ex.pred_calls[t] and step["verify_calls"] == ex.verify_calls[t]
            compared += 1
            if step["exit_layer"] < rt.num_layers - 1:
                exits_seen += 1
                break
    assert compared > 0
    if threshold <= 0.5:
        assert exits_seen > 0  # the comparison reached an exit, not only full-stack steps


def test_a_monotone_threshold_grid_gives_monotone_layers(tiny_setup):
    """All-layer predictors (no schedule history): a lower threshold fires at a superset of layers,
    so no step exits later; the SVM's margin likewise. Average layers never grow down the grid."""
    _, decs, _, _, recs = tiny_setup
    for pol, grid in ((_policy(decs["t1"]), [0.99, 0.9, 0.7, 0.5, 0.3, 0.1, 0.01]),
                      (_policy(None, "svm"), [1.5, 0.5, 0.0, -0.3, -1.0])):
        layers = [generation_metrics(recs, [replay(r, pol, layer_thresholds(pol, v, recs) if pol.kind == "specee"
                                                   else v) for r in recs])["avg_layers"] for v in grid]
        assert all(a >= b for a, b in zip(layers, layers[1:])), layers
        assert layers[0] > layers[-1]  # the grid moves something on tiny


def test_the_oracle_is_lossless_at_no_budget_and_bounds_every_policy(tiny_setup):
    _, decs, _, _, recs = tiny_setup
    ex = [oracle_exits(r) for r in recs]
    g = generation_metrics(recs, ex)
    assert g["token_disagreement"] == 0.0
    pol = _policy(decs["t1"])
    lossless = 0
    for v in (0.9999, 0.99, 0.9, 0.5, 0.2):
        p = generation_metrics(recs, [replay(r, pol, layer_thresholds(pol, v, recs)) for r in recs])
        if p["token_disagreement"] == 0:
            assert p["avg_layers"] >= g["avg_layers"]  # no lossless rule exits earlier than the oracle
            lossless += 1
    assert lossless >= 1  # the comparison ran (a near-1 threshold replays without a differing token)
    spent = [oracle_exits(r, o) for r, o in zip(recs, oracle_orders(recs, 0.1))]
    gb = generation_metrics(recs, spent)
    assert gb["avg_layers"] < g["avg_layers"] and gb["token_disagreement"] <= 0.1 + 1e-9


@pytest.mark.parametrize("bound", ["binomial", "hoeffding_bentkus"])
def test_learn_then_test_keeps_its_guarantee_where_the_truth_is_known(bound):
    """Synthetic policies whose true loss per point is known: over many seeds the chosen point's
    true loss exceeds delta in at most an epsilon share of them; choosing by the empirical loss alone
    (the naive rule) violates far more often, so the test can tell the two apart."""
    rng = np.random.default_rng(0)
    delta, eps, n, seeds = 0.05, 0.1, 300, 400
    true = np.array([0.0, 0.01, 0.03, 0.045, 0.051, 0.07, 0.1])  # conservative -> fast
    lt_bad = naive_bad = 0
    for _ in range(seeds):
        if bound == "binomial":
            losses = [rng.random(n) < p for p in true]
        else:  # bounded losses in [0, 1] with mean p: a share of 10 Bernoulli tokens per unit
            losses = [rng.binomial(10, p, n) / 10 for p in true]
        lt = calibrate.fixed_sequence(losses, delta, eps, bound)
        if lt["certified"] and true[lt["certified"] - 1] > delta:
            lt_bad += 1
        ok = [j for j, l in enumerate(losses) if l.mean() <= delta]
        if ok and true[max(ok)] > delta:
            naive_bad += 1
    assert lt_bad / seeds <= eps
    assert naive_bad / seeds > 2 * eps


def test_the_binomial_lower_bound_is_clopper_pearsons():
    """On binary losses the lower bound is the exact (Clopper-Pearson) one."""
    from scipy.stats import beta
    for k in (1, 15, 90, 299):
        losses = np.r_[np.ones(k), np.zeros(300 - k)]
        assert calibrate.lower_bound(losses, 0.05, "binomial") == pytest.approx(beta.ppf(0.05, k, 300 - k + 1), abs=1e-6)
    assert calibrate.lower_bound(np.zeros(300), 0.05, "binomial") == pytest.approx(0.0, abs=1e-6)


def test_the_bounded_lower_bound_keeps_its_confidence_where_the_truth_is_known():
    """Hoeffding-Bentkus on losses in [0, 1]: over many seeds the (1 - epsilon) lower bound exceeds the
    true loss in at most an epsilon share of them, and it is not vacuous: well above 0.1 it clears 0.1."""
    rng = np.random.default_rng(1)
    eps, n, seeds = 0.1, 300, 300
    for true in (0.005, 0.05, 0.3):
        above = cleared = 0
        for _ in range(seeds):
            losses = rng.binomial(10, true, n) / 10
            lb = calibrate.lower_bound(losses, eps, "hoeffding_bentkus")
            assert lb <= losses.mean() + 1e-9
            above += lb > true
            cleared += lb > 0.1
        assert above / seeds <= eps
        if true == 0.3:
            assert cleared / seeds > 0.95


def test_calibration_says_why_no_point_passes_the_replay_screen():
    from importlib import import_module
    frontier = import_module("experiments.frontier")
    rows = [{"value": v, "calibration": {"per_request_loss": [0.0] * 13, "modelled_speedup": 1.0},
             "test": {"per_request_loss": [0.0] * 13, "modelled_speedup": 1.0, "avg_layers": 30.0}} for v in (0.9, 0.5)]
    cal = frontier.calibrate_policy(rows, 0.01, 0.05, "hoeffding_bentkus", lambda r, h: r[h]["per_request_loss"])
    assert cal["chosen"] is None and "needs 299" in cal["why_none"] and cal["on"] == "replay"
    assert calibrate.min_units(0.01, 0.05, "binomial") == 299
    rows = [{"value": v, "calibration": {"per_request_loss": [0.0] * 400, "modelled_speedup": s},
             "test": {"per_request_loss": [0.0] * 40, "modelled_speedup": s, "avg_layers": 30.0}}
            for v, s in ((0.9, 0.9), (0.5, 1.2))]
    cal = frontier.calibrate_policy(rows, 0.01, 0.05, "hoeffding_bentkus", lambda r, h: r[h]["per_request_loss"])
    assert cal["chosen"] == 1 and cal["held_out_within_budget"] and cal["calibration_bound"] <= 0.01
    lo, hi = cal["test_interval"]
    assert lo == 0.0 and 0.05 < hi < 0.2  # 40 held-out prompts with no loss: consistent with a few percent


@pytest.mark.parametrize("over, says", [
    ("experiment.delta=0", "experiment.delta=0.0 must lie strictly between 0 and 1"),
    ("experiment.epsilon=1.0", "experiment.epsilon=1.0 must lie strictly between 0 and 1"),
    ("experiment.threshold_grid=[]", "experiment.threshold_grid has 0 point(s)"),
    ("experiment.extra_deltas=[2]", "experiment.extra_deltas has 2.0, which must lie strictly between 0 and 1"),
    ("experiment.tasks=[nope]", "experiment.tasks has 'nope', not a shipped task"),
    ("experiment.policies=[]", "experiment.policies is empty"),
    ("experiment.kv_policies=[holes,leaky]", "experiment.kv_policies has 'leaky', which is unknown; valid: holes, propagate"),
    ("experiment.kv_policies=[]", "experiment.kv_policies is empty"),
    ("experiment.fit_share=1.5", "experiment.fit_share=1.5 must lie in [0, 1]"),
    ("experiment.fit_share=0", "experiment.fit_share=0.0 leaves a fitted policy nothing to fit on"),
    ("experiment.max_new_tokens=1", "experiment.max_new_tokens=1: a frontier needs at least 2"),
    ("experiment.calibration_share=1", "experiment.calibration_share=1.0 leaves a split empty"),
    ("experiment.calibration_share=0.0", "experiment.calibration_share=0.0 leaves a split empty"),
])
def test_bad_budget_or_grid_is_one_line(over, says, tmp_path):
    res = run_cli("experiment=frontier", over, f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 2
    assert says in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("share", [0.5, 0.75, 0.3])
def test_the_split_keeps_its_share_overall_and_per_category(share):
    """Disjoint, seeded, ``share`` of the prompts in calibration (to one prompt), each category split
    at the same share; at 0.5 every other prompt, as the committed reports were split."""
    from experiments.frontier import split
    cats = {"a": 80, "b": 80, "c": 10, "d": 10, "e": 1}
    prompts = [{"id": f"{c}{i}", "category": c} for c, n in cats.items() for i in range(n)]
    calib, test = split(prompts, 0, share)
    ids_c, ids_t = [p["id"] for p in calib], [p["id"] for p in test]
    assert not set(ids_c) & set(ids_t) and len(ids_c) + len(ids_t) == len(prompts)
    assert abs(len(calib) - share * len(prompts)) <= 1
    for c, n in cats.items():
        assert abs(sum(p["category"] == c for p in calib) - share * n) <= 1
    assert split(prompts, 0, share) == (calib, test) and split(prompts, 1, share) != (calib, test)
    if share == 0.5:
        assert len(calib) == len(test) + 1  # 181 prompts, the first to calibration


MINIMAL = ["experiment=frontier", "model=tiny", "experiment.count=1", "experiment.max_new_tokens=6",
           "experiment.delta=0.5", "experiment.fit_share=0.3",
           "experiment.timed_prompts=2", "experiment.cost_rounds=3", "experiment.measured_points=1",
           "experiment.real_only_grid=[0.5]", "experiment.lossless_peers=[pld]",
           "experiment.policies=[specee_t1_t2,specee_t1_t2_tuned,adainfer,calm_saturation]",
           "experiment.threshold_grid=[0.9,0.5,0.2]", "experiment.precision_grid=[0.95,0.7]",
           "experiment.margin_grid=[0.5,-0.3]"]


def test_frontier_end_to_end_on_tiny(tmp_path):
    """The recipe at minimal size: every policy's points with speed and quality, the oracle, the
    calibration block, measured points beside replayed ones, the report and the verdict rows."""
    report = tmp_path / "report"
    res = run_cli(*MINIMAL, f"experiment.report_dir={report}", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    m = doc["metrics"]
    assert set(m["curves"]) == {"specee_t1_t2", "specee_t1_t2_tuned", "adainfer", "calm_saturation"}
    assert m["policies"]["calm_saturation"]["knob"] == "threshold"  # an exit rule's own knob and grid
    for name, rows in m["curves"].items():
        assert len(rows) >= 2
        for r in rows:
            t = r["test"]
            assert 1 <= t["avg_layers"] <= m["num_layers"] and 0 <= t["token_disagreement"] <= 1
            assert t["modelled_speedup"] > 0 and len(t["modelled_band"]) == 2
        cal = m["calibration"][name]
        assert cal["on"] == "real decoding" and cal["tested"] and cal["delta"] == 0.5
        tested = [(t["index"], t["kv_policy"]) for t in cal["tested"]]
        order = [(j, kv) for j in range(len(rows)) for kv in ("holes", "propagate")]
        assert tested == order[: len(tested)]  # the fixed order, conservative first, stopped at the first failure
        if cal["chosen"] is not None:
            assert cal["test_units"] == m["prompts"]["test"] and len(cal["test_interval"]) == 2
            assert cal["test_interval"][0] <= cal["test_loss"] <= cal["test_interval"][1]
        assert name in m["refutation"]
        assert m["measured"][name] and all(len(p["speedup_ci"]) == 2 for p in m["measured"][name])
    assert m["oracle"][0]["token_disagreement"] == 0
    # the tuned bank is fitted on prompts its Learn-then-Test never sees; the others use every calibration prompt
    fit, ltt = set(m["units"]["fit"]), m["units"]["calibration"]
    assert fit and not fit & set(ltt["specee_t1_t2_tuned"]) and fit <= set(ltt["specee_t1_t2"])
    assert len(ltt["specee_t1_t2_tuned"]) == m["calibration"]["specee_t1_t2_tuned"]["calibration_units"]
    assert m["prompts"]["timed_categories"] == m["prompts"]["test_categories"]
    assert m["measured"]["specee_full"] and m["lossless_peers"]["pld"]["sequence_identity"] == 1.0
    assert m["verdicts"] and {v["verdict"] for v in m["verdicts"]} <= {"confirmed", "refuted", "inconclusive",
                                                                        "not testable"}
    summary = (report / "summary.md").read_text()
    assert "At the budget δ = 0.5: Spec-Bench, certified on real decoding" in summary and (report / "frontier.png").stat().st_size > 1000
    from specee.frontier.pages import verdict_table_rows
    assert len(verdict_table_rows([doc])) == len(m["verdicts"])


@pytest.mark.slow
def test_frontier_with_a_task_on_tiny(tmp_path):
    """Task replay through lm-eval: per point accuracy change with its interval; tiny sits at chance
    on PIQA, so its verdict is 'not testable'."""
    report = tmp_path / "report"
    res = run_cli(*MINIMAL, "experiment.tasks=[piqa]", "experiment.task_limit=6", f"experiment.report_dir={report}",
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads((tmp_path / "run" / "results.json").read_text())["metrics"]
    piqa = m["tasks"]["piqa"]
    assert piqa["dense"]["test"]["n"] + piqa["dense"]["calibration"]["n"] == 6
    for pts in piqa["points"].values():
        for p in pts:
            assert len(p["test"]["delta_ci"]) == 2 and len(p["test"]["flips"]) == p["test"]["n"]
    assert any(v["task"] == "piqa" for v in m["verdicts"])


def test_agreement_near_budget_reads_only_the_points_a_budget_can_choose():
    """The stated tolerance of replay against reality covers the measured points whose replayed
    disagreement is within the largest calibrated budget; a far, degenerate point does not widen it."""
    from specee.frontier.pages import agreement_near_budget

    def row(dis, layers_gap, dis_gap, modelled, measured):
        return {"replay_disagreement": dis, "real_disagreement": dis + dis_gap, "replay_avg_layers": 30.0,
                "real_avg_layers": 30.0 - layers_gap, "modelled_speedup": modelled, "measured_speedup": measured}
    m = {"delta": 0.01, "screen_at": {"0.01": {}, "0.05": {}},
         "replay_vs_real": {"a": {"points": [row(0.0, 0.1, 0.01, 0.8, 0.8), row(0.04, 0.3, -0.02, 0.9, 1.0)]},
                            "b": {"points": [row(0.5, 7.0, 0.6, 4.0, 1.0)]}}}
    near = agreement_near_budget(m)
    assert near["budget"] == 0.05 and near["points"] == 2
    assert near["layers"] == pytest.approx(0.3) and near["disagreement"] == pytest.approx(0.02)
    assert near["speed"] == pytest.approx(0.1)
    m["screen_at"] = {"0.01": {}}
    assert agreement_near_budget(m)["points"] == 1
    m["replay_vs_real"]["a"]["points"] = []
    assert agreement_near_budget(m) is None


@pytest.mark.parametrize("which, value", [("t2", 0.999), ("t2", 0.5), ("t2", 0.2), ("svm", -0.3)])
@pytest.mark.parametrize("kv", ["holes", "propagate"])
def test_a_wrong_first_exit_bounds_the_real_loss_from_below(tiny_setup, which, value, kv):
    """Refutation reads replay only up to each prompt's first exit: where that exit's token is not the
    full stack's, the real decoder (under either K/V policy) loses at least one token in that prompt."""
    from specee.frontier.certify import Unit, dense_result, exits_at_all, first_exit_wrong, own_context_loss
    rt, decs, prompts, gens, recs = tiny_setup
    dec = decs[which]
    pol = _policy(dec, "svm" if which == "svm" else "specee")
    if which == "svm":
        dec.svm.margin = value
        thr = value
    else:
        dec.predictors.set_threshold(value)
        thr = layer_thresholds(pol, value, recs)
    dec.kv_policy = kv
    wrong_seen, silent = 0, 0
    for ids, g, rec in zip(prompts, gens, recs):
        ex = replay(rec, pol, thr)
        w = first_exit_wrong(rec, ex)
        real = dec.generate(ids, 24, None)
        r = own_context_loss(rt, Unit("p", ids, g), real.tokens, real.layers_run)
        assert r["loss"] >= w / 23 - 1e-12, (r["loss"], w)
        wrong_seen += w
        # certification skips the real run where replay never exits: it must be dense's, step for step
        assert r["exited"] == exits_at_all(rec, ex)
        if not exits_at_all(rec, ex):
            assert r == dense_result(rt, Unit("p", ids, g))
            silent += 1
    dec.kv_policy = "holes"
    if which == "t2" and value == 0.2:
        assert wrong_seen > 0  # the bound is exercised, not only 0 <= loss
    if which == "t2" and value == 0.999:
        assert silent > 0  # the no-exit shortcut is exercised


def test_own_context_loss_is_zero_exactly_for_dense_output_and_counts_full_stack_disagreements(tiny_setup):
    from specee.frontier.certify import Unit, full_stack_tokens, own_context_loss
    rt, decs, prompts, gens, recs = tiny_setup
    ids, g = prompts[0], gens[0]
    assert full_stack_tokens(rt, ids, g) == g[1:]  # dense greedy output is the full stack's at every prefix
    r = own_context_loss(rt, Unit("p", ids, g), g, [rt.num_layers] * len(g))
    assert r["loss"] == 0 and r["identical"] and not r["exited"]
    bad = g[:5] + [(g[5] + 1) % 100] + g[6:]  # one foreign token: it and what follows at their own prefixes
    r = own_context_loss(rt, Unit("p", ids, g), bad, [rt.num_layers] * len(bad))
    full = full_stack_tokens(rt, ids, bad)
    assert r["loss"] == pytest.approx(sum(t != f for t, f in zip(bad[1:], full)) / (len(bad) - 1)) and r["loss"] > 0


def test_the_tuned_thresholds_are_fitted_on_the_fit_split_only(tiny_setup, monkeypatch):
    """A fitted policy's per-layer thresholds depend on the fit split and on nothing its calibration
    reads: the same fit split with other calibration records gives the same thresholds."""
    from importlib import import_module

    import specee.cost_model.priced_work as cm
    frontier = import_module("experiments.frontier")
    rt, decs, prompts, gens, recs = tiny_setup
    pol = Policy("tuned", "tuned", "specee", "target_precision", [0.9, 0.7], bank="bank", schedule=decs["t2"].schedule,
                 can_exit=list(decs["t2"].can_exit), per_layer=True, min_fires=1, mode="specee")
    # speed is not what this test reads: the cost model's prices are left out
    monkeypatch.setattr(cm, "modelled_speedup", lambda *a, **k: {"value": 1.0, "band": [1.0, 1.0]})
    a = frontier.evaluate_point(pol, 0.7, recs[:2], recs[2:3], recs[3:], {}, {}, rt.num_layers)
    b = frontier.evaluate_point(pol, 0.7, recs[:2], recs[3:], recs[2:3], {}, {}, rt.num_layers)
    c = frontier.evaluate_point(pol, 0.7, recs[2:], recs[:1], recs[1:2], {}, {}, rt.num_layers)
    assert a["thresholds"] == b["thresholds"]
    assert a["thresholds"] != c["thresholds"]


def test_closest_to_the_reference_names_the_fastest_point_within_the_budget_and_the_certified_one():
    from specee.frontier.pages import closest_to_oracle

    def row(value, loss, speed):
        return {"value": value, "test": {"per_request_loss": [loss, loss], "modelled_speedup": speed}}
    m = {"curves": {"a": [row(0.9, 0.0, 0.8), row(0.5, 0.004, 1.1), row(0.2, 0.2, 3.0)],
                    "b": [row(0.9, 0.0, 0.9), row(0.5, 0.02, 2.0)]},
         "policies": {"a": {"label": "A", "knob": "threshold"}, "b": {"label": "B", "knob": "threshold"}},
         "calibration": {"a": {"chosen": 0, "modelled_speedup": 0.8}, "b": {"chosen": None}}}
    line = closest_to_oracle(m, 0.01, {"modelled_speedup": 1.5})
    assert "**A** at threshold = 0.5, 1.100×" in line and "1.500×" in line and "A's (0.800× modelled)" in line
    m["calibration"]["a"]["chosen"] = None
    assert "no policy is certified" in closest_to_oracle(m, 0.01, {"modelled_speedup": 1.5})
    assert "no policy has a grid point" in closest_to_oracle(m, -1, {"modelled_speedup": 1.5})


# A user's own tasks, written here (synthetic test data: story openings in the register of the
# embedded model's corpus, with plausible one-word continuations as golds and a nonsense word as the
# wrong choice). They exercise the recipe's machinery, not model quality.
STORIES = [("Once upon a time, there was a little", "girl"), ("One day, Lily went to the", "park"),
           ("Tom and his mom went to the", "park"), ("She was very", "happy"), ("They all lived happily ever", "after"),
           ("He liked to play with his", "toys"), ("The little girl was very", "happy"), ("Lily and her mom went to the", "park"),
           ("Once upon a time, there was a big", "dog"), ("The boy was so", "happy"), ("Every day, Tom went to the", "park"),
           ("The bird was very", "happy"), ("One day, a little boy named", "Tim"), ("Sue liked to play with her", "doll"),
           ("Once upon a time, in a small", "town"), ("The dog was very", "happy")]


def _own_tasks(tmp_path):
    rows = [{"question": q, "answer": a, "choices": [a, "xqzvtk"], "label": 0} for q, a in STORIES]
    data = tmp_path / "stories.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "story_choice.yaml").write_text(
        "task: story_choice\noutput_type: multiple_choice\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files: {{test: {data}}}\ntest_split: test\nnum_fewshot: 0\n"
        "doc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
        "target_delimiter: \" \"\nmetric_list:\n  - metric: acc\n")
    (tasks / "story_word.yaml").write_text(
        "task: story_word\noutput_type: generate_until\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files: {{test: {data}}}\ntest_split: test\n"
        "doc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs: {until: [\".\"], do_sample: false, max_gen_toks: 4}\n"
        "filter_list:\n  - name: first_word\n    filter:\n      - function: regex\n        regex_pattern: \"(\\\\w+)\"\n"
        "      - function: take_first\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n    ignore_case: true\n")
    return tasks


def test_a_users_own_tasks_run_on_the_frontier_and_are_certified_on_real_answers(tmp_path):
    """A multiple-choice and a generate_until task (regex filter) from experiment.include_path: their
    settings as the task ran them, dense scored by lm-eval, and per policy a point certified on the real
    decoder's answers or a reason why not; the real answers are scored by the task's own filter."""
    tasks = _own_tasks(tmp_path)
    res = run_cli(*MINIMAL, "experiment.policies=[specee_t1_t2,adainfer]", "experiment.lossless_peers=[]",
                  "experiment.real_only=[]", "experiment.tasks=[story_choice,story_word]",
                  f"experiment.include_path={tasks}", "experiment.task_limit=16", "experiment.max_gen_tokens=4",
                  f"experiment.report_dir={tmp_path / 'report'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads((tmp_path / "run" / "results.json").read_text())["metrics"]
    choice, word = m["tasks"]["story_choice"], m["tasks"]["story_word"]
    assert choice["output_type"] == "multiple_choice" and word["output_type"] == "generate_until"
    assert word["filter"] == "first_word" and word["primary"] == "exact_match"
    assert word["settings"]["generation_kwargs"]["max_gen_toks"] == 4
    assert word["settings"]["filter_list"][0]["name"] == "first_word" and choice["settings"]["target_delimiter"] == " "
    assert choice["source"] == word["source"] == "experiment.include_path"
    for t in (choice, word):
        assert t["n"] == 16 and t["testable"], t.get("why_not_testable")  # dense writes most continuations
        assert t["scoring_checked"] == 16  # the harness's item scoring equals lm-eval's on dense's answers
        for name in ("specee_t1_t2", "adainfer"):
            cal = t["calibration"][name]
            assert cal["on"] == "real decoding" and cal["bound"] == "binomial" and cal["tested"]
            tested = [(x["index"], x["kv_policy"]) for x in cal["tested"]]
            order = [(j, kv) for j in range(len(t["points"][name])) for kv in ("holes", "propagate")]
            assert tested == order[: len(tested)]
            assert cal["chosen"] is not None or cal["why_none"]
            assert any(v["task"] == t["name"] and v["policy"] == name for v in m["verdicts"])
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "### story_word" in summary and "real decoding, δ = 0.5" in summary


def test_a_replayed_generation_keeps_denses_answer_only_while_every_token_is_denses(tiny_setup):
    """The screen for a generative item: dense's value where replay emits dense's token at every step;
    0 (unknown text) as soon as one differs; and an item with an exit is marked as needing a real run."""
    from specee.frontier.tasks import _item_value
    rt, decs, prompts, gens, recs = tiny_setup
    pol = _policy(decs["t2"])
    task = {"output_type": "generate_until", "rolling": False}
    item = {"records": [[recs[0]]], "dense": 1.0}
    v, layers, _, exits = _item_value(task, item, lambda rec: replay(rec, pol, np.full(32, 10.0)))  # never fires
    assert (v, layers, exits) == (1.0, 32.0, False)
    thr = np.full(32, -10.0)  # fires wherever a predictor runs
    ex = replay(recs[0], pol, thr)
    v, _, _, exits = _item_value(task, item, lambda rec: replay(rec, pol, thr))
    assert exits and v == (1.0 if (ex.token == recs[0].final).all() else 0.0)


def test_each_row_claims_in_its_own_policy_name():
    """SpecEE's rows test the paper's claim; a peer's (AdaInfer, an exit rule) its own, never SpecEE's."""
    from specee.frontier.pages import claim_of
    assert claim_of({"kind": "specee", "label": "T1+T2"}).startswith("SpecEE (T1+T2) is faster")
    for kind, label in (("svm", "AdaInfer (SVM)"), ("crf", "AdaInfer (CRF)"), ("rule", "CALM softmax")):
        text = claim_of({"kind": kind, "label": label})
        assert text.startswith(f"{label} (a peer, not SpecEE)") and "SpecEE (" not in text
    assert claim_of({"label": "T1"}).startswith("SpecEE (T1)")  # a result from before kinds were recorded
