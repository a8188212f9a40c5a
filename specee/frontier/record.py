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
- ``rules[name]`` (T, L): each exit rule's score (:mod:`specee.exit_rules`, the rule's own
  ``layer_scores``), NaN at the last layer (it never decides);
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
    rules: dict = field(default_factory=dict)  # exit rule name -> (T, L) score (NaN at the last layer)
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
                   targets: list[int] | None = None, svm=None, crf=None, rules=None) -> LayerRecord:
    """Run ``ids`` (1 x N) through every layer once; record decode steps ``first..N-1`` (the token
    at position j is run, predicting position j+1). ``targets``: the scored token per step."""
    return record_requests(rt, draft, banks, k, [(ids, first, targets)], svm, crf, rules)[0]


@torch.inference_mode()
def record_requests(rt, draft, banks: dict, k: int, requests: list[tuple], svm=None, crf=None,
                    rules=None) -> list[LayerRecord]:
    """:func:`record_request` for several ``(ids, first, targets)`` at once (a task item's choices):
    each sequence runs through the layers on its own, but each layer's LM head reads all their
    decode steps in one product. On a CPU the LM head at every layer is most of a record's cost,
    and one product over a few sequences' rows costs about what one sequence's does (the weight is
    read once). Rows are independent, so each record is the one it would be alone."""
    L = rt.num_layers
    scored = requests[0][2] is not None
    if any((r[2] is not None) != scored for r in requests):
        raise ValueError("record_requests: either every request has targets or none has")
    seqs = []
    for ids, first, _ in requests:
        cache = rt.new_cache(ids.shape[1])
        pos = rt.positions(cache, ids.shape[1])
        h = rt.embed(ids)
        seqs.append({"ids": ids, "first": first, "cache": cache, "pos": pos, "h": h, "rope": rt.rope(h, pos)})
    bounds = np.cumsum([0] + [s["ids"].shape[1] - s["first"] for s in seqs])
    T = int(bounds[-1])
    argmax = np.zeros((T, L), dtype=np.int64)
    logp = np.zeros((T, L), dtype=np.float32) if scored else None
    tgt = torch.tensor([t for r in requests for t in r[2]], device=rt.device) if scored else None
    feats_ada, layer_logits = [], []
    rules = rules or {}
    rule_out = {n: np.full((T, L), np.nan, dtype=np.float32) for n in rules}
    rows_of = lambda: torch.cat([s["h"][0, s["first"]:] for s in seqs])  # noqa: E731  (T, d) decode steps
    h_prev = rows_of() if rules else None  # layer 0's input: the embeddings
    for i in range(L):
        for s in seqs:
            s["h"] = rt.run_layer(i, s["h"], s["rope"], s["cache"], None, s["pos"])
        rows = rows_of()
        logits = rt.logits(rows).float()  # (T, V)
        if i < L - 1:
            for n, rule in rules.items():
                rule_out[n][:, i] = rule.layer_scores(i, h_prev, rows, logits if rule.reads_head else None) \
                    .float().cpu().numpy()
        h_prev = rows
        argmax[:, i] = logits.argmax(-1).cpu().numpy()
        if tgt is not None:
            logp[:, i] = torch.log_softmax(logits, -1).gather(-1, tgt[:, None])[:, 0].cpu().numpy()
        if svm is not None or crf is not None:
            feats_ada.append(adainfer_features(logits))
        layer_logits.append(logits)
    # the draft's speculative sets: output j-1 reads (token j, feature j-1) and proposes for position j
    spec = np.zeros((T, k), dtype=np.int64)
    exitable = np.zeros(T, dtype=bool)
    for s, lo in zip(seqs, bounds[:-1]):
        ids, first, N = s["ids"], s["first"], s["ids"].shape[1]
        if N < 2:
            continue
        final_feat = rt.norm(s["h"])  # (1, N, d): the dense feature the draft reads
        f_hat = draft(ids[:, 1:], final_feat[:, :-1], draft.new_cache(N))[0]  # (N-1, d)
        j0 = max(first, 1)  # step j needs draft output j-1
        spec[lo + j0 - first: lo + N - first] = draft.topk(f_hat[j0 - 1: N - 1], k).cpu().numpy()
        exitable[lo + j0 - first: lo + N - first] = True
    spec_t = torch.as_tensor(spec, device=rt.device)
    scores = {}
    for name, bank in banks.items():
        out = np.full((T, L), np.nan, dtype=np.float32)
        p_prev = torch.full((T, k), 1.0 / k, device=rt.device)
        for i in range(L):
            z = layer_logits[i].gather(-1, spec_t)  # (T, K) the speculative tokens' logits
            p = torch.softmax(z, -1)
            if bool(bank.has[i]) and i < L - 1:
                feats = torch.cat([z, p, p - p_prev], -1)
                out[:, i] = bank.logit(i, feats).float().cpu().numpy().reshape(T)
            p_prev = p
        scores[name] = out
    svm_out = crf_out = None
    if feats_ada:
        x = torch.stack(feats_ada, 1)  # (T, L, 2)
        if svm is not None:
            svm_out = (x.float() @ svm.w.to(x.device) + svm.b).cpu().numpy()
        if crf is not None:
            crf_out = crf.to(x.device).filtered(x).cpu().numpy()
    recs = []
    for (_, _, targets), lo, hi in zip(requests, bounds[:-1], bounds[1:]):
        recs.append(LayerRecord(argmax[lo:hi], spec[lo:hi], {n: v[lo:hi] for n, v in scores.items()},
                                svm=None if svm_out is None else svm_out[lo:hi],
                                crf=None if crf_out is None else crf_out[lo:hi],
                                rules={n: v[lo:hi] for n, v in rule_out.items()},
                                logp=None if logp is None else logp[lo:hi],
                                targets=np.asarray(targets, dtype=np.int64) if scored else None,
                                exitable=exitable[lo:hi]))
    return recs


def record_generation(rt, draft, banks, k, prompt_ids: torch.Tensor, tokens: list[int], svm=None, crf=None,
                      rules=None):
    """A dense greedy generation's decode steps: prompt + tokens[:-1] teacher-forced; step t runs
    tokens[t] and predicts tokens[t+1] (tokens[0] comes from the prefill, which never exits)."""
    if len(tokens) < 2:
        return None
    ids = torch.cat([prompt_ids, torch.tensor([tokens[:-1]], device=prompt_ids.device)], 1)
    return record_request(rt, draft, banks, k, ids, prompt_ids.shape[1], tokens[1:], svm, crf, rules)


def record_continuation(rt, draft, banks, k, ctx: list[int], cont: list[int], svm=None, crf=None, rules=None):
    """A scored continuation: ctx + cont[:-1] teacher-forced; the context's last token is a decode
    step (``exit_at_context_end``), so every continuation token is scored by an exit decision."""
    ids = torch.tensor([ctx + cont[:-1]], device=rt.device)
    return record_request(rt, draft, banks, k, ids, len(ctx) - 1, cont, svm, crf, rules)


def record_continuations(rt, draft, banks, k, pairs: list[tuple[list[int], list[int]]], svm=None, crf=None,
                          rules=None):
    """:func:`record_continuation` for several (ctx, cont) pairs in one :func:`record_requests`."""
    return record_requests(rt, draft, banks, k, [(torch.tensor([ctx + cont[:-1]], device=rt.device), len(ctx) - 1, cont)
                                                 for ctx, cont in pairs], svm, crf, rules)
