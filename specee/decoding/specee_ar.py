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

from dataclasses import dataclass

import torch

from specee.decoding.base import LoopDecoder, PhaseTimer, Score, Step, score_from_logits
from specee.runtime.exit_walk import ExitPlan
from specee.early_exit.features import SpecProbe, delta_probe_layers, features_from_logits, initial_p
from specee.early_exit.kv_policy import fill_skipped
from specee.early_exit.predictor import PredictorBank
from specee.early_exit.schedule import AllLayers
from specee.models.draft import DraftHead
from specee.runtime.layerwise import LayerKVCache, LayerwiseLM


@dataclass
class ARSession:
    cache: LayerKVCache
    dcache: object
    state: object  # the schedule's per-request state
    token: torch.Tensor  # last emitted token (on the runtime's device)
    f: torch.Tensor  # its feature norm(h_exit), read by the draft
    replay: object = None  # the exit replay's per-request state


class SpecEEDecoder(LoopDecoder):
    name = "specee"

    def __init__(self, rt: LayerwiseLM, draft: DraftHead, predictors: PredictorBank, *, k: int = 4,
                 kv_policy: str = "holes", schedule=None, shadow: bool = False, replay=None,
                 delta_from: str = "previous_layer"):
        self.rt, self.draft, self.predictors, self.k = rt, draft, predictors, k
        self.delta_from = delta_from  # where p_prev comes from (features.delta_probe_layers)
        self.replay = replay  # ExitReplay: exits where it says; all the work still done
        # shadow: also evaluate unscheduled layers (statistics only; it costs time) to find the
        # layer where the all-layers policy would have exited.
        self.shadow = shadow
        self.kv_policy = kv_policy
        self.schedule = schedule or AllLayers(rt.num_layers)
        # The last layer always emits, so a predictor there would only cost time.
        self.can_exit = [bool(predictors.has[i]) and i < rt.num_layers - 1 for i in range(rt.num_layers)]

    def _prefill(self, prompt_ids, cache, dcache):
        rt = self.rt
        f = rt.norm(rt.forward(prompt_ids, cache))
        if prompt_ids.shape[1] > 1:  # the draft's history: pairs (x[i+1], f[i])
            self.draft(prompt_ids[:, 1:], f[:, :-1], dcache)
        return rt.lm_head(f[:, -1:])[0, -1].argmax(), f[:, -1:]

    @torch.inference_mode()
    def prefill(self, prompt_ids, max_new_tokens: int):
        n = prompt_ids.shape[1] + max_new_tokens
        cache, dcache = self.rt.new_cache(n), self.draft.new_cache(n)
        token, f = self._prefill(prompt_ids, cache, dcache)
        replay = self.replay.new_request(prompt_ids) if self.replay else None
        return ARSession(cache, dcache, self.schedule.new_request(), token, f, replay), int(token)

    @torch.inference_mode()
    def propose(self, token, f_prev, dcache):
        f_hat = self.draft(token.view(1, 1), f_prev, dcache)
        return self.draft.topk(f_hat[0, -1], self.k)

    @torch.inference_mode()
    def step(self, s: ARSession) -> Step:
        timer = self.timer()
        timer.start()
        spec = self.propose(s.token, s.f, s.dcache)
        # The device walk reads the speculative ids with the step's outcome (one host read).
        spec_list = None if self.rt.exits_on_device else timer.host_list(spec)
        timer.lap("draft")
        target = self.replay.target(s.replay) if self.replay else None
        s.token, s.f, exit_layer, trace, ex = self.decode_one_token(s.token, spec, spec_list, s.cache, s.state,
                                                                    timer, target)
        trace["spec"] = ex.spec_list
        if target is not None:
            trace["replay_target"] = target
        token = ex.token_int if ex.token_int is not None else timer.host_int(s.token)
        return Step([token], exit_layer, trace | timer.trace())

    @torch.inference_mode()
    def decode_one_token(self, token, spec, spec_list, cache, state, timer: PhaseTimer, target=None):
        """Run ``token`` up the stack until a verified exit; return (next token, its feature
        norm(h_exit), exit layer, trace counters, the walk's :class:`ExitValue`). The next token
        stays on the device. With a replay ``target`` the predictors still run but the exit is taken
        at the first scheduled layer >= target, after its verification LM head."""
        rt = self.rt
        pos = rt.positions(cache, 1)
        h = rt.embed(token.view(1, 1))
        rope = rt.rope(h, pos, cache.seq_len)
        active = self.schedule.active(state)
        eligible = [self.can_exit[i] and active[i] for i in range(rt.num_layers)]
        plan = ExitPlan(eligible, delta_probe_layers(eligible, self.delta_from), SpecProbe(rt, spec),
                        self.predictors, spec, spec_list, initial_p(self.k, spec, self.delta_from), target)
        shadow = {"exit": None, "p": initial_p(self.k, spec)}

        def observe(i, h):  # shadow mode: where would the all-layers policy have exited?
            if self.can_exit[i]:
                shadow["p"], hit = self._shadow_check(i, h, plan.probe, shadow_spec(), shadow["p"])
                if hit and shadow["exit"] is None:
                    shadow["exit"] = i
            timer.lap("other")  # statistics only

        def shadow_spec():
            if plan.spec_list is None:
                plan.spec_list = timer.host_list(spec)
            return plan.spec_list

        syncs = timer.syncs
        ex = rt.walk_exits(plan, h, rope, cache, pos, timer, observe if self.shadow else None)
        walk_syncs = timer.syncs - syncs  # host round trips inside the layer walk
        exit_layer = ex.resolve(timer)
        h = ex.h
        if ex.token is None:
            normed = rt.norm(h)[0, 0]
            nxt = rt.lm_head(normed).argmax()
            timer.lap("layers")  # the dense LM head, as in the dense loop
        else:
            nxt, normed = ex.token, ex.normed
        cache.seq_len += 1
        fill_skipped(rt, cache, h, exit_layer, rope, self.kv_policy)
        timer.lap("layers")
        self.schedule.record(state, exit_layer)
        trace = {"exit_layer": exit_layer, "layers": exit_layer + 1, "walk_syncs": walk_syncs, **ex.counts}
        if self.shadow:
            trace["shadow_exit_layer"] = shadow["exit"] if shadow["exit"] is not None else rt.num_layers - 1
        return nxt, normed.view(1, 1, -1), exit_layer, trace, ex

    def _shadow_check(self, i, h, probe, spec_list, p_all):
        """Would the all-layers policy (p_prev = layer i-1) exit at layer i?"""
        feats, p_all = features_from_logits(probe.logits(h), p_all)
        hit = self.predictors.fires(i, feats) and int(self.rt.logits(h)[0, 0].argmax()) in spec_list
        return p_all, hit

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
            _, f = self._prefill(context_ids[:, :-1], cache, dcache)
            steps = [int(context_ids[0, -1])] + steps
        else:
            _, f = self._prefill(context_ids, cache, dcache)
            feats, layers = [f.view(-1)], [rt.num_layers]
        timer = self.timer()
        ids = torch.tensor(steps, device=rt.device)
        for j in range(len(steps)):
            token = ids[j]
            spec = self.propose(token, f, dcache)
            _, f, exit_layer, _, _ = self.decode_one_token(token, spec, None, cache, state, timer)
            feats.append(f.view(-1))
            layers.append(exit_layer + 1)
        return score_from_logits(rt.lm_head(torch.stack(feats)), continuation, layers)


