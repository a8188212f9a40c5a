import pytest
import torch

from conftest import random_lm
from specee.decoding.dense import DenseDecoder
from specee.decoding.specee_ar import SpecEEDecoder
from specee.decoding.tree import TreeDecoder, mean_accepted_length
from specee.decoding.tree_shape import (FIGURE_13, build, chain, independent_units, mapping_complexity,
                                        predictor_evals_per_layer)
from specee.early_exit.predictor import PredictorBank
from specee.errors import SpeceeError
from specee.models.draft import DraftHead
from specee.runtime.layerwise import LayerKVCache, LayerwiseLM

K = 4
HAND = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]  # nodes 1..6 in this order, 0 = root


def setup(layers=6, seed=0):
    model = random_lm("llama", layers=layers, seed=seed)
    rt = LayerwiseLM(model)
    torch.manual_seed(seed + 1)
    return rt, DraftHead(model.config).attach(rt).eval()


def prompts(n=3):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, 101, (1, 6 + 3 * i), generator=g) for i in range(n)]


class OracleDraft:
    """Knows the dense continuation: at draft position p the true next token gets rank rank_of(p)."""

    def __init__(self, rt, ref: list[int], rank_of=lambda p: 0):
        self.rt, self.ref, self.rank_of = rt, ref, rank_of
        self.noise = torch.randn(512, rt.config.vocab_size, generator=torch.Generator().manual_seed(0))

    def new_cache(self, capacity=256):
        return LayerKVCache(1, 1, 1, torch.float32, "cpu", capacity)

    def __call__(self, next_ids, feats, cache, position_ids=None, mask=None):
        t = next_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(cache.seq_len, cache.seq_len + t)[None]
        cache.lengths[0] += t
        cache.seq_len += t
        return position_ids[..., None].float()  # the "feature" is the position

    def logits(self, f_hat):
        pos = f_hat[..., 0].long().reshape(-1)
        out = self.noise[pos % 512].clone()
        for row, p in zip(out, pos.tolist()):
            if p + 2 < len(self.ref):  # entry (x[p+1], f[p]) predicts x[p+2]
                order = row.argsort(descending=True).tolist()
                order.remove(self.ref[p + 2])
                order.insert(self.rank_of(p), self.ref[p + 2])
                row[order] = torch.linspace(10, -10, len(order))
        return out.view(*f_hat.shape[:-1], -1)

    def topk(self, f_hat, k):  # the draft head's proposal verb, over these logits
        return self.logits(f_hat).topk(k, -1).indices


