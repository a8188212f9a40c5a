"""The cost-chosen draft tree (ablation.tree_select=auto) and SpecEE's fired-rows verification."""
import itertools

import pytest
import torch

from conftest import early_exit_parts, run_cli
from specee.decoding.tree import TreeDecoder
from specee.tuning.tree_select import acceptance_table, choose, expected_tokens, grow, select_tree
from specee.errors import SpeceeError


def test_acceptance_table_counts_only_walks_that_reached_the_depth_on_the_chain():
    # depth 3, width 2; each list: the ranks accepted at depths 1, 2, ...
    walks = [[0, 0, 1], [0, 1], [1], [], [0]]
    t = acceptance_table(walks, depth=3, width=2)
    assert t["observations"] == [5, 3, 1]  # all 5 reach depth 1; [0,0,1] [0,1] [0] reach depth 2 on rank 0
    assert t["p"][0] == [3 / 5, 1 / 5]
    assert t["p"][1] == [1 / 3, 1 / 3]
    assert t["p"][2] == [0.0, 1.0]


def test_grow_gives_the_best_tree_of_each_size_under_the_positional_model():
    p = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.05], [0.4, 0.1, 0.0]]
    candidates = [tuple(q) for d in range(1, 4) for q in itertools.product(range(3), repeat=d)]
    for size, tree in enumerate(grow(p, 6), start=1):
        assert len(tree) == size and all(q[:-1] in tree or len(q) == 1 for q in tree)  # a tree: parents present
        # brute force over every valid tree of this size
        best = max(expected_tokens(c, p) for c in itertools.combinations(candidates, size)
                   if all(len(q) == 1 or q[:-1] in c for q in c))
        assert expected_tokens(tree, p) == pytest.approx(best)


def test_choose_takes_the_cheaper_longer_block_where_costs_are_not_monotone():
    p = [[0.9, 0.05], [0.9, 0.05], [0.9, 0.0], [0.9, 0.0]]
    flat = choose(p, lambda n: 100.0, lambda w: 1.0, dense_us=100.0, max_nodes=6)
    # c(3) is a bad shape on this "machine"; c(4) and c(5) are cheap
    bumpy = {1: 100.0, 2: 150.0, 3: 400.0, 4: 130.0, 5: 135.0, 6: 400.0, 7: 400.0}
    chosen = choose(p, lambda n: bumpy[n], lambda w: 1.0, dense_us=100.0, max_nodes=6)
    assert chosen["chosen"]["nodes"] in (3, 4)  # blocks of 4 or 5 tokens, never the 3-token block
    assert bumpy[chosen["chosen"]["nodes"] + 1] < 400.0
    assert flat["chosen"]["nodes"] == 6  # verification free of size: the biggest tree
    rate = {r["nodes"]: r["predicted_speedup"] for r in chosen["candidates"]}
    assert chosen["chosen"]["predicted_speedup"] == max(rate.values())
    never = choose([[0.0, 0.0]], lambda n: 2.0, lambda w: 1.0, 2.0, max_nodes=3)
    assert never["chosen"]["paths"] == [[0]] and "no tree can help" in never["note"]
    assert never["chosen"]["predicted_speedup"] < 1.0 and flat["note"] is None
    with pytest.raises(SpeceeError):
        choose(p, lambda n: 1.0, lambda w: 1.0, 1.0, max_nodes=0)


def test_select_tree_measures_and_returns_a_valid_tree_on_a_real_runtime():
    rt, draft, _ = early_exit_parts(layers=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 101, (1, 8), generator=g) for _ in range(2)]
    out = select_tree(rt, draft, prompts, prompts[0], max_nodes=5, depth=3, width=2, max_new_tokens=6)
    paths = out["chosen"]["paths"]
    assert 1 <= len(paths) <= 5 and set(out["block_costs"]["median_us"]) == {str(n) for n in range(1, 7)}
    dec = TreeDecoder(rt, draft, paths, k=2)  # the chosen tree decodes, losslessly
    from specee.decoding.dense import DenseDecoder
    assert dec.generate(prompts[1], 8).tokens == DenseDecoder(rt).generate(prompts[1], 8).tokens


def test_tree_select_auto_refused_without_a_tree_mode():
    r = run_cli("experiment=speed", "ablation=specee_t1", "ablation.tree_select=auto")
    assert r.returncode == 2 and "tree_select=auto" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("rule", ["all_paths", "any_path"])
def test_fired_rows_verification_decides_exactly_as_the_full_head(rule):
    """Merged SpecEE in the tree computes head rows only for nodes on fired hyper-tokens; every
    exit decision, token and exit layer equals the full-head verification's (independent mapping
    computes every row), and fewer rows are counted."""
    rt, draft, bank = early_exit_parts(layers=6)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 101, (1, 10), generator=g)
    merged = TreeDecoder(rt, draft, "small", bank=bank, mapping="merged", exit_rule=rule)
    full = TreeDecoder(rt, draft, "small", bank=bank, mapping="merged", exit_rule=rule)
    full.fired_rows_only = False  # the reference: every row of the tree's head at each verification
    a, b = merged.generate(ids, 16), full.generate(ids, 16)
    assert a.tokens == b.tokens and a.layers_run == b.layers_run
    rows_a = sum(t["head_rows"] for t in a.trace)
    rows_b = sum(t["head_rows"] for t in b.trace)
    assert sum(t["verify_calls"] for t in a.trace) == sum(t["verify_calls"] for t in b.trace)
    assert rows_a <= rows_b
