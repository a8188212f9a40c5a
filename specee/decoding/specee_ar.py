"""SpecEE autoregressive decoding (paper §4): draft -> layers with predictors -> verified exit.

Per generated token x_t:
1. the draft head reads (x_t, f_{t-1}) — f is the previous token's exit feature, norm(h_exit) —
   and proposes S, its top-K next tokens;
2. the base model runs x_t layer by layer; after each scheduled layer l the predictor reads the
   speculative features (:mod:`specee.early_exit.features`); when it fires, the full LM head is
   computed once on norm(h_l) and the token exits only if that argmax is in S — the argmax is
   emitted. Otherwise the stack continues; the last layer always emits its argmax;
3. the skipped layers' K/V are left or filled according to the KV policy.

Prefill is dense. Lossy by design: the emitted token may differ from dense greedy when a layer's
argmax is in S but is not the final layer's; ``match_rate_vs_dense`` measures how often.
"""
from __future__ import annotations

import time

import torch

from specee.decoding.base import Clock, Generation, Score, score_from_logits
from specee.early_exit.features import SpecProbe, features_from_logits, initial_p
from specee.early_exit.kv_policy import fill_skipped
from specee.early_exit.predictor import PredictorBank
from specee.early_exit.schedule import AllLayers
from specee.models.draft import DraftHead
from specee.runtime import LayerwiseLM


