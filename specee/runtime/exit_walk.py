"""One autoregressive SpecEE step's layer walk: what it may exit on (:class:`ExitPlan`) and where it
left the stack (:class:`ExitValue`), a value a runtime may keep on the device.

The walk is a runtime verb (``rt.walk_exits``): the eager and compiled runtimes branch on the host
after each scheduled predictor (:func:`host_walk`, the authors' design: read the decision, then
verify); the compiled runtime with ``runtime.exit_control=device`` decides every exit on the
device (specee/runtime/device_walk.py) and the host reads the step's outcome once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class ExitPlan:
    """What one step's walk may exit on."""
    eligible: list[bool]  # layers with a scheduled predictor this step
    probe_only: list[bool]  # layers where p is computed only as the next predictor layer's p_prev
    probe: Any  # SpecProbe: the speculative tokens' logits at a layer
    bank: Any  # PredictorBank
    spec: torch.Tensor  # the speculative token ids (device), in draft rank order
    spec_list: list[int] | None  # the same on the host, where the caller read them already
    p0: torch.Tensor  # p_prev before the first layer
    target: int | None = None  # replay: exit at the first scheduled layer >= target (after its verification)

    def walk_on_host(self, rt, h, rope, cache, pos, timer, observe=None) -> "ExitValue":
        """:func:`host_walk` over this plan (the eager runtime's ``walk_exits``)."""
        return host_walk(rt, self, h, rope, cache, pos, timer, observe)


@dataclass
class ExitValue:
    """Where a walk left the stack. ``layer`` is the 0-based index of the last layer run (L-1: the
    full stack); ``token`` the verified argmax, or None when the full stack ran (the caller computes
    the final head, as the dense loop does); ``normed`` = norm(h at the exit). From the device walk
    ``layer``, ``token`` and ``counts['verify_calls']`` are device tensors until :meth:`resolve`."""
    layer: Any
    h: torch.Tensor
    token: torch.Tensor | None
    normed: torch.Tensor | None
    counts: dict = field(default_factory=dict)
    on_device: bool = False
    token_int: int | None = None  # the emitted token, once read on the host
    spec_list: list[int] | None = None
    spec: torch.Tensor | None = None  # device walk: the speculative ids, read with the outcome
    _settle: Callable | None = None  # host bookkeeping once the exit layer is known (device walk)

    def resolve(self, timer) -> int:
        """The exit layer as a host int. A device value is read here, once per step, together with
        the token, the verification count and the speculative ids (one host read)."""
        if not self.on_device:
            return int(self.layer)
        row = torch.cat([torch.stack([self.token, self.layer, self.counts["verify_calls"]]).to(torch.long),
                         self.spec.to(torch.long)])
        values = timer.host_list(row)
        self.token_int, self.layer, self.counts["verify_calls"] = values[0], values[1], values[2]
        self.spec_list = values[3:]
        self.on_device = False
        if self._settle is not None:
            self._settle(self.layer)
        return self.layer


def host_walk(rt, plan: ExitPlan, h, rope, cache, pos, timer, observe=None) -> ExitValue:
    """The walk with a host branch after each scheduled predictor: run the stack; at a probe-only
    layer compute p (the next predictor's p_prev, as in training); at a scheduled layer ask the
    predictor (a device bool read on the host), and on a fire verify with one full LM head whose
    argmax must be in the speculative set. ``observe(i, h)`` sees every layer (statistics).

    With ``runtime.exit_control=lookahead`` the decision is read without waiting first: the next
    layer is queued behind it, so on a GPU the read overlaps that layer instead of draining the
    queue. An exit then wastes the queued layer (counted in ``wasted_layers``; its cache entry is
    taken back, so decoding is the same as reading first)."""
    counts = {"pred_calls": 0, "verify_calls": 0, "delta_probes": 0}
    p_prev, spec_list, target = plan.p0, plan.spec_list, plan.target
    if spec_list is None:
        spec_list = timer.host_list(plan.spec)
    lookahead = getattr(rt, "exit_control", "host") == "lookahead"
    if lookahead:
        counts["wasted_layers"] = 0
    walk = [e or p for e, p in zip(plan.eligible, plan.probe_only)]
    L = rt.num_layers
    h = rt.run_layer(0, h, rope, cache, None, pos)
    timer.lap("layers")
    for i in range(L):
        ahead = None  # layer i+1's output, when it was queued before layer i's decision was read
        if observe is not None:
            observe(i, h)
        if walk[i] and plan.probe_only[i]:  # layer l-1's p for the predictor at l, as in training
            p_prev = torch.softmax(plan.probe.logits(h), -1)
            counts["delta_probes"] += 1
            timer.lap("predictors")
        elif walk[i]:
            decision, p_prev = rt.predict(plan.probe, plan.bank, i, h, p_prev)
            counts["pred_calls"] += 1
            if lookahead and i + 1 < L:
                handle = timer.start_read(decision)
                timer.lap("predictors")
                ahead = rt.run_layer(i + 1, h, rope, cache, None, pos)
                timer.lap("layers")
                fire = timer.finish_read(handle)
            else:
                fire = timer.host_bool(decision)
            if target is not None:
                fire = i >= target
            timer.lap("predictors")
            if fire:
                counts["verify_calls"] += 1
                normed = rt.norm(h)[0, 0]
                cand = rt.lm_head(normed).argmax()
                hit = timer.host_int(cand) in spec_list or target is not None
                timer.lap("verification")
                if hit:
                    if ahead is not None:  # the queued layer was wasted: take its entry back
                        cache.undo_append(i + 1, 1)
                        counts["wasted_layers"] += 1
                    return ExitValue(i, h, cand, normed, counts, spec_list=spec_list)
        if i + 1 < L:
            h = ahead if ahead is not None else rt.run_layer(i + 1, h, rope, cache, None, pos)
            timer.lap("layers")
    return ExitValue(L - 1, h, None, None, counts, spec_list=spec_list)
