"""Per-layer speculative predictors: Linear(3K, 512) -> ReLU -> Linear(512, 1) -> Sigmoid.

Training uses one ``nn.Sequential`` per layer; decoding uses :class:`PredictorBank`, the same
weights stacked so that a decision is two small matmuls and a compare against logit(threshold)
(sigmoid(x) > t  <=>  x > log(t / (1 - t))).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specee.cards import read_card, safetensors_shapes
from specee.errors import SpeceeError

WEIGHTS = "predictors.safetensors"
CARD = "predictors_card.json"
_FIX = "retrain the predictors (experiment=train_predictors) or point early_exit.predictors_path at others"


def make_mlp(k: int, hidden: int = 512) -> nn.Sequential:
    return nn.Sequential(nn.Linear(3 * k, hidden), nn.ReLU(), nn.Linear(hidden, 1))  # + sigmoid


def binary_metrics(prob: np.ndarray, y: np.ndarray, threshold: float) -> dict:
    pred = prob > threshold
    tp = int((pred & (y == 1)).sum()); fp = int((pred & (y == 0)).sum())
    fn = int((~pred & (y == 1)).sum())
    return {"n": int(len(y)), "accuracy": float((pred == (y == 1)).mean()) if len(y) else float("nan"),
            "precision": tp / (tp + fp) if tp + fp else float("nan"),
            "recall": tp / (tp + fn) if tp + fn else float("nan"),
            "positive_rate": float(y.mean()) if len(y) else float("nan"),
            "predicted_positive_rate": float(pred.mean()) if len(y) else float("nan")}


def train_layer(x_tr, y_tr, x_va, y_va, k: int, hidden: int, epochs: int, lr: float,
                batch: int, pos_weight: str, threshold: float, seed: int):
    """BCE + Adam. ``pos_weight='balanced'`` weights positives by n_neg/n_pos; 'none' keeps the
    natural prior (the decision then means "more likely than not", which favours precision)."""
    torch.manual_seed(seed)
    mlp = make_mlp(k, hidden)
    xt, yt = torch.as_tensor(x_tr, dtype=torch.float32), torch.as_tensor(y_tr, dtype=torch.float32)
    n_pos = float(yt.sum())
    w = None
    if pos_weight == "balanced" and 0 < n_pos < len(yt):
        w = torch.tensor((len(yt) - n_pos) / n_pos)
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=w)
    opt = torch.optim.Adam(mlp.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(xt), generator=g)
        for i in range(0, len(xt), batch):
            idx = perm[i:i + batch]
            loss = loss_fn(mlp(xt[idx]).squeeze(-1), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        p_va = torch.sigmoid(mlp(torch.as_tensor(x_va, dtype=torch.float32)).squeeze(-1)).numpy()
        p_tr = torch.sigmoid(mlp(xt).squeeze(-1)).numpy()
    return mlp, {"train": binary_metrics(p_tr, np.asarray(y_tr), threshold),
                 "held_out": binary_metrics(p_va, np.asarray(y_va), threshold)}


class PredictorBank(nn.Module):
    """All layers' predictors stacked; ``layers[i]`` says whether layer i has one."""

    def __init__(self, num_layers: int, k: int, hidden: int = 512, threshold: float = 0.5):
        super().__init__()
        self.k, self.num_layers = k, num_layers
        self.w1 = nn.Parameter(torch.zeros(num_layers, 3 * k, hidden), requires_grad=False)
        self.b1 = nn.Parameter(torch.zeros(num_layers, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(num_layers, hidden), requires_grad=False)
        self.b2 = nn.Parameter(torch.zeros(num_layers), requires_grad=False)
        self.register_buffer("has", torch.zeros(num_layers, dtype=torch.bool))
        self.set_threshold(threshold)

    def set_threshold(self, threshold: float) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise SpeceeError(f"early_exit.threshold={threshold} must lie in [0, 1]")
        self.threshold = threshold
        self._logit_t = math.inf if threshold >= 1 else -math.inf if threshold <= 0 \
            else math.log(threshold / (1 - threshold))

    def put(self, layer: int, mlp: nn.Sequential) -> None:
        with torch.no_grad():
            self.w1[layer] = mlp[0].weight.T
            self.b1[layer] = mlp[0].bias
            self.w2[layer] = mlp[2].weight[0]
            self.b2[layer] = mlp[2].bias[0]
        self.has[layer] = True

    def logit(self, layer: int, feats: torch.Tensor) -> torch.Tensor:
        if feats.dim() == 1:  # the decode hot path: two fused mat-vecs
            return torch.addmv(self.b1[layer], self._w1t[layer], feats).relu_().dot(self.w2[layer]) + self.b2[layer]
        return torch.relu(feats @ self.w1[layer] + self.b1[layer]) @ self.w2[layer] + self.b2[layer]

    @property
    def _w1t(self) -> torch.Tensor:
        """w1 transposed and contiguous (addmv wants (hidden, 3K)); rebuilt when w1 changes."""
        key = (self.w1.data_ptr(), self.w1._version, self.w1.device)
        if getattr(self, "_w1t_key", None) != key:
            self._w1t_cache, self._w1t_key = self.w1.transpose(1, 2).contiguous(), key
        return self._w1t_cache

    def prob(self, layer: int, feats: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit(layer, feats))

    def decide(self, layer: int, feats: torch.Tensor) -> torch.Tensor:
        """The exit decision as a device tensor (reading it on the host is the sync)."""
        return self.logit(layer, feats) > self._logit_t

    def fires(self, layer: int, feats: torch.Tensor) -> bool:
        return bool(self.decide(layer, feats))

    def save(self, folder: Path, card: dict) -> None:
        from safetensors.torch import save_file
        save_file({k: v.detach().float().contiguous() for k, v in self.state_dict().items()
                   if k != "has"} | {"has": self.has.to(torch.uint8)}, str(folder / WEIGHTS))
        (folder / CARD).write_text(json.dumps(card, indent=1))

    @classmethod
    def check(cls, folder: str | Path, num_layers: int, k: int) -> dict:
        """The card and weight shapes against this run (layers, K), without reading the weights
        (preflight, before the base model loads); returns the card."""
        folder = Path(folder)
        if not folder.is_dir() or not any((folder / f).exists() for f in (CARD, WEIGHTS)):
            raise SpeceeError(f"no trained predictors at early_exit.predictors_path={folder}; "
                              "train them with `python run.py experiment=train_predictors`")
        card = read_card(folder / CARD, _FIX, {"num_layers": int, "k": int}, "predictors card")
        if card["num_layers"] != num_layers or card["k"] != k:
            raise SpeceeError(f"predictors at {folder} were trained for {card['num_layers']} layers, "
                              f"K={card['k']}; this run has {num_layers} layers, K={k}. Retrain them "
                              "(experiment=train_predictors) or set early_exit.k to match")
        shapes = safetensors_shapes(folder / WEIGHTS, _FIX)
        hidden = (shapes.get("w1") or (0, 0, 0))[-1]
        want = {"w1": (num_layers, 3 * k, hidden), "b1": (num_layers, hidden), "w2": (num_layers, hidden),
                "b2": (num_layers,), "has": (num_layers,)}
        wrong = {n: shapes.get(n) for n, v in want.items() if shapes.get(n) != v}
        if wrong or hidden < 1:
            raise SpeceeError(f"{folder / WEIGHTS} does not hold predictors of {num_layers} layers, K={k} "
                              f"(shapes {wrong}); {_FIX}")
        return card

    @classmethod
    def load(cls, folder: str | Path, num_layers: int, k: int, threshold: float) -> tuple["PredictorBank", dict]:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        folder = Path(folder)
        card = cls.check(folder, num_layers, k)
        try:
            state = load_file(str(folder / WEIGHTS))
        except (SafetensorError, OSError, ValueError) as err:
            raise SpeceeError(f"{folder / WEIGHTS} is corrupt ({err}); retrain the predictors") from err
        try:
            bank = cls(num_layers, k, state["w1"].shape[-1], threshold)
            state["has"] = state["has"].bool()
            bank.load_state_dict(state)
        except (KeyError, RuntimeError) as err:
            raise SpeceeError(f"{folder / WEIGHTS} does not hold predictors of {num_layers} layers, K={k} "
                              f"({type(err).__name__}); retrain the predictors") from None
        return bank, card

    @classmethod
    def random(cls, num_layers: int, k: int, hidden: int = 512, seed: int = 0,
               threshold: float = 0.5) -> "PredictorBank":
        """Predictors of the trained shape with random weights: their cost, not their decisions
        (``model.init=random``)."""
        bank = cls(num_layers, k, hidden, threshold)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for i in range(num_layers):
                mlp = make_mlp(k, hidden)
                for prm in mlp.parameters():
                    prm.copy_(torch.randn(prm.shape, generator=g) * 0.1)
                bank.put(i, mlp)
        return bank

    @classmethod
    def constant(cls, num_layers: int, k: int, fire: bool) -> "PredictorBank":
        """A bank that always (fire=True) or never says "exit" — for ablations and tests."""
        bank = cls(num_layers, k, hidden=1)
        with torch.no_grad():
            bank.b2.fill_(1.0 if fire else -1.0)
        bank.has[:] = True
        return bank
