"""The compiled runtime (``runtime=compiled``): the same layer-wise API as :class:`LayerwiseLM`,
with each decoder layer step run by one ``torch.compile``d function over a static KV cache.

Why a separate step function rather than compiling the Hugging Face layer: the HF layer reads its
cache through Python (``cache.update``, slicing to the current length), so every new length is a
new shape. Here a layer step reads and writes a preallocated per-layer K/V buffer at a device-side
length, attends over the whole buffer with a mask (entries past the length, and block entries
the block mask forbids, are masked), and takes the layer's weights as arguments, so one compiled
graph serves every layer of the model and every context length (the buffer's length is a symbolic
size; ``cache_bucket=N`` makes it static, rounded up to a multiple of N, one graph per bucket). Projections are fused — Q, K and
V into one matrix, gate and up into one — by re-pointing the HF modules' weights at views of the
fused storage, so the eager modules (prefill, the KV policies) keep working on the same memory.

One token (autoregressive decoding) and masked blocks of up to ``max_block`` tokens (the tree's
nodes in tree verification) take the compiled step; a prompt takes the model's own layers (its
length varies from request to request). Each distinct block length compiles once; the counters say how
often compilation happened, so a benchmark can show none after warm-up.

CUDA graphs (``compile_mode=reduce-overhead``, with ``cache_bucket`` for static shapes): the step
mutates its K/V buffers and length and reads every layer's weights, so all of these are marked
static addresses (cudagraph trees skip a graph that mutates a non-static input, and would copy
non-static weights per replay), each is its own aligned tensor, a new request reuses a finished
one's buffers (same addresses: graphs replay), and a result records inductor's cudagraph skips
and the graphs recorded. Grouped-query attention folds the query heads of a group into rows of
one KV head instead of repeating the cache.

SpecEE's predictor (the speculative-token probe, its features and the MLP decision) is a second
compiled function, one graph for every layer (the layer's MLP weights are arguments); the exit
decision stays a device tensor until the decoder reads it (the one host sync per predictor).

Supported: Llama-style layers (RMSNorm, fused-able q/k/v/o and gate/up/down projections, SiLU,
RoPE from the model's own rotary module; attention biases allowed). Other layers raise a clear
error naming ``runtime=eager``.
"""
from __future__ import annotations

import copy
import math
import os
import shutil
import time
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch._dynamo
from torch._dynamo.utils import counters as _DYNAMO_COUNTERS
import torch.nn.functional as F

from specee.runtime.exit_math import features_from_logits, folded_logits, mlp_logit
from specee.errors import SpeceeError
from specee.runtime.layer_math import RMS_NORMS, rms_norm, rotate_half
from specee.runtime.layerwise import LayerKVCache, LayerwiseLM



def static_input(t: torch.Tensor | None) -> torch.Tensor | None:
    """Mark ``t`` as living at a fixed address across compiled calls. CUDA-graph trees then
    neither copy it into a graph-owned buffer per replay nor skip the graph because the step
    mutates it (mutated non-static inputs make inductor skip cudagraphs). Unguarded: a new
    address re-records a graph rather than recompiling."""
    if t is not None:
        torch._dynamo.mark_static_address(t, guard=False)
    return t


