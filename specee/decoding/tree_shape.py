"""Static draft trees in EAGLE's ``choices`` format, and their index tables.

A tree is a list of paths; a path is the child ranks from the root, e.g. ``[0, 1]`` = the draft's
second-best continuation of its best first token. Node 0 is the root (the last accepted token,
not yet in the base model's cache); nodes 1..N are the paths, sorted by (depth, path), so a
node's ancestors always precede it.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import torch

from specee.errors import SpeceeError

# Sized for the tiny model: depth 4, 12 nodes, wide near the root where acceptance is likeliest.
SMALL = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0],
         [0, 0, 0, 0], [0, 0, 0, 1]]

# EAGLE-1's default tree (eagle/model/choices.py ``mc_sim_7b_63``): 25 nodes + root, depth 5.
MC_SIM_7B_63 = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
                [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
                [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]

NAMED = {"small": SMALL, "mc_sim_7b_63": MC_SIM_7B_63, "root": []}


def chain(depth: int) -> list[list[int]]:
    """A single chain of top-1 drafts (EAGLE without a tree; depth 0 = the root alone)."""
    return [[0] * d for d in range(1, depth + 1)]


def full(depth: int, width: int) -> list[list[int]]:
    """Every rank sequence with ranks < width up to ``depth``: width^1 + ... + width^depth nodes."""
    return [list(p) for d in range(1, depth + 1) for p in product(range(width), repeat=d)]


def beam(depth: int, width: int) -> list[list[int]]:
    """``width`` nodes per level, all children of the rank-0 chain: width * depth nodes."""
    return [[0] * (d - 1) + [r] for d in range(1, depth + 1) for r in range(width)]


@dataclass
class Tree:
    paths: list[tuple[int, ...]]  # node i (1..N) is paths[i - 1]; node 0 the root
    parent: list[int]  # parent[0] = -1
    depth: list[int]
    rank: list[int]  # child rank under the parent (root: 0)
    children: list[list[int]]  # node ids, by rank
    mask: torch.Tensor  # (N+1, N+1) bool: node i may attend to node j (j ancestor of i or i itself)
    leaves: list[int]
    root_paths: list[list[int]]  # one root-to-leaf node list per leaf (the merged hyper-tokens)

    @property
    def size(self) -> int:
        return len(self.parent)

    def level(self, d: int) -> list[int]:
        return [i for i, x in enumerate(self.depth) if x == d]

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    def walk(self, next_token: list[int], tokens: list[int]) -> list[int]:
        """Greedy acceptance: from the root follow the child whose token is the node's prediction.

        ``next_token[i]``: the base model's prediction after node i; ``tokens[i]``: node i's token.
        Returns the accepted node ids, root first; the bonus is next_token[walk[-1]]."""
        node, out = 0, [0]
        while True:
            nxt = next((c for c in self.children[node] if tokens[c] == next_token[node]), None)
            if nxt is None:
                return out
            node = nxt
            out.append(node)


def resolve(tree) -> list[list[int]]:
    """A named tree or a list of paths (each a list of integer ranks); anything else is one error."""
    if isinstance(tree, str):
        if tree not in NAMED:
            raise SpeceeError(f"tree={tree!r} is unknown; valid: {', '.join(NAMED)} or a list of paths")
        return NAMED[tree]
    bad = SpeceeError(f"tree={tree!r} is neither a named tree ({', '.join(NAMED)}) nor a list of paths "
                      "of integer ranks, e.g. [[0],[1],[0,0]]")
    try:
        paths = [list(p) for p in tree]
    except TypeError:
        raise bad from None
    if not all(isinstance(r, int) and not isinstance(r, bool) for p in paths for r in p):
        raise bad
    return paths


def build(tree) -> Tree:
    paths = sorted({tuple(int(r) for r in p) for p in resolve(tree)}, key=lambda p: (len(p), p))
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    if any(not p or min(p) < 0 for p in paths):
        raise SpeceeError("tree paths must be non-empty lists of ranks >= 0")
    missing = [list(p) for p in paths if p[:-1] not in index]
    if missing:
        raise SpeceeError(f"tree paths {missing[:3]} lack their parent path; list every prefix")
    n = len(paths) + 1
    parent = [-1] + [index[p[:-1]] for p in paths]
    depth = [0] + [len(p) for p in paths]
    rank = [0] + [p[-1] for p in paths]
    children = [[] for _ in range(n)]
    for i in range(1, n):
        children[parent[i]].append(i)  # paths are sorted, so children come in rank order
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[parent[i]]
    leaves = [i for i in range(n) if not children[i]]
    root_paths = [[j for j in range(n) if mask[leaf, j]] for leaf in leaves]
    return Tree(paths, parent, depth, rank, children, mask, leaves, root_paths)


def independent_units(tree: Tree) -> list[int]:
    """The paper's independent mapping (its Fig. 13): one predictor per node that has children,
    deciding among them; the root always has one (alone it is autoregressive SpecEE)."""
    return [v for v in range(tree.size) if v == 0 or tree.children[v]]


def predictor_evals_per_layer(tree: Tree, mapping: str) -> int:
    """Predictor evaluations per scheduled layer of one verification step (what costs time)."""
    return len(independent_units(tree)) if mapping == "independent" else len(tree.leaves)


def mapping_complexity(tree: Tree, mapping: str, k: int = 4) -> int:
    """The paper's mapping complexity (what "exponential vs linear" is about): independent, the
    product of the predictors' search spaces (a node's children; k for a childless root);
    merged, the number of hyper-tokens (root-to-leaf paths)."""
    if mapping == "merged":
        return len(tree.leaves)
    out = 1
    for v in independent_units(tree):
        out *= len(tree.children[v]) or k
    return out


def describe(t: Tree) -> dict:
    """Both quantities for both mappings: evaluations per layer and mapping complexity."""
    return {"nodes": t.size, "depth": t.max_depth, "leaves": len(t.leaves),
            **{f"{m}_evals_per_layer": predictor_evals_per_layer(t, m) for m in ("independent", "merged")},
            **{f"{m}_complexity": mapping_complexity(t, m) for m in ("independent", "merged")}}


# The paper's Fig. 13 example: root -> 3 tokens, each -> 3 tokens (13 nodes).
FIGURE_13 = [[a] for a in range(3)] + [[a, b] for a in range(3) for b in range(3)]


def sweep(depths=range(1, 6), widths=(1, 2, 3, 4)) -> list[dict]:
    """Both mappings' costs for full and beam trees of growing depth and width."""
    return [{"shape": shape, "width": w, **describe(build(make(d, w)))}
            for shape, make in (("full", full), ("beam", beam)) for w in widths for d in depths]


if __name__ == "__main__":  # python -m specee.decoding.tree_shape
    print("evals = predictor evaluations per scheduled layer; complexity = the paper's mapping complexity")
    print(f"{'shape':12} {'w':>2} {'d':>2} {'nodes':>6} {'leaves':>6} {'indep. evals':>12} "
          f"{'merged evals':>12} {'indep. complexity':>18} {'merged complexity':>18}")
    named = [(n, "", build(n)) for n in ("small", "mc_sim_7b_63")] + [("figure_13", "", build(FIGURE_13))]
    rows = [(r["shape"], r["width"], r) for r in sweep()] + [(n, w, describe(t)) for n, w, t in named]
    for shape, w, r in rows:
        print(f"{shape:12} {w:>2} {r['depth']:>2} {r['nodes']:>6} {r['leaves']:>6} "
              f"{r['independent_evals_per_layer']:>12} {r['merged_evals_per_layer']:>12} "
              f"{r['independent_complexity']:>18} {r['merged_complexity']:>18}")
