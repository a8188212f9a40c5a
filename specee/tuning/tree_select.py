"""A draft tree chosen by measured costs (``ablation.tree_select=auto``), not fixed.

EAGLE's default 26-node tree assumes a GPU, where verifying 26 tokens costs about one token. On a
CPU a verification block of n tokens costs c(n) (:mod:`specee.cost_model.block_costs`, measured on this
machine and runtime), so the best tree is the one that maximises expected tokens per unit time:

    E[tokens | tree] = 1 + sum over nodes v of P(v's path is accepted)
    time(tree)       = draft(levels) + c(nodes + 1)

with P(path) the product of the acceptance of each node's rank at its depth (Sequoia's positional
model; EAGLE-2 ranks candidate nodes by the same path product). The acceptance p[depth][rank] is
measured by running EAGLE with a *beam* tree (``width`` children under every node of the rank-0
chain) over calibration prompts: whenever the walk reaches depth d - 1 along the rank-0 chain, the
rank accepted at depth d (or none) is one observation. For each size n, the best tree under this
model is grown greedily by path probability (every child's path probability is at most its
parent's, so the n best nodes always form a tree); the size with the highest rate wins.
"""
from __future__ import annotations

from specee.errors import SpeceeError


def acceptance_table(walk_ranks: list[list[int]], depth: int, width: int) -> dict:
    """p[d-1][r] = P(the rank-r child is accepted at depth d | the walk reached depth d-1 on the
    rank-0 chain), from the accepted ranks of each step of a ``beam(depth, width)`` tree."""
    seen = [0] * depth
    hits = [[0] * width for _ in range(depth)]
    for ranks in walk_ranks:
        for d in range(depth):
            if any(r != 0 for r in ranks[:d]) or len(ranks) < d:
                break  # the walk left the chain (or stopped) before depth d + 1: no observation
            seen[d] += 1
            if len(ranks) > d:
                hits[d][ranks[d]] += 1
    p = [[(h / seen[d]) if seen[d] else 0.0 for h in hits[d]] for d in range(depth)]
    return {"p": p, "observations": seen, "steps": len(walk_ranks), "depth": depth, "width": width}


def path_probability(path, p) -> float:
    prob = 1.0
    for d, r in enumerate(path):
        if d >= len(p) or r >= len(p[d]):
            return 0.0  # beyond what was measured: never counted on
        prob *= p[d][r]
    return prob


def expected_tokens(paths, p) -> float:
    """Tokens one step emits on average: the accepted nodes plus the bonus token."""
    return 1.0 + sum(path_probability(tuple(q), p) for q in paths)


def grow(p, max_nodes: int) -> list[list[tuple[int, ...]]]:
    """The best tree of every size 1..max_nodes under the positional model: node by node, the
    frontier child (next depth or next rank) with the highest path probability."""
    chosen: list[tuple[int, ...]] = []
    frontier = {(r,): path_probability((r,), p) for r in range(len(p[0]) if p else 0)}
    trees = []
    while frontier and len(chosen) < max_nodes:
        best = max(frontier, key=lambda q: (frontier[q], -len(q), [-r for r in q]))
        if frontier.pop(best) <= 0.0:
            break  # nothing left that is ever accepted
        chosen.append(best)
        if len(best) < len(p):
            for r in range(len(p[len(best)])):
                child = best + (r,)
                frontier[child] = path_probability(child, p)
        trees.append(sorted(chosen, key=lambda q: (len(q), q)))
    return trees


def choose(p, block_us, draft_level_us, dense_us: float, max_nodes: int, step_extra_us: float = 0.0) -> dict:
    """The tree with the most expected tokens per microsecond. ``block_us(n)``: c(n) of a
    verification block of n tokens (root included); ``draft_level_us(w)``: one draft forward over
    a level of w nodes; ``dense_us``: one dense decode step (the speedup's reference)."""
    if max_nodes < 1:
        raise SpeceeError(f"ablation.tree_max_nodes={max_nodes} must be >= 1")
    rows = []
    trees = grow(p, max_nodes)
    # a draft never accepted at depth 1: no tree helps; the smallest one runs, and the result says so
    note = None if trees else "no draft token was accepted at depth 1 on the calibration prompts: no tree can help"
    for paths in trees or [[(0,)]]:
        widths = [sum(1 for q in paths if len(q) == d) for d in range(1, max(map(len, paths)) + 1)]
        # the draft reads the root, then one forward per level that has children to propose
        draft = draft_level_us(1) + sum(draft_level_us(w) for w in widths[:-1])
        t = draft + block_us(len(paths) + 1) + step_extra_us
        e = expected_tokens(paths, p)
        rows.append({"nodes": len(paths), "depth": len(widths), "expected_tokens": e, "step_us": t,
                     "us_per_token": t / e, "predicted_speedup": dense_us * e / t,
                     "paths": [list(q) for q in paths]})
    best = max(rows, key=lambda r: (r["predicted_speedup"], -r["nodes"]))
    return {"chosen": best, "candidates": [{k: v for k, v in r.items() if k != "paths"} for r in rows],
            "note": note}


