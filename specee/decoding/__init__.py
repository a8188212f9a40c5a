"""Decoding modes. Each decoder has ``generate(prompt_ids, max_new_tokens, eos_id) -> Generation``."""
from __future__ import annotations

from specee.errors import SpeceeError


def build_decoder(cfg, rt):
    mode = cfg.ablation.mode
    if mode == "dense":
        from specee.decoding.dense import DenseDecoder
        return DenseDecoder(rt)
    raise SpeceeError(f"ablation.mode={mode!r} has no decoder; valid: dense")
