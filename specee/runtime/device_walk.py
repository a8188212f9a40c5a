"""Autoregressive SpecEE's layer walk with every exit decided on the device
(``runtime=compiled runtime.exit_control=device``).

The host-branching walk (specee/runtime/exit_walk.py, the authors' design) reads each scheduled
predictor's decision on the host, then the verification's argmax: about one host round trip per
scheduled layer, each of which drains the GPU's queue. Here the predictor decision, the LM-head
verification and the skip of the remaining layers are device booleans steering ``torch.cond``:

    per layer i:  live = not done
                  h, k, v = cond(live, layer_i, keep)(h)       # the remaining layers are skipped
                  write k, v at the cache's length; length += live
                  fire, p = cond(live and (scheduled or probe-only)[i], predictor_i, no_predictor)
                  go = live and scheduled[i] and (fire, or the replay's forced exit)
                  hit, token, normed = cond(go, verify, no_verify)   # argmax in the speculative set?
                  done |= go and hit
    after the stack: token, normed = cond(done, keep, final_head)

so the host reads the step's outcome (token, exit layer, verifications, the speculative ids)
once, after the walk: no round trip inside it. ``torch.cond`` branches may not mutate their
inputs, so a layer branch returns its new K/V entries and the cache write happens outside, at the
device-side length, which advances only when the layer ran (a skipped layer keeps its hole: the
entry written at its length is masked and overwritten by the next token).

On a GPU the whole walk is captured as one CUDA graph whose ``torch.cond`` calls become
conditional nodes (torch's ``cudagraph_conditional_nodes``; CUDA >= 12.4): one replay per token.
A torch without them is refused in one line. On a CPU the walk runs eagerly (``torch.cond``
traces each branch once): the semantics, tested token for token against the host-branching walk,
not a speed path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specee.runtime.layer_math import RMS_NORMS, rms_norm, rotate_half  # the compiled layer step's own math
from specee.runtime.exit_walk import ExitPlan, ExitValue
from specee.runtime.exit_math import features_from_logits, folded_logits, mlp_logit
from specee.errors import SpeceeError


def conditional_nodes_problem(device) -> str | None:
    """Why this torch cannot capture ``torch.cond`` into CUDA-graph conditional nodes on
    ``device``, or None (a CPU needs none: it runs the walk eagerly)."""
    if torch.device(device).type != "cuda":
        return None
    import importlib.util
    if importlib.util.find_spec("torch._higher_order_ops.cudagraph_conditional_nodes") is None:
        return f"torch {torch.__version__} has no torch._higher_order_ops.cudagraph_conditional_nodes"
    if not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        return f"torch {torch.__version__}'s CUDAGraph has no begin_capture_to_if_node"
    return None


def check_device_exits_supported(exit_control: str, device) -> None:
    if exit_control == "device" and (why := conditional_nodes_problem(device)):
        raise SpeceeError(f"runtime.exit_control=device captures each step as one CUDA graph with conditional "
                          f"nodes, and {why} (torch >= 2.13 built with CUDA >= 12.4 has them); use "
                          "runtime.exit_control=host")


def make_branches(n_q: int, n_kv: int, head_dim: int, eps: float, norm_eps: float, inv_d: float):
    """The walk's ``torch.cond`` branches for one model shape, made once per runtime so every call
    passes the same function objects (``torch.cond`` traces a branch once per function and shapes).
    Every tensor a branch reads is an operand; a branch returns new tensors, never its inputs."""
    g = n_q // n_kv

    def layer(h, cos, sin, k_buf, v_buf, length, ln1, w_qkv, b_qkv, w_o, b_o, ln2, w_gu, w_down):
        """The compiled layer step's math for one token, its new K/V entries returned instead of
        written: attention reads the cache's first ``length`` entries and the new one."""
        x = rms_norm(h, ln1, eps)
        q, k, v = F.linear(x, w_qkv, b_qkv).split([n_q * head_dim, n_kv * head_dim, n_kv * head_dim], -1)
        q = q.view(1, 1, n_q, head_dim).transpose(1, 2)
        k = k.view(1, 1, n_kv, head_dim).transpose(1, 2)
        v = v.view(1, 1, n_kv, head_dim).transpose(1, 2)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * c + rotate_half(q) * s
        k = k * c + rotate_half(k) * s
        cap = k_buf.shape[2]
        idx = torch.arange(cap + 1, device=h.device)
        allowed = (idx < length) | (idx == cap)
        a = F.scaled_dot_product_attention(q.reshape(1, n_kv, g, head_dim), torch.cat([k_buf, k], 2),
                                           torch.cat([v_buf, v], 2), attn_mask=allowed.expand(g, cap + 1)[None, None],
                                           scale=head_dim ** -0.5)
        a = a.reshape(1, n_q, 1, head_dim)
        h = h + F.linear(a.transpose(1, 2).reshape(1, 1, n_q * head_dim), w_o, b_o)
        gate, up = F.linear(rms_norm(h, ln2, eps), w_gu).chunk(2, -1)
        # New storage for K/V (not views into the fused projection): both branches' outputs must
        # share a layout.
        return (h + F.linear(F.silu(gate) * up, w_down), k.clone(memory_format=torch.contiguous_format),
                v.clone(memory_format=torch.contiguous_format))

    def skip_layer(h, cos, sin, k_buf, v_buf, length, ln1, w_qkv, b_qkv, w_o, b_o, ln2, w_gu, w_down):
        kv = torch.zeros(1, n_kv, 1, head_dim, dtype=k_buf.dtype, device=h.device)
        return h.clone(), kv, kv.clone()

    def predictor(h, p_prev, rows, b1, w1t, w2, b2, logit_t):
        feats, p = features_from_logits(folded_logits(h, rows, norm_eps, inv_d), p_prev)
        return mlp_logit(feats, b1, w1t, w2, b2) > logit_t, p

    def no_predictor(h, p_prev, rows, b1, w1t, w2, b2, logit_t):
        return torch.zeros((), dtype=torch.bool, device=h.device), p_prev.clone()

    def verify(h, norm_w, lm_w, spec):
        normed = rms_norm(h, norm_w, norm_eps)[0, 0]
        cand = F.linear(normed, lm_w).argmax()
        return (spec == cand).any(), cand, normed

    def no_verify(h, norm_w, lm_w, spec):
        return (torch.zeros((), dtype=torch.bool, device=h.device), torch.zeros((), dtype=torch.long, device=h.device),
                torch.zeros(h.shape[-1], dtype=h.dtype, device=h.device))

    def final_head(h, normed, token, norm_w, lm_w):
        normed = rms_norm(h, norm_w, norm_eps)[0, 0]
        return normed, F.linear(normed, lm_w).argmax()

    def keep_head(h, normed, token, norm_w, lm_w):
        return normed.clone(), token.clone()

    return {"layer": layer, "skip_layer": skip_layer, "predictor": predictor, "no_predictor": no_predictor,
            "verify": verify, "no_verify": no_verify, "final_head": final_head, "keep_head": keep_head}