def measure_acceptance(rt, draft, prompts, max_new_tokens: int, depth: int, width: int) -> dict:
    """p[depth][rank] from EAGLE with a beam tree over ``prompts`` (token-id tensors)."""
    from specee.decoding.tree import TreeDecoder
    from specee.decoding.tree_shape import beam
    decoder = TreeDecoder(rt, draft, beam(depth, width), k=width)
    ranks = [t["walk_ranks"] for ids in prompts for t in decoder.generate(ids, max_new_tokens).trace]
    return acceptance_table(ranks, depth, width)


def measure_draft_levels(rt, draft, context_ids, widths, rounds: int = 6) -> dict:
    """us of one draft forward over a level of w nodes (+ its top-k), at the context of
    ``context_ids``, for each w; medians over interleaved rounds, the draft cache cropped back."""
    import statistics

    import torch

    from specee.phases import Clock
    clock = Clock(rt.device)
    n = context_ids.shape[1]
    dcache = draft.new_cache(n + max(widths) + 2)
    with torch.inference_mode():
        f = rt.norm(rt.forward(context_ids, rt.new_cache(n + 1)))
        draft(context_ids[:, 1:], f[:, :-1], dcache)
        base = dcache.lengths[0]
        samples = {w: [] for w in widths}
        for r in range(rounds + 1):
            for w in widths:
                ids = context_ids[:, -1:].repeat(1, w)
                feats = f[:, -1:].repeat(1, w, 1)
                pos = torch.full((1, w), base, device=rt.device)
                mask = rt._additive_mask(base, w, torch.eye(w, dtype=torch.bool, device=rt.device))
                t0 = clock()
                out = draft(ids, feats, dcache, pos, mask)
                draft.topk(out[0], 4).tolist()
                dt = clock() - t0
                dcache.crop(base)
                if r:
                    samples[w].append(1e6 * dt)
    return {str(w): statistics.median(v) for w, v in samples.items()}


def select_tree(rt, draft, calibration_prompts, context_ids, max_nodes: int, depth: int = 6, width: int = 4,
                max_new_tokens: int = 32) -> dict:
    """Measure acceptance, c(n) and the draft's level costs here, and choose the tree (see module doc)."""
    from specee.cost_model.block_costs import cost_of, measure_block_costs
    acc = measure_acceptance(rt, draft, calibration_prompts, max_new_tokens, depth, width)
    blocks = measure_block_costs(rt, context_ids, sizes=range(1, max_nodes + 2), rounds=6)
    levels = measure_draft_levels(rt, draft, context_ids, range(1, min(max_nodes, width * depth) + 1))
    out = choose(acc["p"], lambda n: cost_of(blocks, n), lambda w: levels[str(min(w, len(levels)))],
                 cost_of(blocks, 1), max_nodes)
    return {**out, "acceptance": acc, "block_costs": blocks, "draft_level_us": levels,
            "method": "acceptance by (depth, rank) from a beam tree on calibration prompts (positional model); "
                      "c(n) and draft level costs measured here; greedy growth by path probability"}


_CHOSEN: dict = {}  # one choice per runtime and setting: a job builds its decoder more than once


def auto_tree(cfg, rt, draft) -> dict:
    """``ablation.tree_select=auto``: the tree chosen for this model, draft, machine and runtime,
    from ``ablation.tree_calibration_prompts`` calibration prompts (disjoint from evaluation)."""
    a = cfg.ablation
    key = (id(rt), id(draft), a.tree_max_nodes, a.tree_calibration_prompts, cfg.early_exit.k)
    if key in _CHOSEN:
        return _CHOSEN[key]
    from specee.tuning.auto_settings import calibration_inputs
    new_tokens = 32
    # spread over the calibration set: Spec-Bench categories and story openings alike
    ids, picked_ids, files = calibration_inputs(cfg, rt, a.tree_calibration_prompts, new_tokens)
    context = max(ids, key=lambda t: t.shape[1])[:, -256:]  # c(n) at a typical prompt's context
    width = max(cfg.early_exit.k, 1)
    out = select_tree(rt, draft, ids, context, a.tree_max_nodes, width=width, max_new_tokens=new_tokens)
    out.update({"calibration_prompt_ids": picked_ids, "data_files": files,
                "context": int(context.shape[1]), "runtime": rt.kind})
    _CHOSEN[key] = out
    return out
