"""AdaInfer baseline: after every layer the full LM head gives [gap = p1 - p2, top_prob = p1];
a linear SVM trained on the same labels as SpecEE's predictors decides the exit, and the
layer's argmax is emitted (no draft, no verification)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from specee.decoding.base import Clock, Generation, Score, score_from_logits
from specee.early_exit.features import adainfer_features
from specee.early_exit.kv_policy import fill_skipped
from specee.errors import SpeceeError
from specee.runtime import LayerwiseLM

CARD = "adainfer_svm.json"


class AdaInferSVM:
    def __init__(self, coef: list[float], intercept: float, card: dict | None = None):
        self.w = torch.tensor(coef, dtype=torch.float32)
        self.b = float(intercept)
        self.card = card or {}

    def fires(self, feats: torch.Tensor) -> bool:
        return bool(feats.float() @ self.w + self.b > 0)

    def save(self, folder: Path, card: dict) -> None:
        (folder / CARD).write_text(json.dumps({**card, "coef": self.w.tolist(), "intercept": self.b}, indent=1))

    @classmethod
    def load(cls, folder: str | Path) -> "AdaInferSVM":
        path = Path(folder) / CARD
        if not path.is_file():
            raise SpeceeError(f"no AdaInfer SVM at {path}; train it with `python run.py experiment=train_predictors`")
        try:
            card = json.loads(path.read_text())
            return cls(card["coef"], card["intercept"], card)
        except (json.JSONDecodeError, KeyError) as err:
            raise SpeceeError(f"{path} is corrupt ({err}); retrain (experiment=train_predictors)") from err


class AdaInferDecoder:
    name = "adainfer"

    def __init__(self, rt: LayerwiseLM, svm: AdaInferSVM, kv_policy: str = "holes"):
        self.rt, self.svm, self.kv_policy = rt, svm, kv_policy

    @torch.inference_mode()
    def decode_one_token(self, token, cache):
        rt, now = self.rt, time.perf_counter
        pos = rt.positions(cache, 1)
        h = rt.embed(token.view(1, 1))
        rope = rt.rope(h, pos)
        t_layers = t_pred = 0.0
        calls = 0
        nxt = None
        last = rt.num_layers - 1
        for i in range(rt.num_layers):
            t0 = now()
            h = rt.run_layer(i, h, rope, cache, None, pos)
            t1 = now()
            t_layers += t1 - t0
            logits = rt.logits(h)[0, 0]
            if i < last:
                calls += 1
                fire = self.svm.fires(adainfer_features(logits))
                t_pred += now() - t1
                if fire:
                    nxt, exit_layer = int(logits.argmax()), i
                    break
        if nxt is None:
            nxt, exit_layer = int(logits.argmax()), last
        cache.seq_len += 1
        fill_skipped(rt, cache, h, exit_layer, rope, self.kv_policy)
        self._last_logits = logits
        return torch.tensor(nxt), exit_layer, {"exit_layer": exit_layer, "layers": exit_layer + 1,
                                               "pred_calls": calls, "verify_calls": 0,
                                               "t_layers": t_layers, "t_pred": t_pred,
                                               "t_verify": 0.0, "t_draft": 0.0}

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int, eos_id: int | None = None) -> Generation:
        rt, clock = self.rt, Clock(self.rt.device)
        cache = rt.new_cache(prompt_ids.shape[1] + max_new_tokens)
        t0 = clock()
        token = rt.logits(rt.forward(prompt_ids, cache)[:, -1:])[0, -1].argmax()
        t1 = clock()
        tokens, times, layers, trace = [int(token)], [t1 - t0], [rt.num_layers], []
        while len(tokens) < max_new_tokens and tokens[-1] != eos_id:
            t0 = t1
            token, exit_layer, tr = self.decode_one_token(token, cache)
            t1 = clock()
            tokens.append(int(token)); times.append(t1 - t0); layers.append(exit_layer + 1); trace.append(tr)
        return Generation(tokens, times[0], times, layers, trace)

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
        for tok in steps:
            _, exit_layer, _ = self.decode_one_token(torch.tensor(tok, device=rt.device), cache)
            rows.append(self._last_logits)
            layers.append(exit_layer + 1)
        return score_from_logits(torch.stack(rows), continuation, layers)