class DeviceWalk:
    """The device-decided walk over a compiled runtime's layers and static KV cache."""

    def __init__(self, rt):
        if getattr(rt.norm, "weight", None) is None or type(rt.norm).__name__ not in RMS_NORMS:
            raise SpeceeError("runtime.exit_control=device supports Llama-style RMSNorm models; use "
                              "runtime.exit_control=host")
        self.rt = rt
        d = rt.config.hidden_size
        self.branches = make_branches(rt.n_q, rt.kv_heads, rt.head_dim, float(rt.fused(rt.layers[0]).eps),
                                      float(rt.norm.variance_epsilon), 1.0 / d)
        self._weights = None
        self._banks: dict = {}  # id(bank) -> (bank, its layers with a predictor, per-layer device params)
        self.graphs: dict = {}  # CUDA: one captured walk per cache buffers and bank
        self.captures = 0
        self.use_graph = rt.device.type == "cuda"  # a CPU runs the walk eagerly (the semantics)

    def weights(self) -> list[tuple]:
        """Per layer, its fused weights as ``torch.cond`` operands (absent biases as zeros: an
        operand cannot be None, and adding 0 leaves every value as it was)."""
        if self._weights is None:
            out = []
            for layer in self.rt.layers:
                w = self.rt.fused(layer)
                zeros = lambda n: torch.zeros(n, dtype=w.w_qkv.dtype, device=w.w_qkv.device)  # noqa: E731
                out.append((w.ln1, w.w_qkv, w.b_qkv if w.b_qkv is not None else zeros(w.w_qkv.shape[0]),
                            w.w_o, w.b_o if w.b_o is not None else zeros(w.w_o.shape[0]), w.ln2, w.w_gate_up,
                            w.w_down))
            self._weights = out
        return self._weights

    def bank_params(self, bank) -> tuple[list[bool], dict]:
        """The bank's layers with a predictor (read on the host once per bank, not per step) and
        each one's MLP weights and logit threshold as device tensors (the runtime's static copies)."""
        entry = self._banks.get(id(bank))
        if entry is None or entry[0] is not bank:
            has = [bool(x) for x in bank.has.tolist()]
            params = {}
            for i, on in enumerate(has):
                if on:
                    weights, logit_t = self.rt.predictor_params(bank, i)
                    params[i] = (*weights, torch.tensor(logit_t, dtype=torch.float32, device=self.rt.device))
            entry = self._banks[id(bank)] = (bank, has, params)
        return entry[1], entry[2]

    def inputs(self, plan: ExitPlan, h, rope, cache) -> dict:
        """The step's inputs as device tensors: what the host knows at the step's start (the
        schedule, the replay's forced exits) goes up without a round trip (pinned memory on CUDA)."""
        L, dev = self.rt.num_layers, h.device
        for i in range(L):  # the lengths are known on the host: room for one more entry each
            cache._ensure(i, cache.lengths[i] + 1)
        need = [e or p for e, p in zip(plan.eligible, plan.probe_only)]
        forced = [plan.target is not None and i >= plan.target for i in range(L)]
        masks = torch.tensor([plan.eligible, need, forced, [plan.target is not None] * L], dtype=torch.bool,
                             device="cpu")  # built on the host, then sent up
        if dev.type == "cuda":
            masks = masks.pin_memory()
        return {"h": h, "cos": rope[0], "sin": rope[1], "masks": masks.to(dev, non_blocking=True),
                "spec": plan.spec, "rows": plan.probe.rows, "p0": plan.p0}

    def core(self, x: dict, cache, has: list[bool], params: dict) -> tuple:
        """The walk itself, device work only (what a CUDA graph captures): returns (h at the exit,
        token, norm(h at the exit), exit layer, verifications)."""
        rt, br = self.rt, self.branches
        L, h, dev = rt.num_layers, x["h"], x["h"].device
        elig_t, need_t, forced_t, replaying = x["masks"][0], x["masks"][1], x["masks"][2], x["masks"][3]
        done = torch.zeros((), dtype=torch.bool, device=dev)
        exit_layer = torch.full((), L - 1, dtype=torch.long, device=dev)
        token = torch.zeros((), dtype=torch.long, device=dev)
        normed = torch.zeros(h.shape[-1], dtype=h.dtype, device=dev)
        n_verify = torch.zeros((), dtype=torch.long, device=dev)
        p_prev = x["p0"]
        norm_w, lm_w = rt.norm.weight, rt.lm_head.weight
        for i, w in enumerate(self.weights()):
            live = ~done
            h, k_new, v_new = torch.cond(live, br["layer"], br["skip_layer"],
                                         (h, x["cos"], x["sin"], cache.keys[i], cache.values[i], cache.length_ts[i], *w))
            slot = cache.length_ts[i].view(1)
            cache.keys[i].index_copy_(2, slot, k_new)
            cache.values[i].index_copy_(2, slot, v_new)
            cache.length_ts[i].add_(live.to(torch.long))
            if i == L - 1 or not has[i]:  # the last layer always emits; a layer without a predictor never exits
                continue
            fire, p_prev = torch.cond(live & need_t[i], br["predictor"], br["no_predictor"],
                                      (h, p_prev, x["rows"], *params[i]))
            fire = torch.where(replaying[i], forced_t[i], fire)  # a replay exits where it says
            go = live & elig_t[i] & fire
            hit, cand, normed_i = torch.cond(go, br["verify"], br["no_verify"], (h, norm_w, lm_w, x["spec"]))
            newly = go & (hit | replaying[i])
            token = torch.where(newly, cand, token)
            normed = torch.where(newly, normed_i, normed)
            exit_layer = torch.where(newly, torch.full_like(exit_layer, i), exit_layer)
            n_verify = n_verify + go.to(torch.long)
            done = done | newly
        normed, token = torch.cond(done, br["keep_head"], br["final_head"], (h, normed, token, norm_w, lm_w))
        return h, token, normed, exit_layer, n_verify

    def walk(self, plan: ExitPlan, h, rope, cache, timer) -> ExitValue:
        has, params = self.bank_params(plan.bank)
        x = self.inputs(plan, h, rope, cache)
        if self.use_graph:
            h, token, normed, exit_layer, n_verify = self.replay(x, cache, has, params)
        else:  # eager torch.cond: the semantics on a CPU
            h, token, normed, exit_layer, n_verify = self.core(x, cache, has, params)
        timer.lap("layers")

        def settle(layer: int) -> None:  # host bookkeeping once the exit layer is read
            for j in range(layer + 1):
                cache.advanced(j, 1)
            value.counts["pred_calls"] = sum(plan.eligible[: layer + 1])
            value.counts["delta_probes"] = sum(plan.probe_only[: layer + 1])
        counts = {"pred_calls": 0, "verify_calls": n_verify, "delta_probes": 0}
        value = ExitValue(exit_layer, h, token, normed, counts, on_device=True, spec=plan.spec, _settle=settle)
        return value

    # -- CUDA: the whole walk as one graph with conditional nodes ------------------------------
    def replay(self, x: dict, cache, has, params) -> tuple:
        """Copy the step's inputs into the captured graph's and replay it (capturing it first for
        these cache buffers and this bank). Outputs are cloned: the next replay overwrites them."""
        key = (cache.keys[0].data_ptr(), tuple(cache.keys[0].shape), id(params))
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self.capture(x, cache, has, params)
        static_in, g, static_out = graph
        for name, t in x.items():
            static_in[name].copy_(t, non_blocking=True)
        g.replay()
        return tuple(t.clone() for t in static_out)

    def capture(self, x: dict, cache, has, params):
        """Warm both sides of every ``torch.cond`` (a relaxed capture that is thrown away), then
        capture the walk with each ``torch.cond`` as a conditional node. The warm-up runs a step
        for real: the device-side lengths are restored after it (entries it wrote beyond them are
        masked, and overwritten later)."""
        from torch._higher_order_ops.cudagraph_conditional_nodes import (CUDAGraphCaptureControlFlowOpDispatchMode,
                                                                         ControlFlowOpWarmupDispatchMode)
        check_device_exits_supported("device", x["h"].device)
        static_in = {name: t.clone() for name, t in x.items()}
        lengths = [t.clone() for t in cache.length_ts]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), ControlFlowOpWarmupDispatchMode():
            self.core(static_in, cache, has, params)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), CUDAGraphCaptureControlFlowOpDispatchMode():
            static_out = self.core(static_in, cache, has, params)
        for t, saved in zip(cache.length_ts, lengths):
            t.copy_(saved)
        self.captures += 1
        return static_in, g, static_out
