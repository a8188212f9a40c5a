"""Measured cost structure of a model: one decoder layer step, the full LM head, a draft step.

SpecEE's overheads are priced in layers: every exit verification is one full LM-head pass, every
draft step about a layer plus an LM head. This benchmark times the three pieces for one decode
token at a given context length, interleaved (layer, head, draft, layer, ...) and repeated, and
prints the ratios with their spread — the time-based counterpart of the parameter ratio in the
model card.

    python -m specee.bench.cost_structure --model specee/artifacts/tiny --draft specee/artifacts/tiny_draft --threads 2

``--profile`` instead breaks one decoder-layer step down by operator (torch.profiler, self time
per step): how many ops a layer dispatches and what each costs — where the time goes when it is
far above the bandwidth floor (:mod:`specee.bench.bandwidth`). ``--runtime compiled`` measures
the compiled layer step (:mod:`specee.runtime.compiled`) instead of the model's eager layers.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch

from specee.io import project_path


def _decode_step(model_path: str, context: int, dtype: str, runtime: str = "eager"):
    """A runtime with ``context`` tokens cached and a token about to be decoded, and ``layer()``:
    one decode step of the next layer each call (as decoding does: a model larger than the CPU's
    caches streams its weights from memory; the same layer over and over stays cached and reads
    ~2.5x faster on tiny), its K/V append undone so every call sees the same context."""
    from transformers import AutoModelForCausalLM

    from specee.runtime.compiled import CompiledLM
    from specee.runtime.layerwise import LayerwiseLM
    model = AutoModelForCausalLM.from_pretrained(project_path(model_path), dtype=getattr(torch, dtype),
                                                 use_kernels=False).eval()
    rt = CompiledLM(model) if runtime == "compiled" else LayerwiseLM(model)
    ids = torch.randint(1, rt.config.vocab_size, (1, context), device=rt.device)
    cache = rt.new_cache(context + 4)
    rt.forward(ids, cache)
    h = rt.embed(ids[:, -1:])
    pos = torch.tensor([[context]], device=rt.device)
    rope = rt.rope(h, pos, last=context)
    order = itertools.cycle(range(rt.num_layers))

    def layer():
        i = next(order)
        rt.run_layer(i, h, rope, cache, None, pos)
        cache.lengths[i] -= 1
        if runtime == "compiled":
            cache.length_ts[i].sub_(1)  # a device op, inside the timing (about a microsecond on a CPU)
    return rt, ids, h, layer


@torch.inference_mode()
def measure(model_path: str, draft_path: str | None, context: int = 256, repeats: int = 400,
            dtype: str = "float32", runtime: str = "eager") -> dict:
    from specee.models.draft import load_draft
    rt, ids, h, layer = _decode_step(model_path, context, dtype, runtime)
    draft = load_draft(project_path(draft_path), rt)[0] if draft_path else None
    dcache = draft.new_cache(context + 4) if draft else None
    if draft:
        draft(ids[:, 1:], torch.randn(1, context - 1, rt.config.hidden_size, dtype=rt.dtype, device=rt.device), dcache)

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
    out = {"model": str(model_path), "runtime": runtime, "num_layers": rt.num_layers, "context": context, "repeats": repeats,
           "threads": torch.get_num_threads(), "dtype": dtype,
           "median_us": {k: round(v * 1e6, 1) for k, v in med.items()},
           "iqr_us": {k: [round(a * 1e6, 1), round(c * 1e6, 1)] for k, (a, _, c) in q.items()},
           "lm_head_over_layer": med["lm_head"] / med["layer"]}
    if draft:
        out["draft_over_layer"] = med["draft_step"] / med["layer"]
    layer_params = sum(p.numel() for p in rt.layers[0].parameters())
    out["lm_head_over_layer_params"] = rt.lm_head.weight.numel() / layer_params
    return out


@torch.inference_mode()
def op_profile(model_path: str, context: int = 256, steps: int = 100, dtype: str = "float32", top: int = 15,
               runtime: str = "eager") -> dict:
    """Per-operator self time of one decoder-layer decode step, averaged over ``steps``."""
    from torch.profiler import ProfilerActivity, profile

    from specee.bench.bandwidth import bytes_per_token, copy_bandwidth
    rt, _, _, layer = _decode_step(model_path, context, dtype, runtime)
    for _ in range(20):
        layer()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        layer()
        walls.append(time.perf_counter() - t0)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            layer()
    rows = [{"op": e.key, "calls_per_step": e.count / steps, "self_us_per_step": e.self_cpu_time_total / steps}
            for e in prof.key_averages() if e.self_cpu_time_total > 0]
    rows.sort(key=lambda r: -r["self_us_per_step"])
    total = sum(r["self_us_per_step"] for r in rows)
    calls = sum(r["calls_per_step"] for r in rows)
    layer_bytes = (bytes_per_token(rt, context)["total"] - rt.lm_head.weight.numel() * rt.lm_head.weight.element_size()) \
        / rt.num_layers
    bw = copy_bandwidth(rt.device)
    return {"model": str(model_path), "runtime": runtime, "context": context, "steps": steps,
            "threads": torch.get_num_threads(),
            "wall_us_per_layer_step": 1e6 * statistics.median(walls),
            # wall minus the operators' self time: Python and module dispatch outside aten ops
            "outside_ops_us_per_layer_step": 1e6 * statistics.median(walls) - total,
            "profiled_us_per_layer_step": total, "op_calls_per_layer_step": calls,
            "mean_us_per_op_call": total / calls if calls else None,
            "layer_bandwidth_floor_us": 1e6 * layer_bytes / bw, "copy_gb_per_s": bw / 1e9,
            "top_ops": [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()} for r in rows[:top]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="specee/artifacts/tiny")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=400)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profile", action="store_true", help="per-operator breakdown of one layer step")
    ap.add_argument("--runtime", choices=("eager", "compiled"), default="eager")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        print(json.dumps(op_profile(args.model, args.context, runtime=args.runtime), indent=1))
        return
    print(json.dumps(measure(args.model, args.draft, args.context, args.repeats, runtime=args.runtime), indent=1))


if __name__ == "__main__":
    main()