class StaticKVCache(LayerKVCache):
    """A :class:`LayerKVCache` that never reallocates (its buffers are the compiled step's
    inputs) and mirrors each layer's length in a device tensor, so the compiled step reads and
    advances it without a host round trip."""

    def __init__(self, num_layers, kv_heads, head_dim, dtype, device, capacity):
        super().__init__(num_layers, kv_heads, head_dim, dtype, device, capacity)
        # Zeroed, not empty: attention reads the whole buffer, and a masked entry still multiplies
        # its value by 0 -- uninitialised memory holding a NaN would poison the output.
        for buf in self.keys + self.values:
            static_input(buf.zero_())
        # One standalone tensor per layer, not views of one vector: a view at offset 8*i is not
        # 16-byte aligned, so inductor would copy it (and copy the mutated length back) per call.
        self.length_ts = [static_input(torch.zeros((), dtype=torch.long, device=d)) for d in self.devices]

    @classmethod
    def over(cls, keys: list, values: list, length_ts: list) -> "StaticKVCache":
        """An empty cache over existing buffers (a finished request's), zeroed as a new one is."""
        cache = cls.__new__(cls)
        cache.num_layers, cache._shape = len(keys), tuple(keys[0].shape)
        cache.devices = [k.device for k in keys]
        cache.keys, cache.values, cache.length_ts = list(keys), list(values), list(length_ts)
        cache.lengths, cache.seq_len = [0] * len(keys), 0
        with torch.inference_mode():  # buffers made under inference mode (a decoder's prefill) stay writable
            for t in cache.keys + cache.values + cache.length_ts:
                t.zero_()
        return cache

    @property
    def lengths_t(self) -> torch.Tensor:
        """The device-side lengths as one vector (a copy, for inspection)."""
        return torch.stack([t.to(self.length_ts[0].device) for t in self.length_ts])

    def _ensure(self, layer: int, need: int) -> None:
        if need > self.keys[layer].shape[2]:
            raise SpeceeError(f"static KV cache full ({self.keys[layer].shape[2]} entries, {need} needed); "
                              "the request outgrew the capacity it was allocated with")

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self.length_ts[layer_idx].fill_(self.lengths[layer_idx])
        return out

    def crop(self, length: int) -> None:
        super().crop(length)
        for t in self.length_ts:
            t.clamp_(max=length)

    def keep(self, layer: int, start: int, index: torch.Tensor) -> None:
        super().keep(layer, start, index)
        self.length_ts[layer].fill_(self.lengths[layer])

    def undo_append(self, layer: int, t: int) -> None:
        super().undo_append(layer, t)
        self.length_ts[layer].sub_(t)

    def load_prefix(self, keys: list, values: list, n: int) -> None:
        """As :meth:`LayerKVCache.load_prefix`, written into the static buffers, with the device-side
        lengths the compiled step reads."""
        super().load_prefix(keys, values, n)
        for i, t in enumerate(self.length_ts):
            t.fill_(self.lengths[i])

    def advanced(self, layer: int, t: int) -> None:
        """The compiled step appended ``t`` entries to ``layer`` (and advanced its length tensor itself)."""
        self.lengths[layer] += t


@dataclass
class FusedLayer:
    """One decoder layer's weights in the compiled step's layout (views of the HF modules' own)."""
    ln1: torch.Tensor | None  # None: no input norm (the EAGLE draft layer)
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    ln2: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    eps: float


