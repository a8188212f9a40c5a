import math

import numpy as np
import pytest
import torch

from conftest import early_exit_parts, random_lm
from specee.decoding.dense import DenseDecoder
from specee.decoding.specee_ar import SpecEEDecoder
from specee.early_exit.training_data import collect_prompt
from specee.early_exit.features import adainfer_features, initial_p, spec_features
from specee.early_exit.kv_policy import fill_skipped
from specee.early_exit.predictor import PredictorBank, make_mlp
from specee.models.draft import DraftHead
from specee.runtime.layerwise import LayerwiseLM

K = 4


def setup(layers=6, seed=0):
    model = random_lm("llama", layers=layers, seed=seed)
    rt = LayerwiseLM(model)
    torch.manual_seed(seed + 1)
    draft = DraftHead(model.config).attach(rt).eval()
    return rt, draft


def prompts(n=3):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, 101, (1, 6 + 3 * i), generator=g) for i in range(n)]


def test_spec_features_match_a_hand_computation():
    h = torch.tensor([0.5, -1.0, 2.0])
    w = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, -1.0]])
    p_prev = initial_p(4, w)
    feats, p = spec_features(h, w, p_prev)
    z = [0.5, -1.0, 1.5, -2.0]
    e = [math.exp(v) for v in z]
    soft = [v / sum(e) for v in e]
    expected = z + soft + [s - 0.25 for s in soft]
    assert feats.shape == (12,)
    torch.testing.assert_close(feats, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    feats2, _ = spec_features(h * 2, w, p)
    torch.testing.assert_close(feats2[8:], feats2[4:8] - p)  # variation against the previous layer


def test_adainfer_features_are_gap_and_top_prob():
    logits = torch.log(torch.tensor([0.1, 0.6, 0.3]))
    torch.testing.assert_close(adainfer_features(logits), torch.tensor([0.3, 0.6]))


def test_bank_reproduces_the_training_mlp():
    mlp = make_mlp(K, 16)
    bank = PredictorBank(3, K, 16, threshold=0.5)
    bank.put(1, mlp)
    x = torch.randn(3 * K)
    torch.testing.assert_close(bank.prob(1, x), torch.sigmoid(mlp(x))[0])
    assert bank.fires(1, x) == bool(torch.sigmoid(mlp(x)) > 0.5)


@pytest.mark.parametrize("policy", ["holes", "propagate"])
def test_never_firing_predictor_reproduces_dense_exactly(policy):
    rt, draft = setup()
    never = PredictorBank.constant(rt.num_layers, K, fire=False)
    dec = SpecEEDecoder(rt, draft, never, k=K, kv_policy=policy)
    for ids in prompts():
        gen = dec.generate(ids, 20)
        assert gen.tokens == DenseDecoder(rt).generate(ids, 20).tokens
        assert gen.layers_run[1:] == [rt.num_layers] * 19
        assert all(t["verify_calls"] == 0 and t["pred_calls"] == rt.num_layers - 1 for t in gen.trace)


def test_always_firing_predictor_exits_only_where_verification_allows():
    rt, draft = setup(layers=8)
    always = PredictorBank.constant(rt.num_layers, K, fire=True)
    dec = SpecEEDecoder(rt, draft, always, k=K, kv_policy="holes")
    exits = 0
    for ids in prompts(5):
        gen = dec.generate(ids, 24)
        for tok, tr in zip(gen.tokens[1:], gen.trace):
            if tr["exit_layer"] < rt.num_layers - 1:
                exits += 1
                assert tok in tr["spec"], "an exit emitted a token outside the speculative set"
            # Every layer before the exit was verified and rejected; one verification per call.
            assert tr["verify_calls"] == tr["pred_calls"] == min(tr["exit_layer"] + 1, rt.num_layers - 1)
        # The first decode step runs on the same state as dense collection: its exit must be the
        # first layer whose full-vocabulary argmax lies in the draft's set.
        ref = collect_prompt(rt, draft, ids, 2, K, None)
        allowed = np.flatnonzero(ref["in_spec"][0, : rt.num_layers - 1])
        first = int(allowed[0]) if len(allowed) else rt.num_layers - 1
        assert gen.trace[0]["exit_layer"] == first
        assert gen.tokens[1] == int(ref["argmax"][0, first])
    assert exits > 0, "the test never exercised an exit"


def test_propagate_fills_skipped_layers_and_holes_do_not():
    rt, _ = setup(layers=5)
    ids = prompts(2)[1]  # 9 tokens
    for policy, expect in [("holes", [7, 7, 6, 6, 6]), ("propagate", [7] * 5)]:
        cache = rt.new_cache()
        with torch.inference_mode():
            rt.forward(ids[:, :6], cache)
            pos = rt.positions(cache, 1)
            h = rt.embed(ids[:, 6:7])
            rope = rt.rope(h, pos)
            for i in range(2):
                h = rt.run_layer(i, h, rope, cache, None, pos)
            cache.seq_len += 1
            fill_skipped(rt, cache, h, 1, rope, policy)
        assert cache.lengths == expect


def test_propagated_kv_equals_the_layers_own_projection():
    """The filled K/V are what the skipped layer's attention would store for input h_exit."""
    rt, _ = setup(layers=3)
    h = torch.randn(1, 1, 64)
    pos = torch.tensor([[4]])
    with torch.inference_mode():
        rope = rt.rope(h, pos)
        a, b = rt.new_cache(), rt.new_cache()
        fill_skipped(rt, a, h, 0, rope, "propagate")
        layer = rt.layers[2]
        layer.self_attn(layer.input_layernorm(h), position_embeddings=rope, attention_mask=None, cache=b)
    torch.testing.assert_close(a.keys[2][:, :, :1], b.keys[2][:, :, :1])
    torch.testing.assert_close(a.values[2][:, :, :1], b.values[2][:, :, :1])


def test_dense_score_equals_hf_loglikelihood():
    rt, _ = setup()
    ids = prompts(2)[1]
    ctx, cont = ids[:, :5], ids[0, 5:].tolist()
    with torch.inference_mode():
        logp = torch.log_softmax(rt.model(ids).logits[0].float(), -1)
    ref = [logp[4 + j, t].item() for j, t in enumerate(cont)]
    got = DenseDecoder(rt).score(ctx, cont)
    np.testing.assert_allclose(got.logprobs, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fire", [False, True])
def test_specee_scoring_its_own_output_replays_the_decode(fire):
    """Teacher forcing on the tokens SpecEE generated takes the same exits and is greedy."""
    rt, draft = setup(layers=8)
    dec = SpecEEDecoder(rt, draft, PredictorBank.constant(rt.num_layers, K, fire=fire), k=K, kv_policy="holes")
    for ids in prompts(3):
        gen = dec.generate(ids, 16)
        s = dec.score(ids, gen.tokens, exit_at_context_end=False)
        assert s.greedy and s.layers == gen.layers_run
        if not fire:
            dense = DenseDecoder(rt).score(ids, gen.tokens)
            np.testing.assert_allclose(s.logprobs, dense.logprobs, rtol=1e-4, atol=1e-5)


def test_scoring_exits_on_the_last_context_token_by_default():
    """The first continuation token is also scored by an exit decision (one-token answers)."""
    rt, draft = setup(layers=8)
    dec = SpecEEDecoder(rt, draft, PredictorBank.constant(rt.num_layers, K, fire=True), k=K, kv_policy="holes")
    exited = 0
    g = torch.Generator().manual_seed(3)
    for ids in [torch.randint(1, 101, (1, 4 + i % 9), generator=g) for i in range(40)]:
        s = dec.score(ids[:, :-1], [int(ids[0, -1])])
        assert len(s.layers) == 1
        exited += s.layers[0] < rt.num_layers
        never = SpecEEDecoder(rt, draft, PredictorBank.constant(rt.num_layers, K, fire=False), k=K, kv_policy="holes")
        dense = DenseDecoder(rt).score(ids[:, :-1], [int(ids[0, -1])])
        np.testing.assert_allclose(never.score(ids[:, :-1], [int(ids[0, -1])]).logprobs, dense.logprobs,
                                   rtol=1e-4, atol=1e-5)
    assert exited > 0


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_spec_probe_equals_norm_then_project(arch):
    from specee.early_exit.features import SpecProbe
    rt = LayerwiseLM(random_lm(arch, layers=2))
    spec = torch.tensor([5, 17, 3, 99])
    probe = SpecProbe(rt, spec)
    assert probe.fast  # these norms fold; others take the plain path
    h = torch.randn(1, 1, 64) * 3
    with torch.inference_mode():
        ref = rt.lm_head(rt.norm(h))[0, 0, spec]
    torch.testing.assert_close(probe.logits(h), ref, rtol=1e-5, atol=1e-5)


class FixedLayers:
    """A schedule with a fixed active set (the offline top-M without the online part)."""
    name = "fixed"

    def __init__(self, mask):
        self.mask = mask

    def new_request(self):
        return None

    def active(self, state):
        return self.mask

    def record(self, state, exit_layer):
        pass


@pytest.mark.parametrize("delta_from,same", [("previous_layer", True), ("previous_evaluated", False)])
def test_delta_feature_under_a_schedule_is_what_the_predictors_were_trained_on(delta_from, same):
    """Decoding with predictors on layers 2, 3 and 6 only feeds each of them the features that
    collection (every layer evaluated) recorded for that token and layer -- p_prev from layer l-1
    -- unless delta_from=previous_evaluated, which takes p_prev from the last evaluated layer."""
    rt, draft, _ = early_exit_parts(8)
    never = PredictorBank.constant(8, 4, False)
    seen = []
    decide = never.decide
    never.decide = lambda i, x: seen.append((i, x.clone())) or decide(i, x)
    mask = [i in (2, 3, 6) for i in range(8)]
    ids = torch.randint(1, 101, (1, 7), generator=torch.Generator().manual_seed(4))
    dec = SpecEEDecoder(rt, draft, never, k=4, schedule=FixedLayers(mask), delta_from=delta_from)
    gen = dec.generate(ids, 6)
    ref = collect_prompt(rt, draft, ids, 6, 4, None)["feats"]  # (tokens, layers, 3K)
    assert [i for i, _ in seen] == [2, 3, 6] * (len(gen.tokens) - 1)
    for n, (i, x) in enumerate(seen):
        t = n // 3
        close = torch.allclose(x, torch.as_tensor(ref[t, i]), atol=1e-5)
        assert close if (same or i == 3) else not close  # layer 3 follows an evaluated layer 2
    probes = [tr["delta_probes"] for tr in gen.trace]
    assert probes == [2 if same else 0] * len(probes)  # p at layers 1 and 5
