"""CALM's third confidence measure (Schuster et al., 2022, sec. 3.5): a learned early-exit
classifier. One linear layer, shared by every layer, on the direction of the layer's hidden state
(h / ||h||: the residual stream's scale grows with depth, its direction is what one linear map can
share across layers), trained with CALM's consistency label — the layer's argmax is already the
full stack's token, the label SpecEE's predictors are trained on — on the prompts those predictors
are trained on (``python run.py experiment=train_exit_rules``). Nearly free: a d-wide dot product
per layer, one LM head where it exits."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from specee.errors import SpeceeError
from specee.exit_rules import ExitRule

FILE = "calm_classifier.json"
FIX = "retrain it (python run.py experiment=train_exit_rules) or point early_exit.exit_rules_path at another"


class LearnedClassifier(ExitRule):
    name = "calm_classifier"
    label = "CALM learned classifier"
    grid = (0.99, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.2)
    default = 0.9
    fitted_on = ("experiment=train_exit_rules: dense greedy generations of the predictors' training prompts, "
                 "label = the layer's argmax is already the full stack's token")
    source = "CALM (Schuster et al., 2022), sec. 3.5: early-exit classifier, a linear map on the hidden state"

    def __init__(self, coef, intercept: float, card: dict | None = None):
        self.w = torch.as_tensor(coef, dtype=torch.float32)
        self.b = float(intercept)
        self.card_ = card or {}

    def to(self, device) -> "LearnedClassifier":
        self.w = self.w.to(device)
        return self

    def layer_scores(self, i, h_prev, h, logits):
        return torch.sigmoid(self.features(h) @ self.w.to(h.device) + self.b)

    @staticmethod
    def features(h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(h.float(), dim=-1)

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray, l2: float = 1e-3, steps: int = 200) -> "LearnedClassifier":
        """Logistic regression by L-BFGS (the loss is convex) on rows ``x`` (N, d) and labels ``y``."""
        xs = torch.as_tensor(x, dtype=torch.float32)
        ys = torch.as_tensor(y, dtype=torch.float32)
        w = torch.zeros(xs.shape[1], requires_grad=True)
        b = torch.zeros((), requires_grad=True)
        opt = torch.optim.LBFGS([w, b], lr=0.5, max_iter=steps, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(xs @ w + b, ys) + l2 * (w * w).sum()
            loss.backward()
            return loss
        opt.step(closure)
        return cls(w.detach(), float(b.detach()))

    def save(self, folder: Path, card: dict) -> None:
        (folder / FILE).write_text(json.dumps({**card, "coef": self.w.tolist(), "intercept": self.b}, indent=1))

    @classmethod
    def load(cls, cfg, rt) -> "LearnedClassifier":
        from specee.artifact_checks import check_card_values
        from specee.cards import read_card
        from specee.io import project_path
        from specee.models.loader import check_trained_for
        folder = project_path(cfg.early_exit.exit_rules_path)
        path = folder / FILE
        if not path.is_file():
            raise SpeceeError(f"no CALM classifier at {path}; train it with `python run.py experiment=train_exit_rules`")
        card = read_card(path, FIX, {"coef": list, "intercept": float}, "CALM classifier card")
        coef = card["coef"]
        d = rt.config.hidden_size
        if len(coef) != d or not all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
                                     for c in coef):
            raise SpeceeError(f"{path} is corrupt: coef must hold {d} finite numbers (this model's hidden size), "
                              f"not {len(coef)}; {FIX}")
        check_card_values(card, path, "CALM classifier card",
                          {"num_layers": "positive", "samples": "count", "base_weights_fingerprint": "text",
                           "calibration_prompt_ids": "ids"}, FIX)
        check_trained_for(card, cfg.early_exit.exit_rules_path, rt.model, "CALM classifier")
        return cls(coef, card["intercept"], card)

    @classmethod
    def standin(cls, rt) -> "LearnedClassifier":
        return cls(torch.zeros(rt.config.hidden_size), 0.0, {"synthetic": "zero weights: the classifier's cost only"})

    def trained_on(self) -> list[str]:
        return list(self.card_.get("calibration_prompt_ids", []))

    def card(self) -> dict:
        return {**super().card(), "trained": {k: v for k, v in self.card_.items() if k not in ("coef", "calibration_prompt_ids")}}