class SpecEEDecoder:
    name = "specee"

    def __init__(self, rt: LayerwiseLM, draft: DraftHead, predictors: PredictorBank, k: int = 4,
                 kv_policy: str = "holes", schedule=None, shadow: bool = False):
        self.rt, self.draft, self.predictors, self.k = rt, draft, predictors, k
        # shadow: also evaluate unscheduled layers (statistics only; it costs time) to find the
        # layer where the all-layers policy would have exited.
        self.shadow = shadow
        self.kv_policy = kv_policy
        self.schedule = schedule or AllLayers(rt.num_layers)
        # The last layer always emits, so a predictor there would only cost time.
        self.can_exit = [bool(predictors.has[i]) and i < rt.num_layers - 1 for i in range(rt.num_layers)]

    @torch.inference_mode()
    def prefill(self, prompt_ids, cache, dcache):
        rt = self.rt
        f = rt.norm(rt.forward(prompt_ids, cache))
        if prompt_ids.shape[1] > 1:  # the draft's history: pairs (x[i+1], f[i])
            self.draft(prompt_ids[:, 1:], f[:, :-1], dcache)
        return rt.lm_head(f[:, -1:])[0, -1].argmax(), f[:, -1:]

    @torch.inference_mode()
    def propose(self, token, f_prev, dcache):
        f_hat = self.draft(token.view(1, 1), f_prev, dcache)
        return self.draft.logits(f_hat)[0, -1].topk(self.k).indices

    @torch.inference_mode()
    def decode_one_token(self, token, spec, cache, state):
        """Run ``token`` up the stack until a verified exit; return (next token, f, exit layer, trace)."""
        rt, pred = self.rt, self.predictors
        now = time.perf_counter
        spec_list = spec.tolist()
        probe = SpecProbe(rt, spec)
        p_prev = initial_p(self.k, spec)
        pos = rt.positions(cache, 1)
        h = rt.embed(token.view(1, 1))
        rope = rt.rope(h, pos)
        t_layers = t_pred = t_verify = 0.0
        pred_calls = verify_calls = 0
        active = self.schedule.active(state)
        nxt = exit_layer = normed = shadow_exit = None
        p_all = p_prev
        for i in range(rt.num_layers):
            t0 = now()
            h = rt.run_layer(i, h, rope, cache, None, pos)
            t1 = now()
            t_layers += t1 - t0
            if self.shadow and self.can_exit[i]:
                p_all, hit = self._shadow_check(i, h, probe, spec_list, p_all)
                if hit and shadow_exit is None:
                    shadow_exit = i
            if not (self.can_exit[i] and active[i]):
                continue
            feats, p_prev = features_from_logits(probe.logits(h), p_prev)
            pred_calls += 1
            fire = pred.fires(i, feats)
            t2 = now()
            t_pred += t2 - t1
            if fire:
                verify_calls += 1
                normed = rt.norm(h)[0, 0]
                cand = int(rt.lm_head(normed).argmax())
                t_verify += now() - t2
                if cand in spec_list:
                    nxt, exit_layer = cand, i
                    break
        if nxt is None:
            t0 = now()
            normed = rt.norm(h)[0, 0]
            nxt, exit_layer = int(rt.lm_head(normed).argmax()), rt.num_layers - 1
            t_layers += now() - t0  # the dense LM head, as in the dense loop
        cache.seq_len += 1
        t0 = now()
        fill_skipped(rt, cache, h, exit_layer, rope, self.kv_policy)
        t_layers += now() - t0
        self.schedule.record(state, exit_layer)
        trace = {"exit_layer": exit_layer, "layers": exit_layer + 1, "pred_calls": pred_calls,
                 "verify_calls": verify_calls, "t_layers": t_layers, "t_pred": t_pred,
                 "t_verify": t_verify}
        if self.shadow:
            trace["shadow_exit_layer"] = shadow_exit if shadow_exit is not None else rt.num_layers - 1
        return torch.tensor(nxt), normed.view(1, 1, -1), exit_layer, trace

    def _shadow_check(self, i, h, probe, spec_list, p_all):
        """Would the all-layers policy (p_prev = layer i-1) exit at layer i?"""
        feats, p_all = features_from_logits(probe.logits(h), p_all)
        hit = self.predictors.fires(i, feats) and int(self.rt.logits(h)[0, 0].argmax()) in spec_list
        return p_all, hit

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int, eos_id: int | None = None) -> Generation:
        rt, clock = self.rt, Clock(self.rt.device)
        cache = rt.new_cache(prompt_ids.shape[1] + max_new_tokens)
        dcache = self.draft.new_cache(prompt_ids.shape[1] + max_new_tokens)
        state = self.schedule.new_request()
        t0 = clock()
        token, f = self.prefill(prompt_ids, cache, dcache)
        t1 = clock()
        tokens, times, layers, trace = [int(token)], [t1 - t0], [rt.num_layers], []
        while len(tokens) < max_new_tokens and tokens[-1] != eos_id:
            t0 = t1
            spec = self.propose(token, f, dcache)
            t_draft = time.perf_counter() - t0
            token, f, exit_layer, tr = self.decode_one_token(token, spec, cache, state)
            t1 = clock()
            tr["t_draft"] = t_draft
            tr["spec"] = spec.tolist()
            tokens.append(int(token))
            times.append(t1 - t0)
            layers.append(exit_layer + 1)
            trace.append(tr)
        return Generation(tokens, times[0], times, layers, trace)

    @torch.inference_mode()
    def score(self, context_ids: torch.Tensor, continuation: list[int],
              exit_at_context_end: bool = True) -> Score:
        """Teacher forcing with the decoding-time exit decision at every continuation position:
        the draft proposes from the real prefix, predictors + verification pick the exit layer,
        and the log-probs come from norm(h_exit) @ lm_head.

        With ``exit_at_context_end`` (the default, used for accuracy) the context's last token is
        also run as a decode step, so the first continuation token is scored by an early-exit
        decision too — otherwise one-token answers (BoolQ's yes/no) would always be scored by
        the dense prefill. With False the first position is the dense prefill's, as in decoding."""
        rt = self.rt
        n = context_ids.shape[1] + len(continuation)
        cache, dcache = rt.new_cache(n), self.draft.new_cache(n)
        state = self.schedule.new_request()
        steps = list(continuation[:-1])
        feats, layers = [], []
        if exit_at_context_end and context_ids.shape[1] > 1:
            _, f = self.prefill(context_ids[:, :-1], cache, dcache)
            steps = [int(context_ids[0, -1])] + steps
        else:
            _, f = self.prefill(context_ids, cache, dcache)
            feats, layers = [f.view(-1)], [rt.num_layers]
        for tok in steps:
            token = torch.tensor(tok, device=rt.device)
            spec = self.propose(token, f, dcache)
            _, f, exit_layer, _ = self.decode_one_token(token, spec, cache, state)
            feats.append(f.view(-1))
            layers.append(exit_layer + 1)
        return score_from_logits(rt.lm_head(torch.stack(feats)), continuation, layers)
