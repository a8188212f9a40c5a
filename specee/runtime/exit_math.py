"""The tensor math of SpecEE's exit decision, written once: the eager probe and predictor bank
(specee/early_exit/) call it, the compiled step and the device walk fuse it into their graphs. It
sits in the runtime, below both, so a runtime never imports the early-exit package above it.

    z = norm(h_l) @ lm_head.weight[S].T      (folded_logits: the norm's weight folded into the rows)
    features = [z, softmax(z), softmax(z) - p_prev]
    logit = relu(W1 features + b1) . w2 + b2
"""
from __future__ import annotations

import torch


def folded_logits(h: torch.Tensor, rows: torch.Tensor, eps: float, inv_d: float) -> torch.Tensor:
    """z = norm(h) @ W[S].T with the RMSNorm's weight folded into ``rows`` (float32): one (K x d)
    mat-vec and the RMS of h. The eager probe and the compiled predictor step both call this."""
    v = h.reshape(-1).float()
    return (rows @ v) * torch.rsqrt(v.dot(v) * inv_d + eps)


def features_from_logits(z: torch.Tensor, p_prev: torch.Tensor):
    """(features (3K,), p (K,)) from the K speculative logits; pass p back as the next p_prev."""
    p = torch.softmax(z, -1)
    return torch.cat([z, p, p - p_prev]), p


def mlp_logit(feats: torch.Tensor, b1, w1t, w2, b2) -> torch.Tensor:
    """One layer's predictor logit on a feature vector: relu(W1 f + b1) . w2 + b2 (two fused
    mat-vecs; ``w1t`` is W1 as (hidden, 3K)). The eager bank and the compiled step both call this."""
    return torch.addmv(b1, w1t, feats).relu().dot(w2) + b2