def lookup_set(ids: list[int], k: int, ngram_size: int, counts=None) -> list[int]:
    """SpecEE's speculative set from the text so far: the tokens that followed earlier occurrences
    of its last ``ngram_size`` tokens, most recent first, then those after shorter suffixes, then
    (``counts``, a Counter of the text's tokens) its most frequent tokens, until ``k`` distinct
    ones are found. Empty unless the full ``ngram_size``-gram occurs earlier (a shorter match alone
    is too weak a guess to stand in for the draft). Copied text usually has one continuation, so
    the fill matters: the predictors read k tokens' logits."""
    out = _continuations(ids, k, ngram_size)
    if out and counts is not None and len(out) < k:
        for tok, _ in counts.most_common(2 * k):
            if tok not in out:
                out.append(tok)
                if len(out) == k:
                    break
    return out


def _continuations(ids: list[int], k: int, ngram_size: int) -> list[int]:
    out: list[int] = []
    top = min(ngram_size, len(ids) - 1)
    if top < ngram_size:
        return []
    for n in range(top, 0, -1):
        tail = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == tail and ids[start + n] not in out:
                out.append(ids[start + n])
                if len(out) == k:
                    return out
        if n == top and not out:
            return []
    return out


@dataclass
class LookupARSession(ARSession):
    ids: list = None  # prompt + emitted tokens (host), for the lookup
    pending: list = None  # (token, feature) pairs the draft has not read yet (prompt-sourced steps)
    counts: object = None  # Counter of ``ids`` (the set's fill)


class PromptLookupSpecEEDecoder(SpecEEDecoder):
    """SpecEE with prompt-lookup speculation (``specee_pld``): when the last ``ngram_size`` tokens
    occur earlier in the text, the speculative set S is the ``k`` tokens that followed them, filled
    with the text's most frequent tokens (:func:`lookup_set`), and the draft head does not run; otherwise the EAGLE head proposes S, after
    reading the (token, feature) pairs of the steps it skipped in one block (its cache stays whole).
    Predictors, schedule and the verification are SpecEE's, unchanged."""
    name = "specee_pld"

    def __init__(self, *args, ngram_size: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.ngram_size = ngram_size

    @torch.inference_mode()
    def prefill(self, prompt_ids, max_new_tokens: int):
        s, token = super().prefill(prompt_ids, max_new_tokens)
        from collections import Counter
        ids = prompt_ids[0].tolist() + [token]
        session = LookupARSession(s.cache, s.dcache, s.state, s.token, s.f, s.replay,
                                  ids=ids, pending=[], counts=Counter(ids))
        return session, token

    @torch.inference_mode()
    def step(self, s: LookupARSession) -> Step:
        timer = self.timer()
        timer.start()
        spec_list = lookup_set(s.ids, self.k, self.ngram_size, s.counts)
        if len(spec_list) == self.k:
            spec, source, draft_calls = timer.to_device(spec_list, dtype=torch.long), "prompt", 0
            s.pending.append((s.token, s.f))
        else:
            tokens = torch.stack([t for t, _ in s.pending] + [s.token]).view(1, -1)
            feats = torch.cat([f for _, f in s.pending] + [s.f], 1)
            f_hat = self.draft(tokens, feats, s.dcache)
            spec = self.draft.topk(f_hat[0, -1], self.k)
            spec_list, source, draft_calls = timer.host_list(spec), "draft", 1
            s.pending = []
        timer.lap("draft")
        target = self.replay.target(s.replay) if self.replay else None
        s.token, s.f, exit_layer, trace, ex = self.decode_one_token(s.token, spec, spec_list, s.cache, s.state,
                                                                    timer, target)
        token = ex.token_int if ex.token_int is not None else timer.host_int(s.token)
        s.ids.append(token)
        s.counts[token] += 1
        trace.update({"spec": spec_list, "spec_source": source, "draft_calls": draft_calls})
        if target is not None:
            trace["replay_target"] = target
        return Step([token], exit_layer, trace | timer.trace())
