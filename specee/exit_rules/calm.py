"""CALM's confidence measures (Schuster et al., 2022, "Confident Adaptive Language Modeling",
section 3.5): softmax response and hidden-state saturation, each needing nothing fitted. CALM's
third measure, the learned early-exit classifier, is :mod:`specee.exit_rules.calm_classifier`."""
from __future__ import annotations

import torch

from specee.exit_rules import ExitRule


class SoftmaxResponse(ExitRule):
    """The gap between the top two probabilities of the layer's full LM head: confident when one
    token dominates. Every decision costs a full LM head (as AdaInfer's)."""
    name = "calm_softmax"
    label = "CALM softmax response"
    grid = (0.99, 0.95, 0.9, 0.8, 0.6, 0.4, 0.2)
    default = 0.9
    reads_head = True
    source = "CALM (Schuster et al., 2022), sec. 3.5: softmax response, top-1 minus top-2 probability"

    def layer_scores(self, i, h_prev, h, logits):
        top = torch.softmax(logits.float(), -1).topk(2, -1).values
        return top[..., 0] - top[..., 1]


class HiddenStateSaturation(ExitRule):
    """The cosine similarity of the layer's hidden state with its input (the previous layer's
    output): a state that stopped changing. Nearly free: no LM head until it exits."""
    name = "calm_saturation"
    label = "CALM hidden-state saturation"
    grid = (0.999, 0.998, 0.995, 0.99, 0.98, 0.95, 0.9, 0.8)
    default = 0.99
    source = "CALM (Schuster et al., 2022), sec. 3.5: hidden-state saturation, cos(h_l, h_{l-1})"

    def layer_scores(self, i, h_prev, h, logits):
        return torch.nn.functional.cosine_similarity(h.float(), h_prev.float(), dim=-1)
