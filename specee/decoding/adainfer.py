"""AdaInfer baseline: after every layer the full LM head gives [gap = p1 - p2, top_prob = p1];
a classifier trained on the same labels as SpecEE's predictors decides the exit, and the
layer's argmax is emitted (no draft, no verification). AdaInfer's paper describes two
classifiers, both here (``ablation.classifier``): a linear SVM deciding each layer on its own,
and a linear-chain CRF over the sequence of layers, which decides at layer l from the filtered
probability of "stop" given layers 0..l (the forward recursion; a decoder cannot see later layers)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from specee.cards import read_card
from specee.decoding.base import DecidesAfterEachLayer, LoopDecoder, PhaseTimer
from specee.early_exit.features import adainfer_features
from specee.early_exit.kv_policy import fill_skipped
from specee.errors import SpeceeError
from specee.runtime.layerwise import LayerwiseLM

CARD = "adainfer_svm.json"
CRF_CARD = "adainfer_crf.json"
CLASSIFIERS = ("svm", "crf")


class AdaInferSVM:
    def __init__(self, coef: list[float], intercept: float, card: dict | None = None):
        self.w = torch.tensor(coef, dtype=torch.float32)
        self.b = float(intercept)
        self.card = card or {}
        self.margin = 0.0  # fires when w.x + b > margin (0: the trained SVM's own boundary)

    def to(self, device) -> "AdaInferSVM":
        self.w = self.w.to(device)
        return self

    def reset(self) -> None:
        """A new token's walk: the SVM keeps nothing between layers."""

    def decide(self, feats: torch.Tensor) -> torch.Tensor:
        """The exit decision as a device tensor (reading it on the host is the sync)."""
        return feats.float() @ self.w + self.b > self.margin

    def fires(self, feats: torch.Tensor) -> bool:
        return bool(self.decide(feats))

    def save(self, folder: Path, card: dict) -> None:
        (folder / CARD).write_text(json.dumps({**card, "coef": self.w.tolist(), "intercept": self.b}, indent=1))

    @classmethod
    def load(cls, folder: str | Path) -> "AdaInferSVM":
        path = Path(folder) / CARD
        if not path.is_file():
            raise SpeceeError(f"no AdaInfer SVM at {path}; train it with `python run.py experiment=train_predictors`")
        fix = "retrain it (experiment=train_predictors) or point early_exit.adainfer_path at another"
        card = read_card(path, fix, {"coef": list, "intercept": float}, "AdaInfer SVM card")
        coef = card["coef"]
        if len(coef) != 2 or not all(isinstance(c, (int, float)) and not isinstance(c, bool)
                                     and math.isfinite(c) for c in coef):
            raise SpeceeError(f"{path} is corrupt: coef must hold 2 finite numbers [gap, top_prob], not "
                              f"{str(coef)[:40]}; {fix}")
        return cls(coef, card["intercept"], card)


