"""Dense greedy decoding through the layer-wise runtime (the lossless reference)."""
from __future__ import annotations

import torch

from specee.decoding.base import Clock, Generation, Score, score_from_logits
from specee.runtime import LayerKVCache, LayerwiseLM


@torch.inference_mode()
def prefill(rt: LayerwiseLM, ids: torch.Tensor, cache: LayerKVCache) -> torch.Tensor:
    """Run the prompt through every layer; return the last position's final hidden state."""
    return rt.forward(ids, cache)[:, -1:]


@torch.inference_mode()
def decode_one_token(rt: LayerwiseLM, token: torch.Tensor, cache: LayerKVCache) -> torch.Tensor:
    return rt.forward(token.view(1, 1), cache)


class DenseDecoder:
    name = "dense"

    def __init__(self, rt: LayerwiseLM):
        self.rt = rt

    @torch.inference_mode()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, eos_id: int | None = None) -> Generation:
        rt, clock = self.rt, Clock(self.rt.device)
        cache = rt.new_cache(prompt_ids.shape[1] + max_new_tokens)
        t0 = clock()
        h = prefill(rt, prompt_ids, cache)
        token = rt.logits(h)[0, -1].argmax()
        t1 = clock()
        tokens, times = [int(token)], [t1 - t0]
        while len(tokens) < max_new_tokens and tokens[-1] != eos_id:
            t0 = t1
            h = decode_one_token(rt, token, cache)
            token = rt.logits(h)[0, -1].argmax()
            t1 = clock()
            tokens.append(int(token))
            times.append(t1 - t0)
        return Generation(tokens, times[0], times, [rt.num_layers] * len(tokens))

    @torch.inference_mode()
    def score(self, context_ids: torch.Tensor, continuation: list[int], exit_at_context_end: bool = True) -> Score:
        """One forward over context + continuation: the same log-probs as the HF model's own."""
        rt = self.rt
        ids = torch.cat([context_ids, torch.tensor([continuation], device=context_ids.device)], 1)
        h = rt.forward(ids[:, :-1], rt.new_cache(ids.shape[1]))
        logits = rt.logits(h[0, context_ids.shape[1] - 1:])
        return score_from_logits(logits, continuation, [rt.num_layers] * len(continuation))
