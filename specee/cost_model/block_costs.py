"""One measured block-cost table, c(n): the time of one whole-model verification forward over a
block of n new tokens, for every n a method may ask for.

Every speculative method's step is "draft something, then verify n tokens in one forward": a
prompt-lookup proposal of N tokens is a block of N + 1, an EAGLE tree of n nodes a block of n, a
plain decode step a block of 1. On a GPU c(n) is nearly flat for small n; on a CPU it is not even
monotone (oneDNN picks kernels by shape: a block of 4-5 can cost less than one of 2-3), so every
choice of draft length or tree size must read the table measured on the machine and runtime at
hand, not assume a shape. This module measures it once, in one place; the proposal-length choice,
the cost-shaped tree and the potential ceilings all read the same table.

A block is the causal chain (prompt lookup, a draft chain); a tree of the same size reads the
same weights and attends to the same cached entries, with a different mask over the new tokens,
so one table serves both (the tree mask's own cost is measured in the tree decoder's units).
"""
from __future__ import annotations

import statistics

import torch

from specee.phases import Clock

DEFAULT_SIZES = tuple(range(1, 17)) + (20, 26, 32)


@torch.inference_mode()
def measure_block_costs(rt, context_ids: torch.Tensor, sizes=DEFAULT_SIZES, rounds: int = 10, calls: int = 2,
                        warmup_rounds: int = 2) -> dict:
    """c(n) at the context of ``context_ids`` (1 x T, already the run's context length): one
    forward of n tokens through every layer, the final norm and the LM head over all n rows,
    argmax read on the host (what a verification needs). Interleaved: every round times every n
    once (the order reversed on odd rounds, so no size always follows the same one), as the mean
    of ``calls`` back-to-back calls; the K/V a call appends is cropped, so every call sees the same
    context. Returns per-size medians and per-round samples (us) and ``ratio`` = c(n) / c(1)."""
    sizes = sorted({int(n) for n in sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"block sizes must be >= 1, got {sizes}")
    clock = Clock(rt.device)
    context = context_ids.shape[1]
    cache = rt.new_cache(context + max(sizes) + 1)
    rt.forward(context_ids, cache)
    token = context_ids[:, -1:]
    blocks = {n: token.repeat(1, n) for n in sizes}

    def block(n: int) -> None:
        h = rt.forward(blocks[n], cache, commit=False)
        rt.lm_head(rt.norm(h)[0]).argmax(-1).tolist()
        cache.crop(context)

    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(warmup_rounds + rounds):
        order = sizes if r % 2 == 0 else sizes[::-1]
        for n in order:
            t0 = clock()
            for _ in range(calls):
                block(n)
            dt = (clock() - t0) / calls
            if r >= warmup_rounds:
                samples[n].append(1e6 * dt)
    median = {n: statistics.median(v) for n, v in samples.items()}
    base = median.get(1) or median[sizes[0]]
    return {"sizes": sizes, "median_us": {str(n): round(median[n], 1) for n in sizes},
            "samples_us": {str(n): [round(x, 1) for x in samples[n]] for n in sizes},
            "ratio": {str(n): round(median[n] / base, 4) for n in sizes},
            "context": context, "rounds": rounds, "calls": calls, "runtime": rt.kind,
            "threads": torch.get_num_threads(), "device": str(rt.device),
            "method": "measured: whole-model forward of n new tokens + LM head over n rows + host argmax, "
                      "interleaved rounds, medians"}


def cost_of(table: dict, n: int) -> float:
    """c(n) in us from a table of :func:`measure_block_costs` (or its JSON). A size between two
    measured ones is interpolated linearly; beyond the largest, extrapolated from the last two
    (a block that large was never measured: say so where it matters)."""
    med = {int(k): float(v) for k, v in table["median_us"].items()}
    if n in med:
        return med[n]
    xs = sorted(med)
    if n < xs[0]:
        return med[xs[0]]
    lo = max((x for x in xs if x < n), default=xs[-2] if len(xs) > 1 else xs[0])
    hi = min((x for x in xs if x > n), default=None)
    if hi is None:  # extrapolate from the last two sizes
        if len(xs) == 1:
            return med[xs[0]] * n / xs[0]
        lo, hi = xs[-2], xs[-1]
    return med[lo] + (med[hi] - med[lo]) * (n - lo) / (hi - lo)
