"""Dense greedy decoding through the layer-wise runtime (the lossless reference)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specee.decoding.base import LoopDecoder, Score, Step, score_from_logits
from specee.runtime.layerwise import LayerKVCache, LayerwiseLM


@torch.inference_mode()
def prefill(rt: LayerwiseLM, ids: torch.Tensor, cache: LayerKVCache) -> torch.Tensor:
    """Run the prompt through every layer; return the last position's final hidden state."""
    return rt.forward(ids, cache)[:, -1:]


@torch.inference_mode()
def decode_one_token(rt: LayerwiseLM, token: torch.Tensor, cache: LayerKVCache) -> torch.Tensor:
    """``token``: a (1, 1) id tensor, or any one-element one (reshaped: a dispatch more per step)."""
    return rt.forward(token if token.dim() == 2 else token.view(1, 1), cache)


@dataclass
class DenseSession:
    cache: LayerKVCache
    token: torch.Tensor  # last emitted token, shape (1, 1), on the runtime's device


class DenseDecoder(LoopDecoder):
    name = "dense"

    def __init__(self, rt: LayerwiseLM):
        self.rt = rt

    @torch.inference_mode()
    def prefill(self, prompt_ids, max_new_tokens: int):
        rt = self.rt
        cache = rt.new_cache(prompt_ids.shape[1] + max_new_tokens)
        # argmax over the last dim of (1, 1, vocab) logits: the (1, 1) id the next step feeds
        # back as is (indexing [0, -1] and reshaping would cost three dispatches per token)
        token = rt.logits(prefill(rt, prompt_ids, cache)).argmax(-1)
        return DenseSession(cache, token), int(token)

    @torch.inference_mode()
    def step(self, s: DenseSession) -> Step:
        rt = self.rt
        s.token = rt.logits(decode_one_token(rt, s.token, s.cache)).argmax(-1)
        return Step([int(s.token)], rt.num_layers - 1)

    @torch.inference_mode()
    def score(self, context_ids: torch.Tensor, continuation: list[int], exit_at_context_end: bool = True) -> Score:
        """One forward over context + continuation: the same log-probs as the HF model's own."""
        rt = self.rt
        ids = torch.cat([context_ids, torch.tensor([continuation], device=context_ids.device)], 1)
        h = rt.forward(ids[:, :-1], rt.new_cache(ids.shape[1]))
        logits = rt.logits(h[0, context_ids.shape[1] - 1:])
        return score_from_logits(logits, continuation, [rt.num_layers] * len(continuation))
