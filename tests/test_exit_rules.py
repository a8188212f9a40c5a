"""Exit rules (specee/exit_rules/): the registry, CALM's measures as the rule says they are, the one
decision both the real decoder and replay take, and what the cost model counts for them."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from conftest import ROOT
from specee.decoding import modes
from specee.exit_rules import registered
from specee.frontier.record import record_generation
from specee.frontier.replay import Policy, as_generations, replay

RULES = sorted(registered())


def _cfg(*over):
    from hydra import compose, initialize_config_dir
    from specee.config import register
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", ["model=tiny", *over])


def test_every_rule_is_a_mode_with_its_ablation_and_a_grid_from_the_conservative_end():
    assert {"calm_softmax", "calm_saturation", "calm_classifier"} <= set(RULES)
    for name in RULES:
        rule = registered()[name]
        spec = modes.spec(name)
        assert spec.exit_rule is rule and spec.early_exit and not spec.lossless and spec.costs.rule_probe
        conf = yaml.safe_load((ROOT / "conf" / "ablation" / f"{name}.yaml").read_text())
        assert conf["mode"] == name and conf["name"] == name
        grid = list(rule.grid)
        # the rule fires above its knob: a higher knob is more conservative, so the grid descends
        assert len(grid) >= 2 and grid == sorted(grid, reverse=True) and len(set(grid)) == len(grid)
        assert rule.label and rule.source and rule.knob


@pytest.fixture(scope="module")
def rule_setup(tiny):
    from specee.bench.inputs import load_prompts
    from specee.builders import build_decoder
    from specee.decoding.dense import DenseDecoder
    from specee.prompts import PromptEncoder
    from specee.runtime.layerwise import LayerwiseLM
    model, tok = tiny
    rt = LayerwiseLM(model)
    cfg = _cfg("ablation=specee_t1_t2", "dataset.count=1", "dataset.offset=30")
    t2 = build_decoder(cfg, rt)
    decs = {n: build_decoder(_cfg(f"ablation={n}"), rt) for n in RULES}
    enc = PromptEncoder.for_runtime(tok, rt, 24)
    prompts = [enc(p["text"]) for p in load_prompts(cfg)[:4]]
    dense = DenseDecoder(rt)
    gens = [dense.generate(ids, 24, None).tokens for ids in prompts]
    rules = {n: d.rule for n, d in decs.items()}
    recs = [record_generation(rt, t2.draft, {}, t2.k, ids, g, rules=rules) for ids, g in zip(prompts, gens)]
    return rt, decs, prompts, gens, recs


def _policy(name, rule):
    return Policy(name, name, "rule", rule.knob, list(rule.grid), mode=name, rule=rule)


@torch.inference_mode()
def test_calm_scores_are_the_measures_the_paper_defines(rule_setup):
    """Softmax response = top-1 minus top-2 probability of the layer's LM head; saturation = cosine
    of the layer's state with its input — each recomputed here from the states, independently."""
    rt, decs, prompts, gens, recs = rule_setup
    ids = torch.cat([prompts[0], torch.tensor([gens[0][:-1]])], 1)
    first = prompts[0].shape[1]
    hs = [rt.embed(ids)]
    cache = rt.new_cache(ids.shape[1])
    pos = rt.positions(cache, ids.shape[1])
    rope = rt.rope(hs[0], pos)
    for i in range(rt.num_layers):
        hs.append(rt.run_layer(i, hs[-1], rope, cache, None, pos))
    rec = recs[0]
    for i in range(rt.num_layers - 1):
        p = torch.softmax(rt.logits(hs[i + 1])[0, first:].double(), -1).numpy()
        top = np.sort(p, -1)[:, ::-1]
        np.testing.assert_allclose(rec.rules["calm_softmax"][:, i], top[:, 0] - top[:, 1], atol=2e-5)
        a, b = hs[i + 1][0, first:].double().numpy(), hs[i][0, first:].double().numpy()
        cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
        np.testing.assert_allclose(rec.rules["calm_saturation"][:, i], cos, atol=2e-5)
        clf = decs["calm_classifier"].rule
        z = a / np.linalg.norm(a, axis=-1, keepdims=True) @ clf.w.double().numpy() + clf.b
        np.testing.assert_allclose(rec.rules["calm_classifier"][:, i], 1 / (1 + np.exp(-z)), atol=2e-5)
    for name in RULES:  # the last layer never decides
        assert np.isnan(rec.rules[name][:, -1]).all() and not np.isnan(rec.rules[name][:, :-1]).any()


@pytest.mark.parametrize("name", ["calm_softmax", "calm_saturation", "calm_classifier"])
@pytest.mark.parametrize("at", [0, 3, -1])
def test_replayed_exits_equal_the_real_decoders_until_the_first_exit(rule_setup, name, at):
    """Replay and the decoder take the same decision (the rule's own scores and fires): exit layer,
    emitted token, decisions made and the LM head an exit pays, step for step up to the first exit."""
    rt, decs, prompts, gens, recs = rule_setup
    dec = decs[name]
    pol = _policy(name, dec.rule)
    value = pol.grid[at]
    dec.value = value
    compared = exits_seen = 0
    for ids, rec in zip(prompts, recs):
        real = dec.generate(ids, 24, None)
        ex = replay(rec, pol, value)
        trace = as_generations([ex], pol)[0].trace
        for t, step in enumerate(real.trace):
            assert step["exit_layer"] == ex.layer[t], (t, step["exit_layer"], ex.layer[t])
            assert real.tokens[t + 1] == ex.token[t]
            assert step["pred_calls"] == trace[t]["pred_calls"]
            assert step["emit_heads"] == trace[t].get("emit_heads", 0)
            compared += 1
            if step["exit_layer"] < rt.num_layers - 1:
                exits_seen += 1
                break
    assert compared > 0
    if at == -1:
        assert exits_seen > 0  # the fastest point exits somewhere: the comparison reached an exit


