"""The oracle bound on early exit: per generated token, the earliest layer that already knows it.

For a dense greedy generation, the layer-l prediction of a token is argmax(norm(h_l) @ lm_head)
at the position before it. Two floors per token (1-based layer counts, like ``avg_layers``):

- ``first``: the earliest layer whose prediction equals the final token (what an exit test that
  is never wrong could achieve, verification included);
- ``stable``: the earliest layer from which the prediction stays equal through the last layer.

Their means are the floors beside every mode's ``avg_layers``; L / floor is the ideal speedup
of layer skipping alone (no predictor, verification or draft cost).
"""
from __future__ import annotations

import torch


@torch.inference_mode()
def layer_predictions(rt, prompt_ids: torch.Tensor, tokens: list[int], last_only: bool = False) -> torch.Tensor:
    """(T-1, L) argmax of every layer for tokens[1:] (the first token comes from the prefill,
    which never exits), by teacher-forcing prompt + tokens[:-1] once through the stack.
    ``last_only``: (T-1, 1), the full stack's alone (one LM-head product instead of L)."""
    if len(tokens) < 2:
        return torch.empty(0, rt.num_layers, dtype=torch.long)
    ids = torch.cat([prompt_ids, torch.tensor([tokens[:-1]], device=prompt_ids.device)], 1)
    p = prompt_ids.shape[1]
    cache = rt.new_cache(ids.shape[1])
    pos = rt.positions(cache, ids.shape[1])
    h = rt.embed(ids)
    rope = rt.rope(h, pos)
    preds = []
    for i in range(rt.num_layers):
        h = rt.run_layer(i, h, rope, cache, None, pos)
        if not last_only or i == rt.num_layers - 1:
            preds.append(rt.logits(h[0, p:]).argmax(-1))  # positions predicting tokens[1:]
    return torch.stack(preds, 1).cpu()


def oracle_layers(preds: torch.Tensor, final: list[int]) -> tuple[list[int], list[int]]:
    """Per token: (first, stable) 1-based layer counts. ``preds`` is (T, L); ``final`` the T
    emitted tokens. A token the last layer does not predict (cannot happen for dense greedy
    output, but guards foreign input) counts the whole stack."""
    T, L = preds.shape
    same = preds == torch.tensor(final, dtype=preds.dtype).view(T, 1)
    first, stable = [], []
    for row in same.tolist():
        first.append(next((i + 1 for i, s in enumerate(row) if s), L))
        j = L
        while j > 0 and row[j - 1]:
            j -= 1
        stable.append(j + 1 if j < L else L)
    return first, stable


def oracle_summary(first: list[int], stable: list[int], num_layers: int) -> dict:
    n = len(first)
    if not n:
        return {"tokens": 0}
    f, s = sum(first) / n, sum(stable) / n
    return {"tokens": n, "oracle_avg_layers": f, "oracle_stable_avg_layers": s,
            "ideal_speedup": num_layers / f, "ideal_speedup_stable": num_layers / s}


def own_oracle(rt, prompt_ids: torch.Tensor, tokens: list[int]) -> tuple[list[int], list[bool]]:
    """The oracle of a (possibly lossy) mode on its *own* emitted tokens: teacher-force them,
    and per token the earliest layer that already predicts what the full stack predicts at that
    context (1-based). Also whether the mode's token differs from that full-stack prediction."""
    preds = layer_predictions(rt, prompt_ids, tokens)
    if not len(preds):
        return [], []
    full = preds[:, -1].tolist()
    first, _ = oracle_layers(preds, full)
    return first, [t != f for t, f in zip(tokens[1:], full)]


def exit_gap(used: list[int], oracle: list[int], num_layers: int) -> dict:
    """Where a mode's exits land against the oracle, per token (1-based layer counts):
    at the oracle layer, 1-2 layers later, later still, never (the full stack although an
    earlier layer knew), or earlier (an exit below the oracle: its token is not the full stack's)."""
    n = len(used)
    if not n or len(oracle) != n:
        return {}
    d = [u - o for u, o in zip(used, oracle)]
    never = [u == num_layers and o < num_layers for u, o in zip(used, oracle)]
    hist: dict[int, int] = {}
    for x in d:
        hist[x] = hist.get(x, 0) + 1
    return {"tokens": n, "oracle_avg_layers": sum(oracle) / n,
            "avg_layers_over_oracle": (sum(used) / n) / (sum(oracle) / n),
            "share_at_oracle": sum(x == 0 for x in d) / n,
            "share_within_2": sum(1 <= x <= 2 and not nv for x, nv in zip(d, never)) / n,
            "share_later": sum(x > 2 and not nv for x, nv in zip(d, never)) / n,
            "share_never": sum(never) / n,
            "share_earlier": sum(x < 0 for x in d) / n,
            "layers_over_oracle_histogram": {str(k): hist[k] for k in sorted(hist)}}
