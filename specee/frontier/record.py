"""Per-layer records of one request under dense's trajectory: what every exit policy would see.

A request is a token sequence run teacher-forced through the whole stack once; its *decode
steps* are the positions an early-exit decoder decides on (a generation's tokens after the first,
which the dense prefill emits; a scored continuation's positions, the context's last included, as
``SpecEEDecoder.score`` with ``exit_at_context_end``). At each step and layer the record keeps

- ``argmax`` (T, L): the layer's full-vocabulary argmax (what an exit there emits);
- ``spec`` (T, K): the draft's speculative set, read from (token, dense feature of the previous
  position) — the decoder reads ``norm(h_exit)`` of the previous token, which equals dense's
  until the first exit (one reason replay is exact only up to a sequence's first exit);
- ``scores[bank]`` (T, L): each predictor bank's logit on the features of
  :mod:`specee.early_exit.features` with ``p_prev`` from layer l-1 (``delta_from=previous_layer``:
  the score at a layer does not depend on which other layers were evaluated), NaN where the bank
  has no predictor;
- ``svm`` / ``crf`` (T, L): AdaInfer's SVM margin and its CRF's filtered P(stop | layers 0..l);
- ``logp`` (T, L): the log-probability of the scored token at each layer (scoring requests).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specee.early_exit.features import adainfer_features


@dataclass
class LayerRecord:
    argmax: np.ndarray  # (T, L) int64
    spec: np.ndarray  # (T, K) int64
    scores: dict = field(default_factory=dict)  # bank name -> (T, L) float32 logits (NaN: no predictor)
    svm: np.ndarray | None = None  # (T, L) SVM margin (w.x + b)
    crf: np.ndarray | None = None  # (T, L) P(stop | layers 0..l)
    logp: np.ndarray | None = None  # (T, L) log p_l(target)
    targets: np.ndarray | None = None  # (T,) the scored tokens (scoring requests)
    exitable: np.ndarray | None = None  # (T,) bool: False where the step has no draft history (dense)

    @property
    def steps(self) -> int:
        return int(self.argmax.shape[0])

    @property
    def verified(self) -> np.ndarray:
        """(T, L) bool: the layer's argmax lies in the speculative set (SpecEE's verification)."""
        return (self.argmax[:, :, None] == self.spec[:, None, :]).any(-1)

    @property
    def final(self) -> np.ndarray:
        """(T,) the full stack's argmax: dense's token under dense's trajectory."""
        return self.argmax[:, -1]


@torch.inference_mode()
def record_request(rt, draft, banks: dict, k: int, ids: torch.Tensor, first: int,
                   targets: list[int] | None = None, svm=None, crf=None) -> LayerRecord:
    """Run ``ids`` (1 x N) through every layer once; record decode steps ``first..N-1`` (the token
    at position j is run, predicting position j+1). ``targets``: the scored token per step."""
    N, L = ids.shape[1], rt.num_layers
    cache = rt.new_cache(N)
    pos = rt.positions(cache, N)
    h = rt.embed(ids)
    rope = rt.rope(h, pos)
    T = N - first
    argmax = np.zeros((T, L), dtype=np.int64)
    logp = np.zeros((T, L), dtype=np.float32) if targets is not None else None
    tgt = torch.tensor(targets, device=rt.device) if targets is not None else None
    feats_ada, layer_logits_spec = [], []
    for i in range(L):
        h = rt.run_layer(i, h, rope, cache, None, pos)
        logits = rt.logits(h[0, first:]).float()  # (T, V)
        argmax[:, i] = logits.argmax(-1).cpu().numpy()
        if tgt is not None:
            logp[:, i] = torch.log_softmax(logits, -1).gather(-1, tgt[:, None])[:, 0].cpu().numpy()
        if svm is not None or crf is not None:
            feats_ada.append(adainfer_features(logits))
        layer_logits_spec.append(logits)
    final_feat = rt.norm(h)  # (1, N, d): the dense feature the draft reads
    # the draft's speculative sets: output j-1 reads (token j, feature j-1) and proposes for position j
    spec = np.zeros((T, k), dtype=np.int64)
    exitable = np.zeros(T, dtype=bool)
    if N > 1:
        dcache = draft.new_cache(N)
        f_hat = draft(ids[:, 1:], final_feat[:, :-1], dcache)[0]  # (N-1, d)
        for t in range(T):
            j = first + t
            if j >= 1:
                spec[t] = draft.topk(f_hat[j - 1], k).cpu().numpy()
                exitable[t] = True
    spec_t = torch.as_tensor(spec, device=rt.device)
    scores = {}
    for name, bank in banks.items():
        out = np.full((T, L), np.nan, dtype=np.float32)
        p_prev = torch.full((T, k), 1.0 / k, device=rt.device)
        for i in range(L):
            z = layer_logits_spec[i].gather(-1, spec_t)  # (T, K) the speculative tokens' logits
            p = torch.softmax(z, -1)
            if bool(bank.has[i]) and i < L - 1:
                feats = torch.cat([z, p, p - p_prev], -1)
                out[:, i] = bank.logit(i, feats).float().cpu().numpy().reshape(T)
            p_prev = p
        scores[name] = out
    rec = LayerRecord(argmax, spec, scores, logp=logp, exitable=exitable,
                      targets=np.asarray(targets, dtype=np.int64) if targets is not None else None)
    if feats_ada:
        x = torch.stack(feats_ada, 1)  # (T, L, 2)
        if svm is not None:
            rec.svm = (x.float() @ svm.w.to(x.device) + svm.b).cpu().numpy()
        if crf is not None:
            crf = crf.to(x.device)
            rec.crf = crf.filtered(x).cpu().numpy()
    return rec


def record_generation(rt, draft, banks, k, prompt_ids: torch.Tensor, tokens: list[int], svm=None, crf=None):
    """A dense greedy generation's decode steps: prompt + tokens[:-1] teacher-forced; step t runs
    tokens[t] and predicts tokens[t+1] (tokens[0] comes from the prefill, which never exits)."""
    if len(tokens) < 2:
        return None
    ids = torch.cat([prompt_ids, torch.tensor([tokens[:-1]], device=prompt_ids.device)], 1)
    return record_request(rt, draft, banks, k, ids, prompt_ids.shape[1], tokens[1:], svm, crf)


def record_continuation(rt, draft, banks, k, ctx: list[int], cont: list[int], svm=None, crf=None):
    """A scored continuation: ctx + cont[:-1] teacher-forced; the context's last token is a decode
    step (``exit_at_context_end``), so every continuation token is scored by an exit decision."""
    ids = torch.tensor([ctx + cont[:-1]], device=rt.device)
    return record_request(rt, draft, banks, k, ids, len(ctx) - 1, cont, svm, crf)
