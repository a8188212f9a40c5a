"""Training data for exit predictors: dense greedy decoding, features and labels at every layer.

Per generated token and layer l: the speculative features (draft proposes S from the dense
history), AdaInfer's [gap, top_prob], and the label ``argmax(lm_head(norm(h_l))) == final token``
(``label``) — and, as the SpecEE authors' collection script labels it, from the un-normed state,
``argmax(lm_head(h_l)) == final token`` (``label_unnormed``). A token's heads over all its layers
run as one (rows x vocabulary) product, not one vector product per layer: on a CPU that reads the
head's weights once per token instead of once per layer.
"""
from __future__ import annotations

import numpy as np
import torch

from specee.early_exit.features import SpecProbe, adainfer_features, features_from_logits, initial_p
from specee.models.draft import DraftHead
from specee.phases import PhaseTimer
from specee.runtime.layerwise import LayerwiseLM


@torch.inference_mode()
def collect_prompt(rt: LayerwiseLM, draft: DraftHead, prompt_ids, max_new_tokens: int, k: int,
                   eos_id: int | None, unnormed: bool = False) -> dict[str, np.ndarray]:
    """``unnormed``: also the un-normed states' argmaxes (``label_unnormed``, the authors' label);
    it doubles the batched LM head per token, so only the recipe that reads it asks for it."""
    cache = rt.new_cache(prompt_ids.shape[1] + max_new_tokens)
    dcache = draft.new_cache(prompt_ids.shape[1] + max_new_tokens)
    f = rt.norm(rt.forward(prompt_ids, cache))
    if prompt_ids.shape[1] > 1:
        draft(prompt_ids[:, 1:], f[:, :-1], dcache)
    token, f_prev = rt.lm_head(f[:, -1:])[0, -1].argmax(), f[:, -1:]
    rows = {"feats": [], "argmax": [], "argmax_unnormed": [], "ada": [], "spec": []}
    every_layer = [True] * rt.num_layers
    timer = PhaseTimer(rt.device)
    generated = 1
    while generated < max_new_tokens and int(token) != eos_id:
        spec = draft.logits(draft(token.view(1, 1), f_prev, dcache))[0, -1].topk(k).indices
        probe = SpecProbe(rt, spec)
        p_prev = initial_p(k, spec)
        pos = rt.positions(cache, 1)
        h = rt.embed(token.view(1, 1))
        rope = rt.rope(h, pos)
        feats, normeds, raws = [], [], []

        def record(i, h):  # the decoding walk with every layer evaluated and no exit
            nonlocal p_prev
            normeds.append(rt.norm(h)[0, 0])
            raws.append(h[0, 0])
            x, p_prev = features_from_logits(probe.logits(h), p_prev)
            feats.append(x)
            return None

        rt.walk(h, rope, cache, pos, None, every_layer, record, timer)
        cache.seq_len += 1
        L = len(normeds)
        logits = rt.lm_head(torch.stack(normeds + (raws if unnormed else [])))  # (L or 2L, V), one product
        argmaxes = logits.argmax(-1)
        rows["feats"].append(torch.stack(feats).float())
        rows["argmax"].append(argmaxes[:L])
        if unnormed:
            rows["argmax_unnormed"].append(argmaxes[L:])
        rows["ada"].append(adainfer_features(logits[:L]).float())
        rows["spec"].append(spec)
        normed = normeds[-1]
        token, f_prev = argmaxes[L - 1], normed.view(1, 1, -1)
        generated += 1
    if not rows["feats"]:
        return {}
    out = {k_: torch.stack(v).cpu().numpy() for k_, v in rows.items() if v}
    final = out["argmax"][:, -1:]
    out["label"] = out["argmax"] == final  # (T, L)
    if unnormed:
        out["label_unnormed"] = out["argmax_unnormed"] == final
    out["in_spec"] = (out["argmax"][:, :, None] == out["spec"][:, None, :]).any(-1)
    return out
