"""Aten ops dispatched per decoded token: the harness's eager loop against the model's own forward.

On a host-bound step (batch 1, small layers, or any eager GPU step) every dispatched op costs host
time whether or not it moves data, so the count is a speed measure that does not depend on how busy
the machine is. Both sides are counted over the same greedy decode steps after the same prompt.
"""
from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active, by op (overload packet) name."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def loop_ops(decoder, prompt_ids: torch.Tensor, steps: int = 5) -> collections.Counter:
    """Ops of ``steps`` decode steps of a stepped decoder (its ``prefill`` then ``step``), prefill not counted."""
    session, _ = decoder.prefill(prompt_ids, steps + 1)
    with OpCounter() as c:
        for _ in range(steps):
            decoder.step(session)
    return c.ops


@torch.inference_mode()
def hf_forward_ops(model, prompt_ids: torch.Tensor, steps: int = 5) -> collections.Counter:
    """Ops of ``steps`` greedy steps of the model's own forward over its DynamicCache, one token at a
    time (what transformers' eager ``generate`` runs per token, without its logits processors)."""
    import inspect

    from transformers import DynamicCache
    # transformers >= 5.25 names the argument ``cache`` (``past_key_values`` deprecated); older, the reverse
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    kw = {name: DynamicCache(config=model.config), "use_cache": True}
    token = model(prompt_ids, **kw).logits[:, -1:].argmax(-1)
    with OpCounter() as c:
        for _ in range(steps):
            token = model(token, **kw).logits[:, -1:].argmax(-1)
    return c.ops


def per_token(ops: collections.Counter, steps: int = 5) -> float:
    return sum(ops.values()) / steps


def loop_ops_per_token(decoder, prompt_ids, steps: int = 5) -> float:
    return per_token(loop_ops(decoder, prompt_ids, steps), steps)


def hf_forward_ops_per_token(model, prompt_ids, steps: int = 5) -> float:
    return per_token(hf_forward_ops(model, prompt_ids, steps), steps)


def histogram_diff(a: collections.Counter, b: collections.Counter, steps: int = 5) -> list[tuple[str, float, float]]:
    """(op, a per token, b per token) for every op whose count differs, largest difference first."""
    rows = [(k, a[k] / steps, b[k] / steps) for k in set(a) | set(b) if a[k] != b[k]]
    return sorted(rows, key=lambda r: -abs(r[1] - r[2]))