def test_tree_indices_of_a_hand_built_tree():
    t = build(HAND)
    assert t.parent == [-1, 0, 0, 1, 1, 2, 3] and t.depth == [0, 1, 1, 2, 2, 2, 3]
    assert t.children == [[1, 2], [3, 4], [5], [6], [], [], []]
    expect = torch.tensor([[1, 0, 0, 0, 0, 0, 0],
                           [1, 1, 0, 0, 0, 0, 0],
                           [1, 0, 1, 0, 0, 0, 0],
                           [1, 1, 0, 1, 0, 0, 0],
                           [1, 1, 0, 0, 1, 0, 0],
                           [1, 0, 1, 0, 0, 1, 0],
                           [1, 1, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(t.mask, expect)
    assert t.leaves == [4, 5, 6] and t.root_paths == [[0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]
    assert build(list(reversed(HAND))).paths == build(HAND).paths  # order-free input
    with pytest.raises(SpeceeError, match="parent"):
        build([[0, 0]])


def test_verification_positions_and_mask_reach_the_layers():
    """The tree forward equals running each root-to-node path as a plain causal sequence."""
    rt, _ = setup(layers=3)
    t = build(HAND)
    tokens = [5, 11, 12, 13, 14, 15, 16]
    prefix = torch.tensor([[3, 9, 4, 8]])
    with torch.inference_mode():
        cache = rt.new_cache()
        rt.forward(prefix, cache)
        pos = (cache.seq_len + torch.tensor(t.depth))[None]
        h = rt.forward(torch.tensor([tokens]), cache, t.mask, pos, commit=False)
        for v, path in zip(t.leaves, t.root_paths):
            ids = torch.cat([prefix, torch.tensor([[tokens[j] for j in path]])], 1)
            ref = rt.forward(ids, rt.new_cache())
            torch.testing.assert_close(h[0, path], ref[0, 4:], rtol=1e-5, atol=1e-5)


def test_greedy_acceptance_walk():
    t = build(HAND)
    tokens = [5, 11, 12, 13, 14, 15, 16]
    nxt = [11, 14, 0, 16, 0, 0, 42]  # root->11 (node1), node1->14 (node4, rank 1), node4 leaf
    assert t.walk(nxt, tokens) == [0, 1, 4]
    assert t.walk([12, 0, 15, 0, 0, 7, 0], tokens) == [0, 2, 5]
    assert t.walk([99] * 7, tokens) == [0]
    assert t.walk([11, 13, 0, 16, 0, 0, 8], tokens) == [0, 1, 3, 6]  # full depth; bonus = 8


@pytest.mark.parametrize("tree", ["small", "mc_sim_7b_63", HAND, [], [[0]], chain(3)])
def test_lossless_vs_dense_random_draft(tree):
    rt, draft = setup()
    dec = TreeDecoder(rt, draft, tree)
    for ids in prompts():
        gen = dec.generate(ids, 24)
        assert gen.tokens == DenseDecoder(rt).generate(ids, 24).tokens
        assert sum(t["emitted"] for t in gen.trace) == len(gen.tokens) - 1 == len(gen.token_s) - 1


@pytest.mark.parametrize("rank_of,min_tau", [(lambda p: 0, 4.0), (lambda p: p % 3, 2.0), (lambda p: 5, 1.0)])
def test_lossless_with_an_oracle_draft_long_acceptances(rank_of, min_tau):
    """Accepted paths of several nodes, off rank 0 too; keep() compacts non-contiguous nodes."""
    rt, _ = setup()
    dense = DenseDecoder(rt)
    for ids in prompts():
        ref = dense.generate(ids, 40).tokens
        draft = OracleDraft(rt, ids[0].tolist() + ref, rank_of)
        for tree in ("small", "mc_sim_7b_63"):
            gen = TreeDecoder(rt, draft, tree).generate(ids, 40)
            assert gen.tokens == ref
            assert mean_accepted_length([gen]) >= min_tau, tree  # rank 0: the chain always hits


def test_max_length_and_eos_stop_where_dense_does():
    rt, _ = setup()
    dense = DenseDecoder(rt)
    for ids in prompts():
        full = dense.generate(ids, 40).tokens
        draft = OracleDraft(rt, ids[0].tolist() + full)
        dec = TreeDecoder(rt, draft, "small")
        for n in (1, 2, 3, 7, 13):  # steps accept ~5 tokens: the limit falls inside a step
            assert dec.generate(ids, n).tokens == full[:n]
        eos = full[9]
        assert dec.generate(ids, 40, eos).tokens == dense.generate(ids, 40, eos).tokens
        assert dec.generate(ids, 40, eos).tokens[-1] == eos


def random_bank(layers, seed=0):
    torch.manual_seed(seed)
    bank = PredictorBank(layers, K, hidden=16, threshold=0.5)
    with torch.no_grad():
        for p in (bank.w1, bank.b1, bank.w2, bank.b2):
            p.normal_()
    bank.has[:] = True
    return bank


@pytest.mark.parametrize("mapping", ["merged", "independent"])
@pytest.mark.parametrize("policy", ["holes", "propagate"])
@pytest.mark.parametrize("bank", ["never", "always", "random"])
def test_root_only_tree_is_autoregressive_specee(mapping, policy, bank):
    rt, draft = setup(layers=8)
    b = {"never": lambda: PredictorBank.constant(8, K, False),
         "always": lambda: PredictorBank.constant(8, K, True), "random": lambda: random_bank(8)}[bank]()
    ar = SpecEEDecoder(rt, draft, b, k=K, kv_policy=policy)
    tree = TreeDecoder(rt, draft, chain(0), bank=b, mapping=mapping, k=K, kv_policy=policy)
    exits = 0
    for ids in prompts():
        a, t = ar.generate(ids, 20), tree.generate(ids, 20)
        assert t.tokens == a.tokens and t.layers_run == a.layers_run
        for x, y in zip(a.trace, t.trace):
            assert (x["pred_calls"], x["verify_calls"]) == (y["pred_calls"], y["verify_calls"])
        exits += sum(tr["exit_layer"] < 7 for tr in t.trace)
    assert (exits > 0) == (bank != "never")


@pytest.mark.parametrize("tree", [[[0]], HAND])
def test_trees_without_exits_are_lossless_with_predictors(tree):
    rt, draft = setup()
    never = PredictorBank.constant(rt.num_layers, K, False)
    for mapping in ("merged", "independent"):
        dec = TreeDecoder(rt, draft, tree, bank=never, mapping=mapping, k=K)
        for ids in prompts(2):
            assert dec.generate(ids, 16).tokens == DenseDecoder(rt).generate(ids, 16).tokens


def test_figure_13_tree_mappings():
    """The paper's Fig. 13: root -> 3 tokens, each -> 3 tokens. Independent: 4 predictors (the
    nodes with children), search spaces 3 each, complexity 3^4; merged: 9 hyper-tokens."""
    t = build(FIGURE_13)
    assert t.size == 13 and len(t.leaves) == 9
    assert independent_units(t) == [0, 1, 2, 3]
    assert predictor_evals_per_layer(t, "independent") == 4
    assert predictor_evals_per_layer(t, "merged") == 9
    assert mapping_complexity(t, "independent") == 3 ** 4 and mapping_complexity(t, "merged") == 9
    # One level deeper, independent complexity grows exponentially, merged linearly in the paths.
    deeper = build(FIGURE_13 + [[a, b, c] for a in range(3) for b in range(3) for c in range(3)])
    assert mapping_complexity(deeper, "independent") == 3 ** 13
    assert mapping_complexity(deeper, "merged") == 27


def test_exit_rule_needs_the_walks_predictors():
    """HAND's nodes: 1=[0] 2=[1] 3=[0,0] 4=[0,1] 5=[1,0] 6=[0,0,0]; leaves 4, 5, 6."""
    rt, draft = setup(layers=2)
    bank = PredictorBank.constant(2, K, True)
    ind = TreeDecoder(rt, draft, HAND, bank=bank, mapping="independent", k=K)
    units = [u[0] for u in ind.units]
    assert {units[u] for u in ind.needed([0, 1, 3])} == {0, 1, 3}
    assert ind.needed([0, 1, 4]) is None  # ends at a leaf: no predictor vouches for the bonus
    assert ind.needed([0]) == {0}
    merged = TreeDecoder(rt, draft, HAND, bank=bank, mapping="merged", k=K)
    leaf_of = [p[-1] for p in merged.units]
    # Accepted prefix root -> [0]: the hyper-tokens through node 1 end at leaves 4 and 6, the
    # path to 6 included although the walk may have rejected [0, 0] at this layer.
    assert {leaf_of[u] for u in merged.needed([0, 1])} == {4, 6}
    assert {leaf_of[u] for u in merged.needed([0, 2, 5])} == {5}


def test_predictor_evaluation_counts():
    t = build(HAND)
    assert predictor_evals_per_layer(t, "independent") == 4  # root, [0], [1], [0, 0]: nodes with children
    assert predictor_evals_per_layer(t, "merged") == 3  # one per root-to-leaf path
    rt, draft = setup()
    never = PredictorBank.constant(rt.num_layers, K, False)
    for mapping, per_layer in (("independent", 4), ("merged", 3)):
        gen = TreeDecoder(rt, draft, HAND, bank=never, mapping=mapping, k=K).generate(prompts(1)[0], 10)
        assert all(tr["pred_calls"] == per_layer * (rt.num_layers - 1) for tr in gen.trace)


@pytest.mark.parametrize("policy", ["holes", "propagate"])
@pytest.mark.parametrize("mapping", ["merged", "independent"])
def test_exits_inside_the_tree_keep_the_cache_consistent(policy, mapping, monkeypatch):
    rt, _ = setup(layers=8)
    caches = []
    new_cache = rt.new_cache
    monkeypatch.setattr(rt, "new_cache", lambda *a: caches.append(new_cache(*a)) or caches[-1])
    always = PredictorBank.constant(8, K, True)
    for ids in prompts():
        ref = DenseDecoder(rt).generate(ids, 30).tokens
        # Every other true token ranks 3, outside the tree's children but inside S: walks then
        # end at inner nodes, where the independent mapping has a predictor for the bonus.
        draft = OracleDraft(rt, ids[0].tolist() + ref, rank_of=lambda p: (0, 3)[p % 2])
        gen = TreeDecoder(rt, draft, "small", bank=always, mapping=mapping, k=K, kv_policy=policy).generate(ids, 30)
        assert len(gen.tokens) == 30 and any(tr["exit_layer"] < 7 for tr in gen.trace)
        assert all(tr["verify_calls"] >= 1 for tr in gen.trace)  # an always-firing bank verifies
        c = caches[-1]
        assert c.lengths[0] == c.seq_len
        if policy == "propagate":
            assert c.lengths == [c.seq_len] * 8
        else:
            assert all(n <= c.seq_len for n in c.lengths)


def test_unknown_mapping_and_tree_are_refused():
    rt, draft = setup(layers=2)
    with pytest.raises(SpeceeError, match="mapping"):
        TreeDecoder(rt, draft, "small", mapping="joint")
    with pytest.raises(SpeceeError, match="tree"):
        TreeDecoder(rt, draft, "huge")


def test_scoring_lossless_tree_is_dense_and_exits_refuse():
    rt, draft = setup(layers=3)
    ids = prompts(1)[0]
    got = TreeDecoder(rt, draft, "small").score(ids[:, :4], ids[0, 4:].tolist())
    assert got.logprobs == DenseDecoder(rt).score(ids[:, :4], ids[0, 4:].tolist()).logprobs
    with pytest.raises(SpeceeError, match="scoring"):
        TreeDecoder(rt, draft, "small", bank=PredictorBank.constant(3, K, True)).score(ids[:, :4], [1])


@pytest.mark.parametrize("delta_from", ["previous_layer", "previous_evaluated"])
def test_root_only_tree_is_autoregressive_specee_under_a_schedule(delta_from):
    """The Δ feature's p_prev (layer l-1 probes between scheduled layers) is the same in both."""
    from test_early_exit import FixedLayers
    rt, draft = setup(layers=8)
    bank = random_bank(8)
    sched = FixedLayers([i in (1, 4, 5) for i in range(8)])
    ar = SpecEEDecoder(rt, draft, bank, k=K, schedule=sched, delta_from=delta_from)
    tree = TreeDecoder(rt, draft, chain(0), bank=bank, schedule=sched, mapping="merged", k=K, delta_from=delta_from)
    for ids in prompts():
        a, t = ar.generate(ids, 20), tree.generate(ids, 20)
        assert t.tokens == a.tokens and t.layers_run == a.layers_run
        assert [x["delta_probes"] for x in a.trace] == [y["delta_probes"] for y in t.trace]
    assert any(x["delta_probes"] for x in a.trace) == (delta_from == "previous_layer")