def _fuse(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate Linear weights (and biases) along the output and re-point each module at its
    slice of the fused tensor: no second copy of the weights."""
    w = static_input(torch.cat([m.weight.detach() for m in modules], 0))
    has_bias = [m.bias is not None for m in modules]
    b = static_input(torch.cat([m.bias.detach() for m in modules], 0)) if all(has_bias) else None
    if any(has_bias) and b is None:
        raise SpeceeError("runtime=compiled cannot fuse projections where only some have a bias; use runtime=eager")
    at = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(w[at:at + n], requires_grad=False)
        if b is not None:
            m.bias = torch.nn.Parameter(b[at:at + n], requires_grad=False)
        at += n
    return w, b


def fuse_layer(layer) -> FusedLayer:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    ok = (attn is not None and mlp is not None
          and all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
          and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
          and not hasattr(attn, "q_norm") and getattr(mlp, "act_fn", None).__class__.__name__ in ("SiLU", "SiLUActivation")
          and type(layer.post_attention_layernorm).__name__ in RMS_NORMS
          and (isinstance(layer.input_layernorm, torch.nn.Identity)
               or type(layer.input_layernorm).__name__ in RMS_NORMS)
          and mlp.down_proj.bias is None and mlp.gate_proj.bias is None)
    if not ok:
        raise SpeceeError(f"runtime=compiled supports Llama-style decoder layers (RMSNorm, q/k/v/o and "
                          f"gate/up/down projections, SiLU); {type(layer).__name__} is not one: use runtime=eager")
    w_qkv, b_qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    w_gu, _ = _fuse([mlp.gate_proj, mlp.up_proj])
    ln1 = None if isinstance(layer.input_layernorm, torch.nn.Identity) else layer.input_layernorm.weight.detach()
    # Weights are the step's inputs: static, so a CUDA graph reads them in place (one graph per
    # layer on the tree's path) instead of copying every layer's weights into its own buffers.
    return FusedLayer(static_input(ln1), w_qkv, b_qkv, static_input(attn.o_proj.weight.detach()),
                      static_input(None if attn.o_proj.bias is None else attn.o_proj.bias.detach()),
                      static_input(layer.post_attention_layernorm.weight.detach()), w_gu,
                      static_input(mlp.down_proj.weight.detach()),
                      float(layer.post_attention_layernorm.variance_epsilon))


def layer_step(h, cos, sin, k_buf, v_buf, length, block, ln1, w_qkv, b_qkv, w_o, b_o, ln2, w_gu, w_down,
               eps: float, n_q: int, n_kv: int, head_dim: int):
    """One Llama decoder layer over T new tokens (h: 1 x T x d) at cache length ``length`` (a
    0-d device tensor, advanced by T here). ``block`` (T x T bool) says which new tokens see each
    other; every earlier entry is visible. Writes the tokens' K/V into the static buffers."""
    t = h.shape[1]
    x = h if ln1 is None else rms_norm(h, ln1, eps)
    q, k, v = F.linear(x, w_qkv, b_qkv).split([n_q * head_dim, n_kv * head_dim, n_kv * head_dim], -1)
    q = q.view(1, t, n_q, head_dim).transpose(1, 2)
    k = k.view(1, t, n_kv, head_dim).transpose(1, 2)
    v = v.view(1, t, n_kv, head_dim).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    slots = length + torch.arange(t, device=h.device)
    k_buf.index_copy_(2, slots, k)
    v_buf.index_copy_(2, slots, v)
    rel = torch.arange(k_buf.shape[2], device=h.device) - length  # entry index relative to the block
    in_block = (rel >= 0) & (rel < t)
    allowed = (rel < 0)[None, :] | (in_block[None, :] & block[:, rel.clamp(0, t - 1)])
    # Grouped-query attention without copying the cache: query head j*g+r reads KV head j, so the
    # g query heads of a group become g*t query rows of one KV head (the mask repeats per row
    # group). Every SDPA backend takes this; repeat_interleave would copy all K/V per layer per
    # token, and SDPA's enable_gqa with an explicit mask falls back to a kernel that repeats too.
    g = n_q // n_kv
    a = F.scaled_dot_product_attention(q.reshape(1, n_kv, g * t, head_dim), k_buf, v_buf,
                                       attn_mask=allowed.repeat(g, 1)[None, None], scale=head_dim ** -0.5)
    a = a.reshape(1, n_q, t, head_dim)  # reshape: a backend may return a transposed layout
    h = h + F.linear(a.transpose(1, 2).reshape(1, t, n_q * head_dim), w_o, b_o)
    g, u = F.linear(rms_norm(h, ln2, eps), w_gu).chunk(2, -1)
    length.add_(t)
    return h + F.linear(F.silu(g) * u, w_down)


def predictor_step(h, rows, eps: float, inv_d: float, p_prev, b1, w1t, w2, b2, logit_t: float):
    """SpecEE's probe + predictor MLP in one call, from the functions the eager path calls
    (specee/runtime/exit_math.py): fire = logit > t."""
    feats, p = features_from_logits(folded_logits(h, rows, eps, inv_d), p_prev)
    return mlp_logit(feats, b1, w1t, w2, b2) > logit_t, p


def compiler_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot run here, or None. Inductor's CPU backend needs a C++ compiler;
    on CUDA triton needs a C compiler too (it builds a launcher at its first kernel), so without
    one the run would crash mid-decoding instead of falling back."""
    if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "no C++ compiler (g++/c++/clang++) on PATH, which inductor needs on a CPU"
    if device.type == "cuda":
        import importlib.util
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed, which inductor needs on CUDA"
        cc = os.environ.get("CC")
        if not (cc and shutil.which(cc)) and not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
            return "no C compiler (cc/gcc/clang or $CC) on PATH, which triton needs to build its kernel launcher"
    return None


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (compiles and recompiles)."""
    return int(_DYNAMO_COUNTERS["stats"]["unique_graphs"])


def cudagraph_skips() -> int:
    """Times inductor declined to CUDA-graph a compiled graph in this process (any reason)."""
    return int(_DYNAMO_COUNTERS["inductor"]["cudagraph_skips"])


def cudagraph_captures(device) -> int | None:
    """CUDA graphs recorded by inductor's cudagraph trees on ``device`` so far; None off CUDA
    or where this torch does not expose the count."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    try:
        from torch._inductor import cudagraph_trees
        manager = cudagraph_trees.get_container(dev.index if dev.index is not None else
                                                torch.cuda.current_device()).tree_manager
        if manager is None:
            return 0
        return next(copy.copy(manager.graph_counter))  # the next graph id = graphs recorded
    except Exception:  # noqa: BLE001 - a private API: report unknown rather than fail a run
        return None


CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def graph_stats(rt) -> dict:
    """Counters a compiled result records: graphs compiled, CUDA-graph skips and captures, and
    the compiled runtime's own step calls (replays ~ calls - captures - warm-up calls)."""
    walk = getattr(rt, "_device_walk", None)
    return {"graphs_compiled": compiled_graphs(), "cudagraph_skips": cudagraph_skips(),
            "cudagraph_captures": cudagraph_captures(rt.device) if getattr(rt, "cudagraphs", False) else None,
            "compiled_calls": getattr(rt, "calls", 0),
            # exit_control=device records its own walk graphs (outside inductor's counters); None: no walk
            "device_walk_captures": (walk.captures if walk is not None else
                                     0 if getattr(rt, "exit_control", "host") == "device" else None)}


class CompiledLM(LayerwiseLM):
    """:class:`LayerwiseLM` whose layer steps (blocks of at most ``max_block`` tokens) run one
    compiled function; ``fallback`` (a reason) when compilation is unavailable: eager, said so."""

    kind = "compiled"

    def __init__(self, model, mode: str = "default", max_block: int = 64, cache_bucket: int = 0,
                 exit_control: str = "host"):
        super().__init__(model)
        from specee.runtime.device_walk import check_device_exits_supported
        check_device_exits_supported(exit_control, self.device)
        self.exit_control = exit_control
        self._device_walk = None
        if len(set(self.layer_devices)) > 1:
            raise SpeceeError("runtime=compiled needs the whole model on one device (its layer step takes every "
                              "layer's weights and cache on one); a model sharded over devices "
                              f"({sorted(set(map(str, self.layer_devices)))}) runs with runtime=eager")
        self.max_block, self.cache_bucket, self.mode = max_block, cache_bucket, mode
        self.cudagraphs = self.device.type == "cuda" and mode in CUDAGRAPH_MODES
        self.calls = 0  # compiled layer-step calls
        self.fallback = compiler_problem(self.device)
        if self.fallback:
            warnings.warn(f"runtime=compiled falls back to eager: {self.fallback}")
        # Keyed by the module itself, weakly: a new draft head never meets a dead one's fusion, and
        # dropping a draft frees its entry.
        self._fused: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        for layer in self.layers:
            self.fused(layer)
        self.n_q = self.config.num_attention_heads
        # One graph per block length, layer kind (with/without input norm) and runtime in a process:
        # raise dynamo's per-function recompile cap so it never silently falls back to eager.
        limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
        self._step = layer_step if self.fallback else torch.compile(layer_step, mode=None if mode == "default" else mode,
                                                                    fullgraph=True, dynamic=False)
        self._one = torch.ones(1, 1, dtype=torch.bool, device=self.device)
        self._predict = predictor_step if self.fallback else torch.compile(
            predictor_step, mode=None if mode == "default" else mode, fullgraph=True, dynamic=False)
        self.compile_seconds = 0.0  # wall time of calls that compiled a graph
        # Per-layer predictor weights as standalone tensors (bank[i] are views at offsets that
        # need not be 16-byte aligned, which inductor copies per call); keyed weakly by the bank.
        self._pred_params: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._cache_pool: dict = {}  # (layers, capacity) -> [[weakref to the user, buffers], ...]

    def fused(self, layer) -> FusedLayer:
        fused = self._fused.get(layer)
        if fused is None:
            fused = self._fused[layer] = fuse_layer(layer)
        return fused

    def new_cache(self, capacity: int = 256, num_layers: int | None = None) -> StaticKVCache:
        # The buffer length is a symbolic size of the graph (bucket 0) or rounded up to a bucket.
        b = self.cache_bucket
        n = num_layers or self.num_layers
        cap = -(-capacity // b) * b if b else max(capacity, 2)
        if b:
            # A CUDA graph reads its static inputs at the addresses it was recorded with: a new
            # request takes the buffers of a finished one of its shape (zeroed), so its graphs
            # replay instead of being recorded again for fresh buffers, inside the timed runs.
            pool = self._cache_pool.setdefault((n, cap), [])
            for entry in pool:
                if entry[0]() is None:  # the request that used these buffers is over
                    cache = StaticKVCache.over(*entry[1])
                    entry[0] = weakref.ref(cache)
                    return cache
        cache = StaticKVCache(n, self.kv_heads, self.head_dim, self.dtype, self.device, cap)
        if b:
            # the entry holds the buffers and a weak reference to the request using them
            pool.append([weakref.ref(cache), (list(cache.keys), list(cache.values), list(cache.length_ts))])
            return cache
        # one graph for every capacity: the buffer length is a symbolic size
        for buf in cache.keys + cache.values:
            torch._dynamo.mark_dynamic(buf, 2)
        return cache

    def step_layer(self, layer, i: int, h, rope, cache, block_mask=None, position_ids=None):
        t = h.shape[1]
        # A prompt (several tokens, causal) varies in length per request: the model's own layers.
        if t > self.max_block or (t > 1 and block_mask is None) or not isinstance(cache, StaticKVCache):
            return super().step_layer(layer, i, h, rope, cache, block_mask, position_ids)
        if block_mask is None:
            block_mask = self._one
        w = self.fused(layer)
        before = compiled_graphs()
        t0 = time.perf_counter()
        cache._ensure(i, cache.lengths[i] + t)
        self.calls += 1
        out = self._step(h, rope[0], rope[1], cache.keys[i], cache.values[i], cache.length_ts[i], block_mask,
                         w.ln1, w.w_qkv, w.b_qkv, w.w_o, w.b_o, w.ln2, w.w_gate_up, w.w_down,
                         w.eps, self.n_q, self.kv_heads, self.head_dim)
        if compiled_graphs() != before:
            self.compile_seconds += time.perf_counter() - t0
        cache.advanced(i, t)
        if self.cudagraphs:
            # A CUDA-graph output lives in the graph's memory pool and is overwritten by the next
            # replay of that graph; every layer replays the same graph, and the caller keeps a
            # layer's output past the next layer (the residual stream, the exit probe), so copy it.
            out = out.clone()
        return out

    @property
    def exits_on_device(self) -> bool:
        return self.exit_control == "device"

    def walk_exits(self, plan, h, rope, cache, pos, timer, observe=None):
        """With ``exit_control=device`` (and no per-layer observer, which reads every layer on the
        host) the exits are decided on the device (specee/runtime/device_walk.py); else the host walk."""
        if not self.exits_on_device or observe is not None or not isinstance(cache, StaticKVCache):
            return super().walk_exits(plan, h, rope, cache, pos, timer, observe)
        if self._device_walk is None:
            from specee.runtime.device_walk import DeviceWalk
            self._device_walk = DeviceWalk(self)
        return self._device_walk.walk(plan, h, rope, cache, timer)

    def predictor_params(self, predictors, i: int) -> tuple:
        """Layer i's static predictor weights for the fused step, and the logit threshold it is
        compared with. Per-layer thresholds are folded into the output bias (logit > t_i <=>
        logit - t_i > 0), so every layer runs the one graph compiled for threshold 0."""
        # A bank changed in place (put, load, new thresholds) invalidates the copies, as _w1t does.
        key = tuple((x.data_ptr(), x._version, x.device) for x in (predictors.w1, predictors.b1, predictors.w2,
                                                                   predictors.b2)) + (
            tuple(predictors.layer_thresholds) if predictors.layer_thresholds is not None else None,)
        per_layer = self._pred_params.get(predictors)
        if per_layer is None or per_layer.get("key") != key:
            per_layer = self._pred_params[predictors] = {"key": key}
        if i not in per_layer:
            b1, w1t, w2, b2 = (x.detach().clone() for x in predictors.layer_params(i))
            t = predictors.logit_threshold_at(i)
            if predictors.layer_thresholds is not None:
                b2, t = (b2 - t, 0.0) if math.isfinite(t) else (b2, t)
            per_layer[i] = (tuple(static_input(x) for x in (b1, w1t, w2, b2)), t)
        return per_layer[i]

    def predict(self, probe, predictors, i: int, h, p_prev):
        (b1, w1t, w2, b2), logit_t = self.predictor_params(predictors, i)
        if not probe.fast or not math.isfinite(logit_t):  # unfolded norm / threshold 0 or 1
            return super().predict(probe, predictors, i, h, p_prev)
        fire, p = self._predict(h, probe.rows, probe.eps, probe.inv_d, p_prev, b1, w1t, w2, b2, logit_t)
        if self.cudagraphs:
            # Both outlive this call (p is the next layer's p_prev, fire is read after later
            # graphs have run): a CUDA-graph output is overwritten by its graph's next replay.
            fire, p = fire.clone(), p.clone()
        return fire, p
