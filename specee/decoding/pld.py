"""Prompt lookup decoding (PLD, Saxena 2023) in the layer-wise runtime: lossless, no draft model.

Each step looks the last ``ngram_size`` tokens (then shorter n-grams, down to 1) up in the text so
far (prompt + generated); at the first earlier occurrence, the up to ``num_tokens`` tokens that
followed it are the proposal (cut before an EOS). One whole-stack forward over the last token and
the proposal verifies it: the longest prefix the model's own greedy argmax agrees with is kept,
plus the model's next token (the bonus), so the output is dense greedy decoding token for token.
The K/V of refuted tokens is dropped. Without a match the step is a dense step.

The proposal rule is transformers' ``PromptLookupCandidateGenerator`` (``generate(
prompt_lookup_num_tokens=N)``) step for step, so the two agree on the tokens and on the tokens
accepted per step; :func:`propose` is tested against it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specee.decoding.base import LoopDecoder, Step
from specee.decoding.dense import prefill
from specee.errors import SpeceeError
from specee.runtime.layerwise import LayerKVCache, LayerwiseLM


def propose(ids: list[int], num_tokens: int, ngram_size: int, eos_id: int | None = None,
            max_length: int | None = None) -> list[int]:
    """The continuation of the first earlier occurrence of the longest matching suffix n-gram
    (``ngram_size`` down to 1): at most ``num_tokens`` tokens, read from positions below
    ``max_length`` (the generation's prompt + budget, transformers' cap), cut before the first
    ``eos_id``. Empty when nothing matches, or when the first usable match starts with EOS."""
    n_ids = len(ids)
    if max_length is not None and max_length == n_ids + 1:
        return []  # room for the next token only
    for n in range(min(ngram_size, n_ids - 1), 0, -1):
        tail = ids[-n:]
        for start in range(0, n_ids - n + 1):
            if ids[start:start + n] != tail:
                continue
            begin = start + n
            end = min(begin + num_tokens, n_ids, max_length if max_length is not None else n_ids)
            if begin < end:  # the first usable occurrence decides, even if EOS empties it
                chosen = ids[begin:end]
                if eos_id is not None and eos_id in chosen:
                    chosen = chosen[:chosen.index(eos_id)]
                return chosen
    return []  # a shorter n-gram is tried only when the longer one matched nowhere usable


@dataclass
class LookupSession:
    cache: LayerKVCache
    ids: list[int]  # prompt + generated; the last one is not in the cache yet
    max_length: int  # prompt + token budget (proposals never reach past it)


class PromptLookupDecoder(LoopDecoder):
    name = "pld"
    multi_token = True

    def __init__(self, rt: LayerwiseLM, *, num_tokens: int = 10, ngram_size: int = 2, eos_id: int | None = None):
        if num_tokens < 1 or ngram_size < 1:
            raise SpeceeError(f"prompt lookup needs ablation.num_tokens >= 1 and ablation.ngram_size >= 1, "
                              f"not {num_tokens} and {ngram_size}")
        self.rt, self.num_tokens, self.ngram_size, self.eos_id = rt, num_tokens, ngram_size, eos_id
        from specee.decoding.dense import DenseDecoder
        self._dense = DenseDecoder(rt)  # scores: prompt lookup is lossless, so it scores as dense does

    def score(self, context_ids, continuation: list[int], exit_at_context_end: bool = True):
        """Teacher-forced scoring: prompt lookup is lossless, so it scores as dense does."""
        return self._dense.score(context_ids, continuation, exit_at_context_end)

    @torch.inference_mode()
    def prefill(self, prompt_ids, max_new_tokens: int):
        rt = self.rt
        cache = rt.new_cache(prompt_ids.shape[1] + max_new_tokens + self.num_tokens + 1)
        token = int(rt.logits(prefill(rt, prompt_ids, cache))[0, -1].argmax())
        ids = prompt_ids[0].tolist() + [token]
        return LookupSession(cache, ids, prompt_ids.shape[1] + max_new_tokens), token

    @torch.inference_mode()
    def step(self, s: LookupSession) -> Step:
        rt, timer = self.rt, self.timer()
        timer.start()
        cand = propose(s.ids, self.num_tokens, self.ngram_size, self.eos_id, s.max_length)
        timer.lap("draft")
        block = timer.to_device([[s.ids[-1], *cand]], dtype=torch.long)
        before = s.cache.seq_len
        h = rt.forward(block, s.cache)
        timer.lap("layers")
        out = timer.host_list(rt.logits(h)[0].argmax(-1))
        accepted = 0
        while accepted < len(cand) and out[accepted] == cand[accepted]:
            accepted += 1
        s.cache.crop(before + 1 + accepted)  # the last token and the accepted proposal stay
        emitted = cand[:accepted] + [out[accepted]]
        s.ids += emitted
        timer.lap("verification")
        L = rt.num_layers
        return Step(emitted, L - 1, {"exit_layer": L - 1, "layers": L, "nodes": len(cand) + 1,
                                     "proposed": len(cand), "accepted": accepted + 1, "matched": bool(cand),
                                     "head_rows": len(cand) + 1, "pred_calls": 0, "verify_calls": 0,
                                     **timer.trace()})
