"""What the layers an early exit skipped keep in their K/V cache for that token.

- ``holes``: nothing (the reference SpecEE code): those layers lack the position; later tokens
  attend over the positions they have, RoPE positions stay the true ones.
- ``propagate``: fill each skipped layer's K/V from the exit hidden state, as CALM does: the
  skipped layer's own input norm, k/v projections (and k-norm where the model has one) and RoPE
  at the token's position, applied to h_exit.
"""
from __future__ import annotations

import sys

import torch

from specee.errors import SpeceeError
from specee.runtime.layerwise import LayerKVCache, LayerwiseLM

POLICIES = ("holes", "propagate")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise SpeceeError(f"early_exit.kv_policy={policy!r} is unknown; valid: {', '.join(POLICIES)}")
    return policy


def fill_skipped(rt: LayerwiseLM, cache: LayerKVCache, h_exit: torch.Tensor, exit_layer: int,
                 rope, policy: str) -> None:
    if policy == "holes" or exit_layer >= rt.num_layers - 1:
        return
    cos, sin = rope
    t = h_exit.shape[1]
    for j in range(exit_layer + 1, rt.num_layers):
        layer = rt.layers[j]
        attn = layer.self_attn
        x = layer.input_layernorm(h_exit)
        k = attn.k_proj(x).view(1, t, -1, rt.head_dim)
        v = attn.v_proj(x).view(1, t, -1, rt.head_dim).transpose(1, 2)
        if hasattr(attn, "k_norm"):
            k = attn.k_norm(k)
        k = k.transpose(1, 2)
        rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        _, k = rotate(k, k, cos, sin)
        cache.update(k, v, j)