class AdaInferCRF:
    """A linear-chain CRF over a token's layers, labels 0 (continue) and 1 (stop), on the same
    [gap, top_prob] features. Scores: unary ``w[y] . x + b[y]`` per layer, ``trans[y', y]`` between
    consecutive layers. Online decision at layer l: the forward recursion over layers 0..l gives
    P(y_l = 1 | x_0..x_l); the token exits when it exceeds 1/2 (``reset`` starts a new token)."""

    def __init__(self, unary_w: list[list[float]], unary_b: list[float], trans: list[list[float]],
                 card: dict | None = None):
        self.w = torch.tensor(unary_w, dtype=torch.float32)  # [2 labels, 2 features]
        self.b = torch.tensor(unary_b, dtype=torch.float32)  # [2]
        self.trans = torch.tensor(trans, dtype=torch.float32)  # [from, to]
        self.card = card or {}
        self.alpha = None
        self.p_stop = 0.5  # fires when P(stop | layers so far) exceeds it (AdaInfer's 1/2)

    def to(self, device) -> "AdaInferCRF":
        self.w, self.b, self.trans = self.w.to(device), self.b.to(device), self.trans.to(device)
        return self

    def reset(self) -> None:
        self.alpha = None

    def unary(self, feats: torch.Tensor) -> torch.Tensor:
        return feats.float() @ self.w.T + self.b

    def step(self, alpha: torch.Tensor | None, feats: torch.Tensor) -> torch.Tensor:
        """Log forward scores after one more layer (normalised: the filtered log-probabilities)."""
        u = self.unary(feats)
        a = u if alpha is None else torch.logsumexp(alpha.unsqueeze(-1) + self.trans, dim=-2) + u
        return a - torch.logsumexp(a, dim=-1, keepdim=True)

    def decide(self, feats: torch.Tensor) -> torch.Tensor:
        self.alpha = self.step(self.alpha, feats)
        if self.p_stop == 0.5:
            return self.alpha[..., 1] > self.alpha[..., 0]
        return self.alpha[..., 1] > math.log(self.p_stop)  # alpha holds log-probabilities

    def fires(self, feats: torch.Tensor) -> bool:
        return bool(self.decide(feats))

    def filtered(self, feats: torch.Tensor) -> torch.Tensor:
        """P(stop at layer l | layers 0..l) for a batch of whole sequences [N, layers, 2]."""
        alpha, out = None, []
        for l in range(feats.shape[-2]):
            alpha = self.step(alpha, feats[..., l, :])
            out.append(alpha[..., 1].exp())
        return torch.stack(out, -1)

    def nll(self, feats: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean negative log-likelihood of label sequences [N, layers] (training)."""
        u = self.unary(feats)  # [N, layers, 2]
        y = labels.long()
        gold = u.gather(-1, y.unsqueeze(-1)).squeeze(-1).sum(-1) + self.trans[y[:, :-1], y[:, 1:]].sum(-1)
        a = u[:, 0]
        for l in range(1, u.shape[1]):
            a = torch.logsumexp(a.unsqueeze(-1) + self.trans, dim=-2) + u[:, l]
        return (torch.logsumexp(a, -1) - gold).mean()

    def save(self, folder: Path, card: dict) -> None:
        (folder / CRF_CARD).write_text(json.dumps({**card, "unary_w": self.w.tolist(), "unary_b": self.b.tolist(),
                                                   "transitions": self.trans.tolist()}, indent=1))

    @classmethod
    def load(cls, folder: str | Path) -> "AdaInferCRF":
        path = Path(folder) / CRF_CARD
        if not path.is_file():
            raise SpeceeError(f"no AdaInfer CRF at {path}; train it with `python run.py experiment=train_predictors` "
                              "(it trains the SVM and the CRF together)")
        fix = "retrain it (experiment=train_predictors) or point early_exit.adainfer_path at another"
        card = read_card(path, fix, {"unary_w": list, "unary_b": list, "transitions": list}, "AdaInfer CRF card")

        def finite(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        def grid(v, rows: int, cols: int) -> bool:  # rows=0: a flat list of ``cols`` numbers
            if not rows:
                return len(v) == cols and all(finite(x) for x in v)
            return len(v) == rows and all(isinstance(r, list) and grid(r, 0, cols) for r in v)
        if not (grid(card["unary_w"], 2, 2) and grid(card["unary_b"], 0, 2) and grid(card["transitions"], 2, 2)):
            raise SpeceeError(f"{path} is corrupt: unary_w and transitions must be 2x2 and unary_b 2 finite "
                              f"numbers; {fix}")
        return cls(card["unary_w"], card["unary_b"], card["transitions"], card)


def train_crf(x, y, max_samples: int, seed: int, steps: int = 300) -> tuple[AdaInferCRF, dict]:
    """Fit the CRF by maximum likelihood on whole label sequences: ``x`` [tokens, layers, 2]
    features, ``y`` [tokens, layers] labels (the same labels as the SVM's), L-BFGS from zero
    (the log-likelihood is concave in the parameters)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(x))[: max(1, max_samples // max(1, x.shape[1]))]
    xs = torch.as_tensor(np.asarray(x)[idx], dtype=torch.float32)
    ys = torch.as_tensor(np.asarray(y)[idx])
    crf = AdaInferCRF([[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0], [[0.0, 0.0], [0.0, 0.0]])
    params = [crf.w.requires_grad_(), crf.b.requires_grad_(), crf.trans.requires_grad_()]
    opt = torch.optim.LBFGS(params, lr=0.5, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = crf.nll(xs, ys)
        loss.backward()
        return loss
    opt.step(closure)
    with torch.no_grad():
        nll = float(crf.nll(xs, ys))
    for p in params:
        p.requires_grad_(False)
    return crf, {"sequences": int(len(idx)), "layers": int(xs.shape[1]), "train_nll": nll}


def load_classifier(folder: str | Path, kind: str):
    """The AdaInfer classifier ``kind`` (svm | crf) from an adainfer folder."""
    if kind not in CLASSIFIERS:
        raise SpeceeError(f"ablation.classifier={kind!r} is unknown; valid: {', '.join(CLASSIFIERS)}")
    classifier = AdaInferSVM.load(folder) if kind == "svm" else AdaInferCRF.load(folder)
    from specee.artifact_checks import check_card_values
    check_card_values(classifier.card, Path(folder) / (CARD if kind == "svm" else CRF_CARD), f"AdaInfer {kind} card",
                      {"num_layers": "positive", "k": "positive", "samples": "count", "base_weights_fingerprint": "text",
                       "calibration_prompt_ids": "ids"},
                      "retrain it (experiment=train_predictors) or point early_exit.adainfer_path at another")
    return classifier


def standin_classifier(kind: str):
    """model.init=random: fixed coefficients of the classifier's shape (its cost only; results say so)."""
    if kind == "crf":
        return AdaInferCRF([[0.0, 0.0], [1.0, 1.0]], [0.0, -1.5], [[0.0, 0.0], [0.0, 0.0]],
                           {"synthetic": "fixed random-init stand-in"})
    return AdaInferSVM([1.0, 1.0], -1.5, {"synthetic": "fixed random-init stand-in"})


class AdaInferDecoder(DecidesAfterEachLayer, LoopDecoder):
    name = "adainfer"

    def __init__(self, rt: LayerwiseLM, svm: AdaInferSVM, *, kv_policy: str = "holes"):
        self.rt, self.svm, self.kv_policy = rt, svm.to(rt.device), kv_policy
        self.eligible = [i < rt.num_layers - 1 for i in range(rt.num_layers)]

    @torch.inference_mode()
    def decode_one_token(self, token, cache, timer: PhaseTimer):
        """Returns (next token on the device, exit layer, the exit layer's logits, counters)."""
        rt = self.rt
        pos = rt.positions(cache, 1)
        h = rt.embed(token.view(1, 1))
        rope = rt.rope(h, pos, cache.seq_len)
        calls = [0]
        self.svm.reset()  # the CRF's forward recursion starts again at each token

        def exit_test(i, h):
            logits = rt.logits(h)[0, 0]
            calls[0] += 1
            fire = timer.host_bool(self.svm.decide(adainfer_features(logits)))
            timer.lap("predictors")
            return logits if fire else None

        exit_layer, h, logits = rt.walk(h, rope, cache, pos, None, self.eligible, exit_test, timer)
        if logits is None:
            logits = rt.logits(h)[0, 0]
            timer.lap("layers")
        cache.seq_len += 1
        fill_skipped(rt, cache, h, exit_layer, rope, self.kv_policy)
        timer.lap("layers")
        trace = {"exit_layer": exit_layer, "layers": exit_layer + 1, "pred_calls": calls[0], "verify_calls": 0}
        return logits.argmax(), exit_layer, logits, trace