def test_a_rule_that_always_fires_emits_layer_zeros_argmax(rule_setup):
    rt, decs, prompts, gens, recs = rule_setup
    dec = decs["calm_softmax"]
    dec.value = -1.0  # p1 - p2 >= 0 > -1: every decision fires at the first layer
    real = dec.generate(prompts[0], 8, None)
    assert all(s["exit_layer"] == 0 and s["pred_calls"] == 1 and s["emit_heads"] == 0 for s in real.trace)
    # the first decision reads dense's context: its token is the record's layer-0 argmax
    assert real.tokens[1] == int(recs[0].argmax[0, 0])
    assert replay(recs[0], _policy("calm_softmax", dec.rule), -1.0).layer.max() == 0


@pytest.mark.parametrize("name, heads_where_exit", [("calm_softmax", 0), ("calm_saturation", 1),
                                                    ("calm_classifier", 1)])
def test_the_cost_model_prices_each_decision_once_and_the_head_an_exit_needs(rule_setup, name, heads_where_exit):
    from specee.cost_model import priced_work as cm
    from specee.decoding.dense import DenseDecoder
    rt, decs, prompts, gens, recs = rule_setup
    dec = decs[name]
    pol = _policy(name, dec.rule)
    L = rt.num_layers
    ex = [replay(r, pol, pol.grid[-1]) for r in recs]
    c = cm.count_work(as_generations(ex, pol), L, name)
    steps = sum(len(e.layer) for e in ex)
    exits = sum(int((e.layer < L - 1).sum()) for e in ex)
    decisions = sum(int(np.where(e.layer < L - 1, e.layer + 1, L - 1).sum()) for e in ex)
    assert exits > 0
    assert c["rule_probes"] == pytest.approx(decisions / steps)
    assert c["priced_predictor_calls"] == pytest.approx(0.0)  # a decision is a rule_probe, not a predictor
    assert c["priced_lm_heads"] == pytest.approx((steps - exits + heads_where_exit * exits) / steps)
    units = cm.measure_unit_costs(rt, dec, DenseDecoder(rt), prompts[0], 8, rounds=2, calls=1, warmup_rounds=0)
    assert "rule_probe" in units["median_us"]
    t, parts = cm.modelled_time_us(c, units["median_us"])
    assert parts["rule_probe"] == pytest.approx(c["rule_probes"] * units["median_us"]["rule_probe"])


# -- CALM's learned classifier: fitted, and its artifact checked as the others are ----------------
def test_the_classifier_fit_recovers_a_separating_direction():
    from specee.exit_rules.calm_classifier import LearnedClassifier
    rng = np.random.default_rng(0)
    u = rng.normal(size=16)
    x = rng.normal(size=(4000, 16))
    y = (x @ u > 0.3).astype(np.int64)
    rule = LearnedClassifier.fit(x[:3000], y[:3000])
    prob = rule.layer_scores(0, None, torch.as_tensor(x[3000:]), None).numpy()  # features: the direction
    # the direction of x is what it reads, and the label here depends on x's scale too: not perfect
    assert ((prob > 0.5) == y[3000:]).mean() > 0.85
    flat = LearnedClassifier.fit(x[:3000], np.zeros(3000, dtype=np.int64))
    assert (flat.layer_scores(0, None, torch.as_tensor(x[3000:]), None).numpy() < 0.1).all()


@pytest.mark.parametrize("damage, says", [
    ("missing", "experiment=train_exit_rules"),
    ("short", "finite numbers (this model's hidden size)"),
    ("other_model", "trained for another base model"),
    ("not_json", "calm_classifier.json"),
])
def test_a_bad_classifier_artifact_is_refused_in_one_line(rule_setup, tmp_path, damage, says):
    import json
    from omegaconf import OmegaConf
    from specee.errors import SpeceeError
    from specee.exit_rules.calm_classifier import FILE, LearnedClassifier
    rt = rule_setup[0]
    good = json.loads((ROOT / "specee" / "artifacts" / "tiny_exit_rules" / FILE).read_text())
    if damage == "short":
        good["coef"] = good["coef"][:-1]
    elif damage == "other_model":
        good["base_weights_fingerprint"] = "0" * 64
    if damage == "not_json":
        (tmp_path / FILE).write_text("{ not json")
    elif damage != "missing":
        (tmp_path / FILE).write_text(json.dumps(good))
    cfg = OmegaConf.create({"early_exit": {"exit_rules_path": str(tmp_path)}})
    with pytest.raises(SpeceeError) as err:
        LearnedClassifier.load(cfg, rt)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_scoring_a_continuation_reads_the_exit_layers_log_probs(rule_setup):
    """experiment=accuracy scores through the rule: a rule that never fires scores as dense does; one
    that fires at the first layer scores every position from layer 0."""
    from specee.decoding.dense import DenseDecoder
    rt, decs, prompts, gens, recs = rule_setup
    dec = decs["calm_softmax"]
    cont = gens[0][:6]
    dense = DenseDecoder(rt).score(prompts[0], cont)
    dec.value = 2.0  # p1 - p2 <= 1: never fires
    never = dec.score(prompts[0], cont)
    np.testing.assert_allclose(never.logprobs, dense.logprobs, atol=1e-4)
    assert never.layers == [rt.num_layers] * len(cont)
    dec.value = -1.0
    first = dec.score(prompts[0], cont)
    assert first.layers == [1] * len(cont)
    assert not np.allclose(first.logprobs, dense.logprobs, atol=1e-3)
