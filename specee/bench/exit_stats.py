"""Exit-layer statistics (SpecEE §5): skew of the distribution and context similarity.

Exit layers are 0-based layer indices; a token that ran the whole stack has exit L-1.
"""
from __future__ import annotations

import numpy as np


def distribution(exits: list[int], num_layers: int) -> dict:
    counts = np.bincount(np.asarray(exits, dtype=int), minlength=num_layers)[:num_layers]
    share = counts / max(1, counts.sum())
    half = num_layers // 2
    return {
        "tokens": int(counts.sum()),
        "share_per_layer": share.round(5).tolist(),
        # The paper's skew numbers: most layers see fewer exits than a uniform spread would give,
        # and the exits crowd into part of the stack.
        "share_of_layers_below_uniform": float((share < 1 / num_layers).mean()),
        # The paper's skew statistic: rank the layers by exit probability; the half of the layers
        # with the fewest exits holds this share of them (the paper: <= 20 %).
        "skew_bottom_half_by_probability": float(np.sort(share)[:half].sum()),
        # The same half taken by depth (the shallower layers): a different quantity.
        "share_of_exits_in_shallower_half_by_depth": float(share[:half].sum()),
        "share_without_exit": float(share[num_layers - 1]),
        "mean_exit_layer": float(np.dot(np.arange(num_layers), share)),
    }


def _windows(prev: np.ndarray, w: int, num_layers: int) -> np.ndarray:
    covered = np.zeros(num_layers, dtype=bool)
    for x in prev:
        covered[max(0, x - w): min(num_layers, x + w + 1)] = True
    return covered


def hit_rate(sequences: list[list[int]], n: int, w: int, num_layers: int) -> tuple[float, float, int]:
    """P(exit_t in the union of ±w windows around exits t-1..t-n), and the analytic chance: the
    covered share of the stack (what a uniformly random layer would hit). Per request; tokens
    with fewer than n predecessors are not counted."""
    hits, cover, count = 0, 0.0, 0
    for seq in sequences:
        seq = np.asarray(seq, dtype=int)
        for t in range(n, len(seq)):
            covered = _windows(seq[t - n:t], w, num_layers)
            hits += bool(covered[seq[t]])
            cover += covered.mean()
            count += 1
    return (hits / count if count else float("nan"), cover / count if count else float("nan"), count)


def shuffled_hit_rate(sequences: list[list[int]], n: int, w: int, num_layers: int,
                      permutations: int = 20, seed: int = 0) -> float:
    """The same statistic with exit layers shuffled across positions within each request:
    the marginal distribution stays, the order (context) goes."""
    rng = np.random.default_rng(seed)
    rates = []
    for _ in range(permutations):
        shuffled = [rng.permutation(np.asarray(s)).tolist() for s in sequences]
        rates.append(hit_rate(shuffled, n, w, num_layers)[0])
    return float(np.mean(rates))


def context_similarity(sequences: list[list[int]], w: int, num_layers: int, max_n: int = 10) -> list[dict]:
    rows = []
    for n in range(1, max_n + 1):
        rate, analytic, count = hit_rate(sequences, n, w, num_layers)
        rows.append({"n": n, "hit_rate": rate, "shuffled_chance": shuffled_hit_rate(sequences, n, w, num_layers),
                     "analytic_coverage": analytic, "tokens": count})
    return rows
