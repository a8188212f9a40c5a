"""Run a Hugging Face decoder-only LM layer by layer, over its own modules.

``LayerwiseLM`` wraps a loaded ``*ForCausalLM`` (Llama, Mistral, Qwen2 and other models laid out
as ``model.embed_tokens / model.layers / model.norm / lm_head``) and exposes the pieces that
early exit needs: ``embed`` -> ``run_layer(i)`` for each layer -> ``logits``. Nothing of the
modeling file is copied: every call goes into the model's own decoder layers, which read and
write K/V through :class:`LayerKVCache`.

The cache keeps one length *per layer*, and the sequence length (the next token's position)
separately, so a token that ran only layers ``0..e`` is representable: deeper layers simply have
fewer entries (the ``holes`` policy) until something fills them. Batch size is 1 throughout,
the latency setting of the SpecEE paper.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specee.errors import SpeceeError


def concat_limit_bytes(device) -> int:
    """Up to how many bytes of one layer's keys (or values) appending concatenates (see
    :class:`LayerKVCache`). On a CPU a dispatch costs about as much as copying ~128 KiB (measured:
    a concatenation of 96 KiB 3.5 us against 3.8 us for the three dispatches of an in-place write).
    On an accelerator at batch 1 the host's dispatches are the step's cost and the copy runs on the
    device beside them (16 MiB: a few microseconds of HBM bandwidth), so the limit is larger there."""
    return 128 * 1024 if torch.device(device).type == "cpu" else 16 * 2**20


class LayerKVCache:
    """Per-layer K/V buffers with independent lengths; duck-types HF's ``Cache.update``.

    Entries ``[:lengths[i]]`` of ``keys[i]`` / ``values[i]`` are layer i's cache; anything past
    them is stale (a crop or a rollback only lowers the length). Two ways to append, chosen per
    call: while a layer's history is small (``concat``; below :func:`concat_limit_bytes`), a
    ``torch.cat`` whose result *is* what attention reads -- one dispatch per tensor, as transformers'
    own ``DynamicCache``; past it, a copy into a preallocated buffer grown by doubling (a slice to
    write, the copy, a slice to read: three dispatches, but no copy of the whole history).
    ``concat=False`` (the compiled runtime's static cache) always writes in place.
    """

    concat_limits = None  # per layer, bytes of history below which appending concatenates; None: never

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype, device,
                 capacity: int = 256, concat: bool = False):
        self.num_layers = num_layers
        self._shape = (1, kv_heads, capacity, head_dim)
        # ``device``: one device, or one per layer (a model sharded with device_map=auto keeps
        # each layer's K/V on that layer's device).
        self.devices = list(device) if isinstance(device, (list, tuple)) else [device] * num_layers
        # Concatenating caches start empty: the buffer for in-place appends (``capacity``) is made
        # only if a layer outgrows the concatenation limit.
        shape = (1, kv_heads, 0, head_dim) if concat else self._shape
        self.keys = [torch.empty(shape, dtype=dtype, device=d) for d in self.devices]
        self.values = [torch.empty(shape, dtype=dtype, device=d) for d in self.devices]
        self.lengths = [0] * num_layers
        self.seq_len = 0  # tokens accepted into the sequence = position of the next token
        if concat:
            token_bytes = kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
            self.concat_limits = [concat_limit_bytes(d) // token_bytes for d in self.devices]  # in entries

    def _ensure(self, layer: int, need: int) -> None:
        cap = self.keys[layer].shape[2]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap, self._shape[2])
        for store in (self.keys, self.values):
            old = store[layer]
            buf = old.new_empty((old.shape[0], old.shape[1], new_cap, old.shape[3]))
            buf[:, :, : self.lengths[layer]] = old[:, :, : self.lengths[layer]]
            store[layer] = buf

    # Called by the model's own attention modules.
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        n, t = self.lengths[layer_idx], key_states.shape[2]
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.concat_limits is not None and n + t <= self.concat_limits[layer_idx]:
            # The concatenation is both the write and the tensor attention reads; a stale tail (a
            # crop, a rollback, a tree's rejected nodes) is cut off first.
            if keys.shape[2] != n:
                keys, values = keys[:, :, :n], values[:, :, :n]
            self.keys[layer_idx] = keys = torch.cat([keys, key_states], 2)
            self.values[layer_idx] = values = torch.cat([values, value_states], 2)
            self.lengths[layer_idx] = n + t
            return keys, values
        self._ensure(layer_idx, n + t)
        self.keys[layer_idx][:, :, n:n + t] = key_states
        self.values[layer_idx][:, :, n:n + t] = value_states
        self.lengths[layer_idx] = n + t
        return self.keys[layer_idx][:, :, : n + t], self.values[layer_idx][:, :, : n + t]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # HF API; we mean the sequence, not a layer
        return self.seq_len

    def crop(self, length: int) -> None:
        """Drop every entry at or beyond sequence index ``length`` (layers with holes included)."""
        self.lengths = [min(n, length) for n in self.lengths]
        self.seq_len = min(self.seq_len, length)

    def undo_append(self, layer: int, t: int) -> None:
        """Forget the last ``t`` entries appended to ``layer`` (a layer run ahead of an exit; a timed
        call): only the length drops, the entries beyond it are stale."""
        self.lengths[layer] -= t

    def keep(self, layer: int, start: int, index: torch.Tensor) -> None:
        """Keep entries ``index`` (relative to ``start``) of ``layer``'s tail, compacting in place."""
        for store in (self.keys, self.values):
            tail = store[layer][:, :, start + index]
            store[layer][:, :, start:start + len(index)] = tail
        self.lengths[layer] = start + len(index)

    def missing_layers(self) -> list[int]:
        """Layers that lack entries for some accepted position (skipped by an early exit)."""
        return [i for i, n in enumerate(self.lengths) if n < self.seq_len]

    # -- a shared prompt prefix (specee/evaluation/prefix.py) ------------------------------------
    def export_prefix(self, n: int) -> tuple[list, list]:
        """Copies of every layer's first ``n`` entries: a prompt prefix another request may start
        from. Copies, because this cache's buffers are reused or rewritten after its request."""
        if any(length < n for length in self.lengths):
            raise SpeceeError(f"cannot export a {n}-token prefix: some layer holds fewer entries")
        return ([k[:, :, :n].clone() for k in self.keys[:self.num_layers]],
                [v[:, :, :n].clone() for v in self.values[:self.num_layers]])

    def load_prefix(self, keys: list, values: list, n: int) -> None:
        """Start this empty cache with the first ``n`` entries of ``keys`` / ``values`` (from
        :meth:`export_prefix` of a request whose prompt began with the same ``n`` tokens): the K/V a
        prefill of those tokens would have written, so only the rest of the prompt is run."""
        if self.seq_len or any(self.lengths):
            raise SpeceeError("a prompt prefix can only start an empty cache")
        for i in range(self.num_layers):
            k, v = keys[i][:, :, :n], values[i][:, :, :n]
            if self.concat_limits is not None and n <= self.concat_limits[i]:
                self.keys[i], self.values[i] = k.clone(), v.clone()  # what a concatenation would hold
            else:
                self._ensure(i, n)
                self.keys[i][:, :, :n] = k
                self.values[i][:, :, :n] = v
            self.lengths[i] = n
        self.seq_len = n


@dataclass
class ModelParts:
    embed: torch.nn.Module
    layers: torch.nn.ModuleList
    norm: torch.nn.Module
    lm_head: torch.nn.Module
    rotary: torch.nn.Module


def _parts(model) -> ModelParts:
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, n) for n in needed) or not hasattr(model, "lm_head"):
        raise SpeceeError(
            f"{type(model).__name__} is not laid out as a Llama-family causal LM "
            "(model.embed_tokens / model.layers / model.norm / model.rotary_emb / lm_head); "
            "specee supports Llama, Mistral, Qwen2 and similar decoders")
    return ModelParts(inner.embed_tokens, inner.layers, inner.norm, model.lm_head, inner.rotary_emb)


