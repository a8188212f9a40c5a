"""Per-layer predictor calibration (beyond the paper): threshold selection on held-out
probabilities, the per_layer decision path, the thresholds stored in the predictors card and their
load-time checks, and the new config options."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from specee.early_exit.predictor import CARD, THRESHOLDS, PredictorBank, select_threshold
from specee.errors import SpeceeError

ART = Path(__file__).resolve().parents[1] / "specee" / "artifacts"
L, K = 5, 3


# -- threshold selection ------------------------------------------------------------------------
PROB = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
Y = np.array([1, 1, 1, 0, 1, 0])
# t -> fires (prob > t), precision: 0.6 -> 3, 3/3; 0.5 -> 4, 3/4; 0.4 -> 5, 4/5; 0 -> 6, 4/6


@pytest.mark.parametrize("target,min_fires,want", [
    (1.0, 1, 0.6), (0.8, 1, 0.4), (0.75, 1, 0.4), (0.7, 1, 0.4), (0.6, 1, 0.0), (0.5, 1, 0.0),
    (1.0, 3, 0.6), (1.0, 4, 1.0),  # precision 1 needs 4 fires: out of reach -> never fire
    (0.8, 6, 1.0), (0.6, 6, 0.0),
])
def test_threshold_is_the_lowest_that_reaches_the_target(target, min_fires, want):
    assert select_threshold(PROB, Y, target, min_fires) == want


def test_threshold_selection_per_layer_by_hand():
    # three layers: an easy one, a mixed one, one without any positive
    probs = [np.array([0.2, 0.3, 0.8, 0.9]), PROB, np.array([0.1, 0.5, 0.99])]
    ys = [np.array([0, 0, 1, 1]), Y, np.array([0, 0, 0])]
    got = [select_threshold(p, y, 0.75, 2) for p, y in zip(probs, ys)]
    assert got == [0.3, 0.4, 1.0]
    assert select_threshold(np.array([]), np.array([]), 0.5, 1) == 1.0


def test_threshold_ties_fire_together():
    # equal probabilities cannot be split: a threshold fires all of them or none
    p, y = np.array([0.7, 0.7, 0.7, 0.2]), np.array([1, 1, 0, 0])
    assert select_threshold(p, y, 0.66, 1) == 0.2  # the three tied fire: 2/3
    assert select_threshold(p, y, 0.9, 1) == 1.0


# -- the per_layer decision path ----------------------------------------------------------------
def _bank(threshold=0.5):
    bank = PredictorBank.random(L, K, hidden=16, seed=3, threshold=threshold)
    with torch.no_grad():
        bank.w1.mul_(10)  # spread the probabilities over (0, 1)
    return bank


def _feats(n=400, seed=0):
    return torch.randn(n, 3 * K, generator=torch.Generator().manual_seed(seed))


THR = [0.3, 0.5, 0.8, 1.0, 0.0]


def test_per_layer_decisions_are_prob_above_the_layer_threshold():
    bank = _bank()
    bank.set_layer_thresholds(THR)
    assert bank.calibration == "per_layer" and bank.layer_thresholds == THR
    x = _feats()
    for layer, t in enumerate(THR):
        want = bank.prob(layer, x) > t
        assert torch.equal(bank.decide(layer, x), want), layer  # batched
        hot = torch.stack([bank.decide(layer, row) for row in x[:50]])  # the 1-D decode hot path
        assert torch.equal(hot, want[:50]), layer
        assert [bank.fires(layer, row) for row in x[:5]] == want[:5].tolist()
    # the layer with threshold 1.0 never fires; some layer fires sometimes and not always
    assert not bank.decide(3, x).any()
    assert any(0 < int(bank.decide(i, x).sum()) < len(x) for i in range(L))


def test_per_layer_steps_aside_from_the_fused_single_threshold_kernel():
    bank = _bank()
    bank.set_layer_thresholds(THR)
    assert not math.isfinite(bank._logit_t)  # compiled.py falls back to decide() then


def test_global_path_is_unchanged():
    x = _feats(seed=1)
    for t in (0.5, 0.2, 0.9, 0.0, 1.0):
        bank = _bank(t)
        assert bank.calibration == "global" and bank.layer_thresholds is None
        logit_t = math.inf if t >= 1 else -math.inf if t <= 0 else math.log(t / (1 - t))
        assert bank._logit_t == logit_t
        for layer in range(L):
            assert torch.equal(bank.decide(layer, x), bank.logit(layer, x) > logit_t)
    # back from per_layer to global: the global decisions again
    bank = _bank(0.5)
    before = [bank.decide(i, x) for i in range(L)]
    bank.set_layer_thresholds(THR)
    bank.set_threshold(0.5)
    assert all(torch.equal(bank.decide(i, x), b) for i, b in enumerate(before))


def test_per_layer_equal_thresholds_decide_as_global():
    x = _feats(seed=2)
    glob, per = _bank(0.5), _bank(0.5)
    per.set_layer_thresholds([0.5] * L)
    for i in range(L):
        assert torch.equal(glob.decide(i, x), per.decide(i, x))


def test_bad_thresholds_are_refused():
    bank = _bank()
    for bad in ([0.5] * (L - 1), [0.5] * (L - 1) + [1.5], [0.5] * (L - 1) + [float("nan")]):
        with pytest.raises(SpeceeError, match="layer_thresholds"):
            bank.set_layer_thresholds(bad)


# -- stored with the predictors -----------------------------------------------------------------
def _saved(tmp_path, **card_extra):
    bank = _bank()
    card = {"num_layers": L, "k": K, **card_extra}
    bank.save(tmp_path, card)
    return bank


def test_thresholds_round_trip(tmp_path):
    bank = _saved(tmp_path, **{THRESHOLDS: THR})
    loaded, card = PredictorBank.load(tmp_path, L, K, 0.5, "per_layer")
    assert loaded.layer_thresholds == THR and card[THRESHOLDS] == THR
    x = _feats(seed=4)
    bank.set_layer_thresholds(THR)
    for i in range(L):
        assert torch.equal(loaded.decide(i, x), bank.decide(i, x))
    # the same folder under global calibration: early_exit.threshold everywhere
    glob, _ = PredictorBank.load(tmp_path, L, K, 0.5)
    assert glob.calibration == "global" and glob.threshold == 0.5


def test_per_layer_without_thresholds_is_one_clear_error(tmp_path):
    _saved(tmp_path)
    PredictorBank.load(tmp_path, L, K, 0.5, "global")  # fine
    with pytest.raises(SpeceeError, match="early_exit.calibration=per_layer needs per-layer thresholds") as err:
        PredictorBank.load(tmp_path, L, K, 0.5, "per_layer")
    assert "target_precision" in str(err.value) and "calibration=global" in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_committed_paper_predictors_have_no_thresholds():
    folder = ART / "tiny_predictors"
    card = json.loads((folder / CARD).read_text())
    with pytest.raises(SpeceeError, match="per_layer"):
        PredictorBank.check(folder, card["num_layers"], card["k"], "per_layer")


@pytest.mark.parametrize("bad", [None, "0.5", [0.5] * (L - 1), [0.5] * (L + 1), [0.5] * (L - 1) + ["x"],
                                 [0.5] * (L - 1) + [True], [0.5] * (L - 1) + [-0.1], [0.5] * (L - 1) + [2],
                                 {"0": 0.5}])
@pytest.mark.parametrize("calibration", ["per_layer", "global"])
def test_malformed_thresholds_are_one_clear_error(tmp_path, bad, calibration):
    _saved(tmp_path, **{THRESHOLDS: bad})
    with pytest.raises(SpeceeError, match="layer_thresholds") as err:
        PredictorBank.load(tmp_path, L, K, 0.5, calibration)
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and "retrain" in msg and CARD in msg


def test_nan_threshold_in_the_card_is_refused(tmp_path):
    _saved(tmp_path)
    card = json.loads((tmp_path / CARD).read_text())
    (tmp_path / CARD).write_text(json.dumps({**card, THRESHOLDS: [0.5] * (L - 1) + [float("nan")]}))
    with pytest.raises(SpeceeError, match="layer_thresholds"):
        PredictorBank.load(tmp_path, L, K, 0.5, "per_layer")


def test_tuned_tiny_predictors_load_per_layer():
    folder = ART / "tiny_predictors_tuned"
    if not (folder / CARD).is_file():
        pytest.skip("specee/artifacts/tiny_predictors_tuned not trained yet")
    card = json.loads((folder / CARD).read_text())
    bank, _ = PredictorBank.load(folder, card["num_layers"], card["k"], 0.5, "per_layer")
    assert bank.layer_thresholds == card[THRESHOLDS]
    assert "target_precision" in card["command"] and card["threshold_selection"]["report"]["fires"] > 0


# -- configuration ------------------------------------------------------------------------------
def _compose(*overrides):
    from specee.launch import compose_and_check
    return compose_and_check(list(overrides))


@pytest.mark.parametrize("override,named", [
    ("experiment.label=oracle", "experiment.label"),
    ("experiment.target_precision=1.5", "experiment.target_precision"),
    ("experiment.target_precision=-0.1", "experiment.target_precision"),
    ("experiment.target_precision=nan", "experiment.target_precision"),
    ("experiment.threshold_min_fires=0", "experiment.threshold_min_fires"),
    ("experiment.features_cache=''", "experiment.features_cache"),
    ("early_exit.calibration=per_layers", "early_exit.calibration"),
])
def test_new_options_refuse_bad_values(override, named):
    with pytest.raises(SpeceeError, match=named.replace(".", r"\.")):
        _compose("experiment=train_predictors", "model=tiny", override)


def test_new_options_compose():
    cfg = _compose("experiment=train_predictors", "model=tiny", "experiment.label=verified",
                   "experiment.target_precision=0.8", "experiment.pos_weight=balanced")
    assert cfg.experiment.label == "verified" and cfg.experiment.target_precision == 0.8
    default = _compose("experiment=train_predictors", "model=tiny")
    assert default.experiment.label == "final" and default.experiment.target_precision is None
    assert default.early_exit.calibration == "global"


@pytest.mark.parametrize("preset,base", [("specee_t1_t2_tuned", "specee_t1_t2"), ("specee_full_tuned", "specee_full")])
def test_tuned_presets_are_their_base_with_tuned_predictors(preset, base):
    from omegaconf import OmegaConf
    tuned = _compose("experiment=speed", "model=tiny", f"ablation={preset}")
    plain = _compose("experiment=speed", "model=tiny", f"ablation={base}")
    assert tuned.ablation.name == preset
    assert tuned.early_exit.calibration == "per_layer" and plain.early_exit.calibration == "global"
    assert tuned.early_exit.predictors_path.endswith("tiny_predictors_tuned")
    # the same decoding; only its name and identity (label, bank, report order) say it is the tuned one
    from specee.ablations import FIELDS
    assert tuned.ablation.bank == "tuned" and plain.ablation.bank == "trained"
    assert tuned.ablation.step == plain.ablation.step and tuned.ablation.staircase == plain.ablation.staircase
    strip = lambda c: {**OmegaConf.to_container(c, resolve=True), "ablation": {  # noqa: E731
        **OmegaConf.to_container(c.ablation), "name": None, **dict.fromkeys(FIELDS)}, "early_exit": None}
    assert strip(tuned) == strip(plain)
    te, pe = OmegaConf.to_container(tuned.early_exit, resolve=True), OmegaConf.to_container(plain.early_exit, resolve=True)
    assert {k: v for k, v in te.items() if k not in ("calibration", "predictors_path")} == \
        {k: v for k, v in pe.items() if k not in ("calibration", "predictors_path")}


# -- the decoders honour per-layer thresholds -----------------------------------------------------
def _parts(layers=6):
    from conftest import random_lm
    from specee.models.draft import DraftHead
    from specee.runtime.layerwise import LayerwiseLM
    rt = LayerwiseLM(random_lm("llama", layers=layers, seed=0))
    torch.manual_seed(1)
    return rt, DraftHead(rt.config).attach(rt).eval()


def _prompts(n=2):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, 101, (1, 6 + 3 * i), generator=g) for i in range(n)]


def test_autoregressive_exits_only_at_layers_whose_threshold_lets_the_predictor_fire():
    from specee.decoding.dense import DenseDecoder
    from specee.decoding.specee_ar import SpecEEDecoder
    rt, draft = _parts()
    n = rt.num_layers
    # a predictor that always says "exit" (sigmoid(1) = 0.73): per layer, 1.0 silences it
    silent = PredictorBank.constant(n, 4, fire=True)
    silent.set_layer_thresholds([1.0] * n)
    for ids in _prompts():
        gen = SpecEEDecoder(rt, draft, silent, k=4, kv_policy="holes").generate(ids, 12)
        assert gen.tokens == DenseDecoder(rt).generate(ids, 12).tokens
        assert all(t["verify_calls"] == 0 for t in gen.trace)
    only = PredictorBank.constant(n, 4, fire=True)  # layer 2 alone may fire (0.73 > 0.7)
    only.set_layer_thresholds([1.0, 1.0, 0.7] + [0.9] * (n - 3))
    for ids in _prompts():
        gen = SpecEEDecoder(rt, draft, only, k=4, kv_policy="holes").generate(ids, 12)
        assert all(t["verify_calls"] == 1 and t["exit_layer"] in (2, n - 1) for t in gen.trace)


def test_tree_decoding_honours_per_layer_thresholds():
    from specee.decoding.dense import DenseDecoder
    from specee.decoding.tree import TreeDecoder
    rt, draft = _parts()
    n = rt.num_layers
    silent = PredictorBank.constant(n, 4, fire=True)
    silent.set_layer_thresholds([1.0] * n)
    for mapping in ("merged", "independent"):
        dec = TreeDecoder(rt, draft, "small", bank=silent, mapping=mapping, k=4)
        for ids in _prompts():
            gen = dec.generate(ids, 12)
            assert gen.tokens == DenseDecoder(rt).generate(ids, 12).tokens
            assert all(t["verify_calls"] == 0 for t in gen.trace)


def test_features_cache_is_read_only_for_the_same_inputs(tmp_path):
    from experiments.train_predictors import _CACHED, _read_features_cache, _write_features_cache
    rng = np.random.default_rng(0)
    rows = [{name: rng.random((3, 4)) if name in ("feats", "ada") else rng.integers(0, 9, (3, 4)) if name != "label"
             else rng.random((3, 4)) > 0.5 for name in _CACHED} for _ in range(2)]
    path = tmp_path / "features.npz"
    assert _read_features_cache(path, "k1") is None  # nothing there: collect
    _write_features_cache(path, "k1", rows)
    back = _read_features_cache(path, "k1")
    assert len(back) == 2 and all(np.array_equal(a[n], b[n]) and a[n].dtype == b[n].dtype
                                  for a, b in zip(rows, back) for n in _CACHED)
    assert _read_features_cache(path, "k2") is None  # other weights, prompts or settings
    path.write_bytes(b"not an npz")
    assert _read_features_cache(path, "k1") is None
