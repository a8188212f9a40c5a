"""The speculative predictor's input features (SpecEE §4.3), defined once for collection and decoding.

At a predictor layer l, with the draft's K speculative tokens S (in draft rank order):

    z_l = norm(h_l) @ lm_head.weight[S].T      K logits of the speculative tokens
    p_l = softmax(z_l)                          their local distribution
    d_l = p_l - p_prev                          its change since the previous predictor layer

``p_prev`` is p at the previous predictor layer *evaluated for this token*; before the first
evaluated layer it is the uniform distribution 1/K. Collection evaluates every layer, so there
p_prev is layer l-1's; a scheduled decoder uses whatever layer it evaluated last — the same
definition, applied to the layers that actually ran.
"""
from __future__ import annotations

import torch

FEATURE_DEFINITION = ("concat(z, softmax(z), softmax(z) - p_prev) with z = norm(h_l) @ lm_head.weight[S].T, "
                      "S = draft top-K in rank order, p_prev = softmax(z) at the previous predictor "
                      "layer evaluated for this token, uniform 1/K before the first")


def initial_p(k: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full((k,), 1.0 / k, dtype=like.dtype, device=like.device)


def spec_features(normed_h: torch.Tensor, spec_weight: torch.Tensor, p_prev: torch.Tensor):
    """normed_h: (d,) final-normed hidden; spec_weight: (K, d) = lm_head.weight[S].

    Returns (features (3K,), p (K,)) — pass p back as the next call's p_prev.
    """
    z = spec_weight @ normed_h
    p = torch.softmax(z.float(), -1).to(z.dtype)
    return torch.cat([z, p, p - p_prev]), p


def adainfer_features(logits: torch.Tensor) -> torch.Tensor:
    """AdaInfer's two features from full-vocabulary logits: [gap = p1 - p2, top_prob = p1]."""
    top = torch.softmax(logits.float(), -1).topk(2, -1).values
    return torch.stack([top[..., 0] - top[..., 1], top[..., 0]], -1)
