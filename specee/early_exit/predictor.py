"""Per-layer speculative predictors: Linear(3K, 512) -> ReLU -> Linear(512, 1) -> Sigmoid.

Training uses one ``nn.Sequential`` per layer; decoding uses :class:`PredictorBank`, the same
weights stacked so that a decision is two small matmuls and a compare against logit(threshold)
(sigmoid(x) > t  <=>  x > log(t / (1 - t))).

Calibration (``early_exit.calibration``): ``global`` (the paper's) compares every layer against the
one ``early_exit.threshold``; ``per_layer`` compares layer l against its own threshold t_l, chosen at
training time (``experiment.target_precision``, :func:`select_threshold`) and stored in the card as
``layer_thresholds``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specee.cards import read_card, safetensors_shapes
from specee.early_exit.features import features_from_logits
from specee.runtime.exit_math import mlp_logit
from specee.errors import SpeceeError

WEIGHTS = "predictors.safetensors"
CARD = "predictors_card.json"
_FIX = "retrain the predictors (experiment=train_predictors) or point early_exit.predictors_path at others"
# Optional card values read by decoders, preflight and the report, and their kinds
# (specee.artifact_checks.CARD_KINDS).
CARD_FIELDS = {"num_layers": "positive", "k": "positive", "threshold": "probability", "hidden": "positive",
               "base_weights_fingerprint": "text", "calibration_prompt_ids": "ids", "per_layer": "layer_rows"}
THRESHOLDS = "layer_thresholds"  # card key: one threshold per layer (early_exit.calibration=per_layer)
_THRESHOLDS_FIX = ("retrain them with experiment.target_precision=P (e.g. 0.8), which stores per-layer "
                   "thresholds, or use early_exit.calibration=global (early_exit.threshold for every layer)")


def logit_threshold(t: float) -> float:
    """The logit-space threshold: sigmoid(x) > t  <=>  x > logit(t) (t=1: never; t=0: always)."""
    return math.inf if t >= 1 else -math.inf if t <= 0 else math.log(t / (1 - t))


def select_threshold(prob: np.ndarray, y: np.ndarray, target_precision: float, min_fires: int) -> float:
    """The lowest threshold t (decision ``prob > t``) whose precision on (prob, y) reaches
    ``target_precision`` with at least ``min_fires`` fires: the most recall that precision allows.
    Candidates are 0 and the distinct probabilities (between two of them every t decides the
    same). None qualifies (the target is out of reach, or too few tokens to tell): 1.0, never fire."""
    prob, y = np.asarray(prob, dtype=np.float64), np.asarray(y).astype(bool)
    if not len(prob):
        return 1.0
    asc = np.sort(prob)
    pos_asc = y[np.argsort(prob, kind="stable")].astype(np.int64)
    cands = np.concatenate([[0.0], np.unique(asc)])
    cands = cands[cands < 1.0]
    # fires(t) = #{prob > t} = n - #{prob <= t}; true fires = positives among them.
    n_le = np.searchsorted(asc, cands, side="right")
    pos_le = np.concatenate([[0], np.cumsum(pos_asc)])[n_le]
    fires, tp = len(prob) - n_le, int(pos_asc.sum()) - pos_le
    with np.errstate(invalid="ignore", divide="ignore"):
        precision = np.where(fires > 0, tp / np.maximum(fires, 1), 0.0)
    ok = (fires >= min_fires) & (precision >= target_precision)
    return float(cands[np.argmax(ok)]) if ok.any() else 1.0


def check_thresholds(value, num_layers: int, where: str) -> list[float]:
    """A card's ``layer_thresholds``: ``num_layers`` finite numbers in [0, 1], else one SpeceeError."""
    ok = isinstance(value, list) and len(value) == num_layers and all(
        isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and 0 <= t <= 1 for t in value)
    if not ok:
        shown = f"a list of {len(value)}" if isinstance(value, list) else type(value).__name__
        raise SpeceeError(f"{where}: {THRESHOLDS!r} must be a list of {num_layers} numbers in [0, 1] (one per "
                          f"layer); it holds {shown} {str(value)[:60]!r}; {_THRESHOLDS_FIX}")
    return [float(t) for t in value]


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
        # per_layer calibration: logit(t_l) per layer, on the bank's device (not saved in the weights:
        # the thresholds live in the card)
        self.register_buffer("_logit_thr", torch.zeros(0), persistent=False)
        self.layer_thresholds: list[float] | None = None
        self.set_threshold(threshold)

    def set_threshold(self, threshold: float) -> None:
        """``global`` calibration: one threshold for every layer (the paper's; the default)."""
        if not 0.0 <= threshold <= 1.0:
            raise SpeceeError(f"early_exit.threshold={threshold} must lie in [0, 1]")
        self.threshold, self.layer_thresholds = threshold, None
        self._logit_t = logit_threshold(threshold)
        self._logit_thr = torch.zeros(0, device=self.has.device)

    def set_layer_thresholds(self, thresholds) -> None:
        """``per_layer`` calibration: layer l fires when sigmoid(logit) > thresholds[l]."""
        if not isinstance(thresholds, list):  # an array or tensor
            thresholds = np.asarray(thresholds, dtype=np.float64).reshape(-1).tolist()
        thresholds = check_thresholds(thresholds, self.num_layers, "per-layer thresholds")
        self.layer_thresholds = thresholds
        self._logit_thr = torch.tensor([logit_threshold(t) for t in thresholds], dtype=torch.float32,
                                       device=self.has.device)
        # not one number: the compiled runtime's fused predictor (which takes one) steps aside
        self._logit_t = math.nan

    @property
    def calibration(self) -> str:
        return "global" if self.layer_thresholds is None else "per_layer"

    def put(self, layer: int, mlp: nn.Sequential) -> None:
        with torch.no_grad():
            self.w1[layer] = mlp[0].weight.T
            self.b1[layer] = mlp[0].bias
            self.w2[layer] = mlp[2].weight[0]
            self.b2[layer] = mlp[2].bias[0]
        self.has[layer] = True

    def logit(self, layer: int, feats: torch.Tensor) -> torch.Tensor:
        if feats.dim() == 1:  # the decode hot path: two fused mat-vecs
            return mlp_logit(feats, *self.layer_params(layer))
        return torch.relu(feats @ self.w1[layer] + self.b1[layer]) @ self.w2[layer] + self.b2[layer]

    def layer_params(self, layer: int) -> tuple:
        """Layer ``layer``'s (b1, w1 as (hidden, 3K), w2, b2), the arguments of :func:`mlp_logit`."""
        return self.b1[layer], self._w1t[layer], self.w2[layer], self.b2[layer]

    def logit_threshold_at(self, layer: int) -> float:
        """The logit a decision at ``layer`` is compared with (per-layer or global calibration)."""
        if self.layer_thresholds is None:
            return self._logit_t
        return logit_threshold(self.layer_thresholds[layer])

    @property
    def _w1t(self) -> torch.Tensor:
        """w1 transposed and contiguous (addmv wants (hidden, 3K)); rebuilt when w1 changes."""
        key = (self.w1.data_ptr(), self.w1._version, self.w1.device)
        if getattr(self, "_w1t_key", None) != key:
            self._w1t_cache, self._w1t_key = self.w1.transpose(1, 2).contiguous(), key
        return self._w1t_cache

    def prob(self, layer: int, feats: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit(layer, feats))

    def decide_from_logits(self, layer: int, logits: torch.Tensor, p_prev: torch.Tensor):
        """(fire, a device bool; p, the next p_prev) from the speculative tokens' logits at ``layer``:
        the features of :mod:`specee.early_exit.features`, then :meth:`decide`. The runtime's
        ``predict`` verb calls this, so the runtime itself needs no feature definition."""
        feats, p = features_from_logits(logits, p_prev)
        return self.decide(layer, feats), p

    def decide(self, layer: int, feats: torch.Tensor) -> torch.Tensor:
        """The exit decision as a device tensor (reading it on the host is the sync)."""
        if self.layer_thresholds is None:
            return self.logit(layer, feats) > self._logit_t
        return self.logit(layer, feats) > self._logit_thr[layer]

    def fires(self, layer: int, feats: torch.Tensor) -> bool:
        return bool(self.decide(layer, feats))

    def save(self, folder: Path, card: dict) -> None:
        from safetensors.torch import save_file
        save_file({k: v.detach().float().contiguous() for k, v in self.state_dict().items()
                   if k != "has"} | {"has": self.has.to(torch.uint8)}, str(folder / WEIGHTS))
        (folder / CARD).write_text(json.dumps(card, indent=1))

    @classmethod
    def check(cls, folder: str | Path, num_layers: int, k: int, calibration: str = "global") -> dict:
        """The card and weight shapes against this run (layers, K), without reading the weights
        (preflight, before the base model loads); returns the card. Per-layer thresholds, when the
        card holds them, must be well formed; ``calibration='per_layer'`` requires them."""
        folder = Path(folder)
        if not folder.is_dir() or not any((folder / f).exists() for f in (CARD, WEIGHTS)):
            raise SpeceeError(f"no trained predictors at early_exit.predictors_path={folder}; "
                              "train them with `python run.py experiment=train_predictors`")
        card = read_card(folder / CARD, _FIX, {"num_layers": int, "k": int}, "predictors card")
        from specee.artifact_checks import check_card_values
        check_card_values(card, folder / CARD, "predictors card", CARD_FIELDS, _FIX, num_layers)
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
        if calibration not in ("global", "per_layer"):
            raise SpeceeError(f"early_exit.calibration={calibration!r} is unknown; valid: global, per_layer")
        if THRESHOLDS in card:
            check_thresholds(card[THRESHOLDS], num_layers, str(folder / CARD))
        elif calibration == "per_layer":
            raise SpeceeError(f"early_exit.calibration=per_layer needs per-layer thresholds, and the predictors "
                              f"at {folder} have none ({CARD} lacks {THRESHOLDS!r}); {_THRESHOLDS_FIX}")
        return card

    @classmethod
    def load(cls, folder: str | Path, num_layers: int, k: int, threshold: float,
             calibration: str = "global") -> tuple["PredictorBank", dict]:
        """The bank at ``folder``; ``calibration='per_layer'`` applies the card's per-layer
        thresholds (``threshold`` is then unused), 'global' ``threshold`` at every layer."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        folder = Path(folder)
        card = cls.check(folder, num_layers, k, calibration)
        try:
            state = load_file(str(folder / WEIGHTS))
        except (SafetensorError, OSError, ValueError) as err:
            raise SpeceeError(f"{folder / WEIGHTS} is corrupt ({err}); retrain the predictors") from err
        from specee.artifact_checks import check_finite  # NaN weights never fire: a silent non-result
        check_finite(state, folder / WEIGHTS, "retrain the predictors (experiment=train_predictors)")
        try:
            bank = cls(num_layers, k, state["w1"].shape[-1], threshold)
            state["has"] = state["has"].bool()
            bank.load_state_dict(state)
        except (KeyError, RuntimeError) as err:
            raise SpeceeError(f"{folder / WEIGHTS} does not hold predictors of {num_layers} layers, K={k} "
                              f"({type(err).__name__}); retrain the predictors") from None
        if calibration == "per_layer":
            bank.set_layer_thresholds(card[THRESHOLDS])
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