MASK_MEMO_SIZE = 8  # additive block masks remembered per block (one per cached length)


class LayerwiseLM:
    """embed -> layer 0 -> ... -> layer L-1 -> norm -> lm_head, one call per piece."""

    def __init__(self, model):
        p = _parts(model)
        self.model = model.eval()
        self.config = model.config
        self.embed_tokens, self.layers, self.norm, self.lm_head, self.rotary = (
            p.embed, p.layers, p.norm, p.lm_head, p.rotary)
        self.num_layers = len(self.layers)
        c = self.config
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        windows = [getattr(layer.self_attn, "sliding_window", None) for layer in self.layers]
        types = getattr(c, "layer_types", None) or []
        if not any(windows) and getattr(c, "use_sliding_window", True) and \
                (not types or "sliding_attention" in types):
            windows = [getattr(c, "sliding_window", None)]  # recent transformers keep it on the config only
        self.sliding_window = min((w for w in windows if w), default=None)
        # Without SDPA (e.g. eager attention) a causal block needs an explicit mask.
        self._sdpa = getattr(self.config, "_attn_implementation", "sdpa") == "sdpa"
        self.dtype = self.embed_tokens.weight.dtype
        self.device = self.embed_tokens.weight.device
        # Where each layer's weights live: several devices when device_map=auto shards the model.
        self.layer_devices = [next(layer.parameters()).device for layer in self.layers]
        self._mask_memo = None  # (block_mask, its version, T, {cached length: additive mask})

    kind = "eager"
    fallback = None  # why a compiled runtime runs eagerly (None: it does not)
    exits_on_device = False  # the walk's exit decisions stay on the device (runtime.exit_control=device)
    exit_control = "host"  # host | lookahead (see specee/runtime/exit_walk.py) | device (compiled only)

    def new_cache(self, capacity: int = 256, num_layers: int | None = None) -> LayerKVCache:
        return LayerKVCache(num_layers or self.num_layers, self.kv_heads, self.head_dim, self.dtype,
                            self.cache_devices(num_layers), capacity, concat=True)

    def cache_devices(self, num_layers: int | None = None) -> list:
        """Per cache layer, its layer's device (a one-layer draft cache lives with layer 0)."""
        return self.layer_devices[: num_layers or self.num_layers]

    # -- pieces ---------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def rope(self, h: torch.Tensor, position_ids: torch.Tensor, last: int | None = None):
        """cos/sin for ``position_ids``. ``last``: the largest position, known on the host to the
        caller; without it a sliding-window model reads it from the device (a sync)."""
        if self.sliding_window is not None:
            last = int(position_ids.max()) if last is None else last
        if self.sliding_window is not None and last >= self.sliding_window:
            raise SpeceeError(
                f"sequence reaches position {last}, beyond this model's sliding "
                f"window ({self.sliding_window}); sliding-window eviction is not implemented — "
                "use shorter prompts / max_new_tokens")
        return self.rotary(h, position_ids=position_ids)

    def run_layer(self, i: int, h: torch.Tensor, rope, cache: LayerKVCache,
                  block_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None):
        """One decoder layer over a block of T new tokens.

        ``block_mask`` (T x T, bool, True = may attend) says which new tokens see each other;
        every cached entry of this layer is visible to all of them. None means causal.
        """
        return self.step_layer(self.layers[i], i, h, rope, cache, block_mask, position_ids)

    def step_layer(self, layer, i: int, h, rope, cache: LayerKVCache, block_mask=None, position_ids=None):
        """``layer`` (a decoder layer of this model's class, e.g. the draft head's) over h, reading
        and writing cache layer ``i``. The compiled runtime overrides this one verb."""
        mask = self.mask_for(cache.lengths[i], h.shape[1], block_mask)
        return layer(h, attention_mask=mask, position_embeddings=rope,
                     position_ids=position_ids, cache=cache, use_cache=True)

    def predict(self, probe, predictors, i: int, h, p_prev):
        """SpecEE's predictor at layer i on h: (fire, a device bool; p, the next p_prev). The
        features are :mod:`specee.early_exit.features`'; the compiled runtime fuses this verb."""
        return predictors.decide_from_logits(i, probe.logits(h), p_prev)

    # -- the layer walk ------------------------------------------------------------------------
    def walk(self, h, rope, cache, pos, block, eligible: list[bool], exit_test, timer, observe=None):
        """The early-exit layer walk with a host-side exit test, shared by every early-exit mode and
        by predictor-data collection: run ``h`` up the stack; after each layer i with
        ``eligible[i]`` ask ``exit_test(i, h)``, which returns None to continue or a decision to exit
        with. ``observe(i, h)`` (optional) sees every layer. Returns (exit layer, h at it, decision
        or None for the full stack)."""
        for i in range(self.num_layers):
            h = self.run_layer(i, h, rope, cache, block, pos)
            timer.lap("layers")
            if observe is not None:
                observe(i, h)
            if eligible[i]:
                decision = exit_test(i, h)
                if decision is not None:
                    return i, h, decision
        return self.num_layers - 1, h, None

    def walk_exits(self, plan, h, rope, cache, pos, timer, observe=None):
        """Autoregressive SpecEE's walk over an :class:`~specee.runtime.exit_walk.ExitPlan`: an
        :class:`~specee.runtime.exit_walk.ExitValue`. Here the host branches after each scheduled
        predictor; the compiled runtime may keep the decision on the device."""
        return plan.walk_on_host(self, h, rope, cache, pos, timer, observe)

    def mask_for(self, past: int, t: int, block_mask: torch.Tensor | None):
        """Additive mask for T new tokens over ``past`` cached ones; None when SDPA's default fits."""
        if block_mask is None and (t == 1 or (past == 0 and self._sdpa)):
            return None  # one token sees everything; a fresh causal block uses SDPA's causal path
        if block_mask is None:
            return self._additive_mask(past, t, block_mask)
        # A block mask (tree verification) is asked for once per layer with the same block: build
        # it once per step and cached length (layers that exited early, and the draft, hold fewer
        # entries). Not a slice of a wider mask: CUDA's memory-efficient SDPA kernel reads the
        # mask at its data pointer without checking its alignment, and a slice starting at column
        # k > 0 of a 2-byte mask is misaligned ("CUDA error: misaligned address", seen on an H200
        # in float16 and bfloat16 tree decoding; pytorch/pytorch#183484).
        memo = self._mask_memo
        if memo is None or memo[0] is not block_mask or memo[1] != block_mask._version or memo[2] != t:
            memo = self._mask_memo = (block_mask, block_mask._version, t, {})
        masks = memo[3]
        if past not in masks:
            # A decoder keeps one block mask for its whole life (a fixed tree), so the memo would
            # otherwise gain an entry every step; a step asks for a few lengths (full-depth layers,
            # layers behind an exit), so the last few built are all it can reuse.
            if len(masks) >= MASK_MEMO_SIZE:
                masks.pop(next(iter(masks)))
            masks[past] = self._additive_mask(past, t, block_mask)
        return masks[past]

    def _additive_mask(self, past: int, t: int, block_mask: torch.Tensor | None) -> torch.Tensor:
        """T x (past + block width) additive mask, as its own allocation (storage offset 0) with rows padded
        to a multiple of 8 entries: the layout SDPA's memory-efficient kernel reads without a copy."""
        if block_mask is None:
            block_mask = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
        allowed = torch.cat([torch.ones(t, past, dtype=torch.bool, device=self.device), block_mask], 1)
        width = allowed.shape[1]  # past + T, or more where a draft level sees earlier levels
        mask = torch.zeros(t, -(-width // 8) * 8, dtype=self.dtype, device=self.device)[:, :width]
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)[None, None]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits of (already final-normed or not) hidden states: norm -> lm_head."""
        return self.lm_head(self.norm(h))

    # -- whole-stack forward --------------------------------------------------------------
    def positions(self, cache: LayerKVCache, n: int) -> torch.Tensor:
        return torch.arange(cache.seq_len, cache.seq_len + n, device=self.device).unsqueeze(0)

    def forward(self, ids: torch.Tensor, cache: LayerKVCache, block_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, upto: int | None = None,
                commit: bool = True) -> torch.Tensor:
        """Run ``ids`` (shape 1 x T) through layers ``0..upto-1`` (all by default); return hidden.

        ``commit`` advances ``cache.seq_len`` by T (a verification pass may commit later).
        """
        last = None
        if position_ids is None:
            position_ids = self.positions(cache, ids.shape[1])
            last = cache.seq_len + ids.shape[1] - 1
        h = self.embed(ids)
        rope = self.rope(h, position_ids, last)
        for i in range(self.num_layers if upto is None else upto):
            h = self.run_layer(i, h, rope, cache, block_mask, position_ids)
        if commit:
            cache.seq_len += ids.shape[1]
        return h
