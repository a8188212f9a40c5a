"""Measured cost structure of a model: one decoder layer step, the full LM head, a draft step.

SpecEE's overheads are priced in layers: every exit verification is one full LM-head pass, every
draft step about a layer plus an LM head. This benchmark times the three pieces for one decode
token at a given context length, interleaved (layer, head, draft, layer, ...) and repeated, and
prints the ratios with their spread — the time-based counterpart of the parameter ratio in the
model card.

    python -m specee.bench.cost --model specee/artifacts/tiny --draft specee/artifacts/tiny_draft --threads 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specee.io import project_path


@torch.inference_mode()
def measure(model_path: str, draft_path: str | None, context: int = 256, repeats: int = 400,
            dtype: str = "float32") -> dict:
    from transformers import AutoModelForCausalLM

    from specee.models.draft import load_draft
    from specee.runtime import LayerwiseLM
    model = AutoModelForCausalLM.from_pretrained(project_path(model_path), dtype=getattr(torch, dtype)).eval()
    rt = LayerwiseLM(model)
    draft = load_draft(project_path(draft_path), rt)[0] if draft_path else None
    ids = torch.randint(1, rt.config.vocab_size, (1, context))
    cache = rt.new_cache(context + 4)
    rt.forward(ids, cache)
    h = rt.embed(ids[:, -1:])
    pos = torch.tensor([[context]])
    rope = rt.rope(h, pos)
    mid = rt.num_layers // 2
    dcache = draft.new_cache(context + 4) if draft else None
    if draft:
        draft(ids[:, 1:], torch.randn(1, context - 1, rt.config.hidden_size, dtype=rt.dtype), dcache)

    def layer():
        rt.run_layer(mid, h, rope, cache, None, pos)
        cache.lengths[mid] -= 1  # undo the append: every repeat sees the same context

    def head():
        int(rt.lm_head(rt.norm(h))[0, -1].argmax())

    def draft_step():
        f = draft(ids[:, -1:], h, dcache)
        draft.logits(f)[0, -1].topk(4).indices.tolist()
        dcache.crop(context - 1)

    pieces = {"layer": layer, "lm_head": head, **({"draft_step": draft_step} if draft else {})}
    times = {k: [] for k in pieces}
    for _ in range(20):  # warm-up
        for fn in pieces.values():
            fn()
    for _ in range(repeats):
        for k, fn in pieces.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    q = {k: statistics.quantiles(v, n=4) for k, v in times.items()}
    out = {"model": str(model_path), "num_layers": rt.num_layers, "context": context, "repeats": repeats,
           "threads": torch.get_num_threads(), "dtype": dtype,
           "median_us": {k: round(v * 1e6, 1) for k, v in med.items()},
           "iqr_us": {k: [round(a * 1e6, 1), round(c * 1e6, 1)] for k, (a, _, c) in q.items()},
           "lm_head_over_layer": med["lm_head"] / med["layer"]}
    if draft:
        out["draft_over_layer"] = med["draft_step"] / med["layer"]
    layer_params = sum(p.numel() for p in rt.layers[0].parameters())
    out["lm_head_over_layer_params"] = rt.lm_head.weight.numel() / layer_params
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="specee/artifacts/tiny")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=400)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(measure(args.model, args.draft, args.context, args.repeats), indent=1))


if __name__ == "__main__":
    main()
