"""Prefill a prompt prefix shared by consecutive lm-eval requests once, and reuse its K/V.

Under the SpecEE authors' accuracy protocol every item's prompt starts with the same five shots
(about 500 tokens on SmolLM2's tokenizer, against an item of 30-60): prefilling them again for
every item is most of the evaluation's time. Multiple-choice tasks share even more: every choice of
an item repeats the item's whole context.

:class:`PrefixReuse` sits between :class:`~specee.evaluation.lm.SpeceeLM` and the decoders, whose
prefills all begin with ``rt.forward(prompt, fresh cache)`` (and, for the draft-head modes,
``draft(prompt[1:], features, fresh draft cache)``). While :meth:`PrefixReuse.active`, those two
calls are served from the previous request of the same kind: the longest common prefix of the two
token sequences (exact token ids, so a prefix is reused only where the model would see exactly
the same tokens at the same positions) is copied into the new cache (``LayerKVCache.load_prefix``)
together with the hidden states the prefill returns for it, and only the rest of the prompt runs.
Causal attention makes the K/V and the hidden state of position ``i`` a function of tokens
``0..i`` alone, so the copy is what a prefill would have written; the tests check that every
item's output and score is the same with and without reuse (``experiment.prefix_reuse``).

Anything else — a decode step, a verification block, a cache that already holds entries — goes
to the runtime as it is. The decoders are not changed.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

# Below this many shared tokens a request is prefilled whole: copying saves nothing measurable,
# and two unrelated prompts share little more than their first token.
MIN_SHARED = 8


@dataclass
class _Entry:
    tokens: list[int]  # the prompt whose prefill this holds
    keys: list
    values: list
    hidden: torch.Tensor  # what the prefill returned, (1, T, d)


def shared_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _fresh(cache) -> bool:
    return cache is not None and cache.seq_len == 0 and not any(cache.lengths)


class PrefixReuse:
    """Reuse of the previous prompt's prefix, for one runtime (and its draft head, if any)."""

    def __init__(self, rt, draft=None, min_shared: int = MIN_SHARED):
        self.rt, self.draft, self.min_shared = rt, draft, min_shared
        self.base: _Entry | None = None  # the last full prefill through rt.forward
        self.head: _Entry | None = None  # the last draft-history prefill (positions = tokens - 1)
        self.current: list[int] | None = None  # the prompt rt.forward just prefilled
        self.reused_tokens = 0  # prompt tokens served from a previous request's prefix
        self.prefilled_tokens = 0  # prompt tokens run through the model

    @contextmanager
    def active(self):
        """Route the runtime's (and draft's) prefills through the prefix store while inside."""
        rt_forward = self.rt.forward
        self.rt.forward = self._forward(rt_forward)  # an instance attribute: every caller sees it
        draft_forward = None
        if self.draft is not None:
            draft_forward = self.draft.forward
            self.draft.forward = self._draft_forward(draft_forward)
        try:
            yield self
        finally:
            del self.rt.forward  # back to the class's method
            if draft_forward is not None:
                del self.draft.forward

    def _forward(self, forward):
        def call(ids, cache, block_mask=None, position_ids=None, upto=None, commit=True):
            plain = (block_mask is None and position_ids is None and upto is None and commit
                     and ids.dim() == 2 and ids.shape[0] == 1 and ids.shape[1] > 1 and _fresh(cache))
            if not plain:
                return forward(ids, cache, block_mask, position_ids, upto, commit)
            tokens = ids[0].tolist()
            n = self._usable(self.base, tokens)
            if n:
                cache.load_prefix(self.base.keys, self.base.values, n)
                h = torch.cat([self.base.hidden[:, :n], forward(ids[:, n:], cache)], 1)
            else:
                h = forward(ids, cache)
            self.reused_tokens += n
            self.prefilled_tokens += len(tokens) - n
            keys, values = cache.export_prefix(len(tokens))
            self.base = _Entry(tokens, keys, values, h)
            self.current = tokens
            return h
        return call

    def _draft_forward(self, forward):
        def call(next_ids, feats, cache=None, position_ids=None, mask=None):
            cur = self.current
            plain = (position_ids is None and mask is None and _fresh(cache) and next_ids.shape[1] > 1
                     and cur is not None and len(cur) == next_ids.shape[1] + 1
                     and next_ids[0].tolist() == cur[1:])
            if not plain:  # not the history of the prompt just prefilled: run as it is
                return forward(next_ids, feats, cache, position_ids, mask)
            # Draft position j reads (token j+1, feature j): it depends on tokens 0..j+1, so a prompt
            # sharing n tokens shares n - 1 draft positions.
            n = self._usable(self.head, cur) - 1 if self.head is not None else 0
            n = max(min(n, next_ids.shape[1] - 1), 0)
            if n >= self.min_shared:
                cache.load_prefix(self.head.keys, self.head.values, n)
                out = torch.cat([self.head.hidden[:, :n], forward(next_ids[:, n:], feats[:, n:], cache)], 1)
            else:
                out = forward(next_ids, feats, cache)
            keys, values = cache.export_prefix(next_ids.shape[1])
            self.head = _Entry(cur, keys, values, out)
            return out
        return call

    def _usable(self, entry: _Entry | None, tokens: list[int]) -> int:
        """How many leading tokens of ``tokens`` the entry serves: the shared length, short of the
        last token (its hidden state is the one the caller reads), 0 below ``min_shared``."""
        if entry is None:
            return 0
        n = min(shared_length(entry.tokens, tokens), len(tokens) - 1)
        return n if n >= self.min_shared else 0
