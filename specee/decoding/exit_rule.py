"""The decoder of every registered exit rule (:mod:`specee.exit_rules`): after each layer below the
last the rule scores the layer's state, and the token exits at the first layer whose score passes
the knob, emitting that layer's argmax (no draft, no verification: as CALM decodes). What an exit
leaves in the skipped layers' K/V is ``early_exit.kv_policy``, as for SpecEE and AdaInfer."""
from __future__ import annotations


import torch

from specee.decoding.base import DecidesAfterEachLayer, LoopDecoder, PhaseTimer
from specee.early_exit.kv_policy import fill_skipped
from specee.exit_rules import ExitRule
from specee.runtime.layerwise import LayerwiseLM


class ExitRuleDecoder(DecidesAfterEachLayer, LoopDecoder):
    def __init__(self, rt: LayerwiseLM, rule: ExitRule, value: float, *, kv_policy: str = "holes"):
        self.rt, self.rule, self.value, self.kv_policy = rt, rule.to(rt.device), float(value), kv_policy
        self.name = rule.name
        self.eligible = [i < rt.num_layers - 1 for i in range(rt.num_layers)]

    def decide(self, i: int, h_prev: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decision after layer ``i`` on (1, 1, d) states: (fire as a device bool, the layer's
        logits where the rule read them)."""
        logits = self.rt.logits(h)[0] if self.rule.reads_head else None
        score = self.rule.layer_scores(i, h_prev[0], h[0], logits)[0]
        return self.rule.fires(score, self.value), (None if logits is None else logits[0])

    @torch.inference_mode()
    def decode_one_token(self, token, cache, timer: PhaseTimer):
        """Returns (next token on the device, exit layer, the exit layer's logits, counters)."""
        rt = self.rt
        pos = rt.positions(cache, 1)
        h = rt.embed(token.view(1, 1))
        rope = rt.rope(h, pos, cache.seq_len)
        calls, prev = [0], [h]

        def exit_test(i, h):
            fire, logits = self.decide(i, prev[0], h)
            prev[0] = h
            calls[0] += 1
            fired = timer.host_bool(fire)
            timer.lap("predictors")
            if not fired:
                return None
            return logits if logits is not None else rt.logits(h)[0, 0]  # the head that emits the token

        exit_layer, h, logits = rt.walk(h, rope, cache, pos, None, self.eligible, exit_test, timer)
        exited = logits is not None
        if not exited:
            logits = rt.logits(h)[0, 0]
            timer.lap("layers")
        cache.seq_len += 1
        fill_skipped(rt, cache, h, exit_layer, rope, self.kv_policy)
        timer.lap("layers")
        trace = {"exit_layer": exit_layer, "layers": exit_layer + 1, "pred_calls": calls[0], "verify_calls": 0,
                 "emit_heads": int(exited and not self.rule.reads_head)}
        return logits.argmax(), exit_layer, logits, trace
