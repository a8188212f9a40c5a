"""The memory-bandwidth bound on single-stream decoding.

Decoding one token reads every decoder layer's weights, the final norm and the LM head, and every
layer's K/V of the context; at batch size 1 nothing is reused, so no runtime can beat

    limit_ms_per_token = bytes_per_token / copy bandwidth

where the bandwidth is measured STREAM-copy style on the runtime's device (a large tensor copied,
bytes read + bytes written over the best time). A mode's ms/token as a multiple of this limit says
how far per-op overheads, not the model, set its speed. The embedding row (one row per token) is
left out; early-exit modes read fewer layers, so their floor is lower than the dense one reported.
"""
from __future__ import annotations

import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def copy_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second of a device-to-same-device copy (read + write), best of ``repeats``."""
    a = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    b.copy_(a)  # first touch / allocation, untimed
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * a.element_size() / best


def bytes_per_token(rt, context_tokens: float) -> dict:
    """Weights and K/V one dense decode step reads at a context of ``context_tokens``."""
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    weights = size(p for layer in rt.layers for p in layer.parameters()) + size(rt.norm.parameters()) \
        + size(rt.lm_head.parameters())
    elem = torch.finfo(rt.dtype).bits // 8
    kv = 2 * rt.num_layers * rt.kv_heads * rt.head_dim * context_tokens * elem
    return {"weights": int(weights), "kv": int(kv), "total": int(weights + kv)}


def bound(rt, context_tokens: float, bandwidth: float) -> dict:
    b = bytes_per_token(rt, context_tokens)
    return {"copy_gb_per_s": bandwidth / 1e9, "mean_context_tokens": context_tokens,
            "bytes_per_token": b, "limit_ms_per_token": 1e3 * b["total"] / bandwidth,
            "method": "STREAM-style copy of 256 MiB on the runtime's device, best of 5; dense reads"}
