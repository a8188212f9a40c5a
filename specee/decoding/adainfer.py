"""AdaInfer baseline: after every layer the full LM head gives [gap = p1 - p2, top_prob = p1];
a linear SVM trained on the same labels as SpecEE's predictors decides the exit, and the
layer's argmax is emitted (no draft, no verification)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from specee.cards import read_card
from specee.decoding.base import LoopDecoder, PhaseTimer, Score, Step, score_from_logits, walk_layers
from specee.early_exit.features import adainfer_features
from specee.early_exit.kv_policy import fill_skipped
from specee.errors import SpeceeError
from specee.runtime import LayerKVCache, LayerwiseLM

CARD = "adainfer_svm.json"


class AdaInferSVM:
    def __init__(self, coef: list[float], intercept: float, card: dict | None = None):
        self.w = torch.tensor(coef, dtype=torch.float32)
        self.b = float(intercept)
        self.card = card or {}

    def to(self, device) -> "AdaInferSVM":
        self.w = self.w.to(device)
        return self

    def decide(self, feats: torch.Tensor) -> torch.Tensor:
        """The exit decision as a device tensor (reading it on the host is the sync)."""
        return feats.float() @ self.w + self.b > 0

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


@dataclass
class AdaInferSession:
    cache: LayerKVCache
    token: torch.Tensor  # last emitted token (on the runtime's device)


class AdaInferDecoder(LoopDecoder):
    name = "adainfer"

    def __init__(self, rt: LayerwiseLM, svm: AdaInferSVM, *, kv_policy: str = "holes"):
        self.rt, self.svm, self.kv_policy = rt, svm.to(rt.device), kv_policy
        self.eligible = [i < rt.num_layers - 1 for i in range(rt.num_layers)]

    @torch.inference_mode()
    def prefill(self, prompt_ids, max_new_tokens: int):
        rt = self.rt
        cache = rt.new_cache(prompt_ids.shape[1] + max_new_tokens)
        token = rt.logits(rt.forward(prompt_ids, cache)[:, -1:])[0, -1].argmax()
        return AdaInferSession(cache, token), int(token)

    @torch.inference_mode()
    def step(self, s: AdaInferSession) -> Step:
        timer = self.timer()
        timer.start()
        s.token, exit_layer, _, trace = self.decode_one_token(s.token, s.cache, timer)
        return Step([timer.host_int(s.token)], exit_layer, trace | timer.trace())

    @torch.inference_mode()
    def decode_one_token(self, token, cache, timer: PhaseTimer):
        """Returns (next token on the device, exit layer, the exit layer's logits, counters)."""
        rt = self.rt
        pos = rt.positions(cache, 1)
        h = rt.embed(token.view(1, 1))
        rope = rt.rope(h, pos, cache.seq_len)
        calls = [0]

        def exit_test(i, h):
            logits = rt.logits(h)[0, 0]
            calls[0] += 1
            fire = timer.host_bool(self.svm.decide(adainfer_features(logits)))
            timer.lap("predictors")
            return logits if fire else None

        exit_layer, h, logits = walk_layers(rt, h, rope, cache, pos, None, self.eligible, exit_test, timer)
        if logits is None:
            logits = rt.logits(h)[0, 0]
            timer.lap("layers")
        cache.seq_len += 1
        fill_skipped(rt, cache, h, exit_layer, rope, self.kv_policy)
        timer.lap("layers")
        trace = {"exit_layer": exit_layer, "layers": exit_layer + 1, "pred_calls": calls[0], "verify_calls": 0}
        return logits.argmax(), exit_layer, logits, trace

    @torch.inference_mode()
    def score(self, context_ids: torch.Tensor, continuation: list[int],
              exit_at_context_end: bool = True) -> Score:
        """Teacher forcing; each position's log-probs come from the layer the SVM exited at
        (``exit_at_context_end``: as in SpecEEDecoder.score)."""
        rt = self.rt
        cache = rt.new_cache(context_ids.shape[1] + len(continuation))
        steps = list(continuation[:-1])
        rows, layers = [], []
        if exit_at_context_end and context_ids.shape[1] > 1:
            rt.forward(context_ids[:, :-1], cache)
            steps = [int(context_ids[0, -1])] + steps
        else:
            rows, layers = [rt.logits(rt.forward(context_ids, cache)[:, -1:])[0, -1]], [rt.num_layers]
        timer = self.timer()
        ids = torch.tensor(steps, device=rt.device)
        for j in range(len(steps)):
            _, exit_layer, logits, _ = self.decode_one_token(ids[j], cache, timer)
            rows.append(logits)
            layers.append(exit_layer + 1)
        return score_from_logits(torch.stack(rows), continuation, layers)
