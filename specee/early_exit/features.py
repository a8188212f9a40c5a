"""The speculative predictor's input features (SpecEE §4.3), defined once for collection and decoding.

At a predictor layer l, with the draft's K speculative tokens S (in draft rank order):

    z_l = norm(h_l) @ lm_head.weight[S].T      K logits of the speculative tokens
    p_l = softmax(z_l)                          their local distribution
    d_l = p_l - p_prev                          its change since the previous predictor layer

``p_prev`` is layer l-1's p for this token (uniform 1/K at layer 0): what predictor training
sees, since collection evaluates every layer. A scheduled decoder therefore computes p at layer
l-1 whenever l is a predictor layer and l-1 is not (K dot products, no MLP):
``early_exit.delta_from=previous_layer``, the default. ``previous_evaluated`` instead takes p at
the last layer evaluated for this token (uniform before the first) -- cheaper, but a feature
distribution the predictors were not trained on. ``authors`` is the SpecEE authors' decoder: the
last evaluated layer's p, and nothing (zeros) before the token's first scheduled layer, so the gap
there is p itself (specee/early_exit/authors.py; their released bank reads these features).
"""
from __future__ import annotations

import torch

from specee.runtime.exit_math import features_from_logits, folded_logits  # the math the compiled step fuses
from specee.runtime.layer_math import RMS_NORMS

FEATURE_DEFINITION = ("concat(z, softmax(z), softmax(z) - p_prev) with z = norm(h_l) @ lm_head.weight[S].T, "
                      "S = draft top-K in rank order, p_prev = softmax(z) at layer l-1 for this token, "
                      "uniform 1/K at layer 0")

DELTA_FROM = ("previous_layer", "previous_evaluated", "authors")


def delta_probe_layers(eligible: list[bool], delta_from: str) -> list[bool]:
    """Layers where p is computed only to serve as the next predictor layer's p_prev."""
    if delta_from in ("previous_evaluated", "authors"):
        return [False] * len(eligible)
    n = len(eligible)
    return [i + 1 < n and eligible[i + 1] and not eligible[i] for i in range(n)]


def initial_p(k: int, like: torch.Tensor, delta_from: str = "previous_layer") -> torch.Tensor:
    """p_prev before a token's first predictor layer: uniform 1/K, or zeros as the authors' decoder."""
    return torch.full((k,), 0.0 if delta_from == "authors" else 1.0 / k, dtype=torch.float32, device=like.device)


class SpecProbe:
    """z_l = norm(h_l) @ lm_head.weight[S].T for one token, cheaply at every layer.

    The final norm's weight is folded into the K rows once per token, so a layer costs one
    (K x d) mat-vec and the RMS of h — a third of the time of norm-then-project on a CPU. Norms
    of another form (e.g. Gemma's 1 + weight) take the plain path. Computed in float32.
    """

    def __init__(self, rt, spec: torch.Tensor):
        norm, w = rt.norm, rt.lm_head.weight[spec]
        self.fast = type(norm).__name__ in RMS_NORMS  # weight * h / rms(h): the weight folds into the rows
        if self.fast:
            self.rows = w.float() * norm.weight.float()
            self.eps, self.inv_d = norm.variance_epsilon, 1.0 / w.shape[-1]
        else:
            self.rows, self.norm = w, norm

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.fast:
            return folded_logits(h, self.rows, self.eps, self.inv_d)
        return (self.rows @ self.norm(h).reshape(-1)).float()


def spec_features(normed_h: torch.Tensor, spec_weight: torch.Tensor, p_prev: torch.Tensor):
    """The same features from an already-normed hidden state: z = spec_weight @ normed_h."""
    return features_from_logits((spec_weight @ normed_h).float(), p_prev)


def adainfer_features(logits: torch.Tensor) -> torch.Tensor:
    """AdaInfer's two features from full-vocabulary logits: [gap = p1 - p2, top_prob = p1]."""
    top = torch.softmax(logits.float(), -1).topk(2, -1).values
    return torch.stack([top[..., 0] - top[..., 1], top[..., 0]], -1)
