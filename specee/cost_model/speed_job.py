"""A speed job's cost model: the work counted in its traces priced with unit costs measured here,
interleaved, after the clock — the modelled speedup beside the measured one — and the same counts
priced for Llama-2-7B/13B on an analytic GPU."""
from __future__ import annotations

from specee.cost_model import priced_work as cm
from specee.cost_model.block_costs import measure_block_costs
from specee.decoding import modes


# Prices for the GPU prediction when no GPU-measured table is given: a bandwidth-bound A100-80GB
# (spec HBM bandwidth), with a stated floor per kernel launch and per host sync. Analytic.
GPU_ANALYTIC = {"name": "analytic A100-80GB", "bandwidth_gb_s": 2039.0, "kernel_us": 4.0, "sync_us": 10.0}


def cost_model(cfg, rt, decoder, dense, inputs, mode_gens, dense_gens, measured: float, ci: list) -> dict:
    """Counted work x unit costs measured here, interleaved, after the clock (one prompt of
    typical length): the modelled speedup beside the measured one, the two costs that explain
    the gap to the layer ratio, and the same counts priced for Llama-2-7B/13B on a GPU."""
    lengths = [ids.shape[1] for ids in inputs]
    mean = sum(lengths) / len(lengths)
    ids = inputs[min(range(len(inputs)), key=lambda i: abs(lengths[i] - mean))]
    if modes.of(cfg.ablation).costs.block_cost:
        return block_cost_model(rt, ids, mode_gens, cfg.experiment.cost_rounds, measured, ci)
    units = cm.measure_unit_costs(rt, decoder, dense, ids, cfg.dataset.max_new_tokens, rounds=cfg.experiment.cost_rounds)
    L, mode, decoding = rt.num_layers, cfg.ablation.mode, cfg.ablation.decoding
    mode_counts = cm.count_work(mode_gens, L, mode, decoding, units.get("draft_tree_syncs") or 0)
    dense_counts = cm.count_work(dense_gens, L, modes.reference().name)
    model = cm.modelled_speedup(mode_counts, dense_counts, units)
    context = units["context"]
    predicted = {}
    for target in ("llama2_7b", "llama2_13b"):
        g = GPU_ANALYTIC
        table = cm.analytic_unit_costs(cm.SHAPES[target], g["bandwidth_gb_s"], g["sync_us"], g["kernel_us"], context)
        predicted[target] = cm.predict_speedup(mode_counts, dense_counts, L, target, table)
    spec = modes.of(cfg.ablation)
    paths = {target: cm.predict_paths(mode_counts, dense_counts, L, target, GPU_ANALYTIC, context,
                                      device_exits=spec.needs_bank and not spec.is_tree(cfg.ablation))
             for target in ("llama2_7b", "llama2_13b")}
    lo, hi = model["band"]
    return {"modelled_speedup_vs_dense": model["value"], "modelled_band": model["band"],
            "measured_in_model_band": bool(lo <= measured <= hi),
            "model_in_measured_ci": bool(ci[0] <= model["value"] <= ci[1]),
            "unmodelled_share": 1 - measured / model["value"],  # > 0: time no counted unit explains
            "units_us": units["median_us"], "unit_rounds": len(next(iter(units["samples_us"].values()))),
            "context": context, "counts": mode_counts, "dense_counts": dense_counts,
            "breakdown_us_per_token": model["breakdown_us"], "gap_to_layer_ratio": cm.explain_gap(
                mode_counts, dense_counts, units["median_us"], L),
            "predicted_gpu": {"method": g["name"] + ": " + table["method"], "speedup_vs_dense": predicted},
            # the same counts on each GPU decoding path (eager; graphed with host exits; graphed with
            # exits decided on the device), each against dense on the same path and the strongest dense
            "predicted_gpu_paths": {"method": f"{g['name']}: bytes / bandwidth per unit, plus per path: eager "
                                              f"{g['kernel_us']} us per kernel launch; graphed "
                                              f"{cm.GRAPH_US} us per CUDA-graph replay; device exits "
                                              f"{cm.COND_US} us per conditional node; {g['sync_us']} us per host read",
                                    "by_model": paths}}


def block_cost_model(rt, ids, mode_gens, rounds: int, measured: float, ci: list) -> dict:
    """Prompt lookup's modelled speedup: each step is one verification block of n tokens (the last
    token + its proposal), so its time is c(n) from the shared block-cost table measured here, and
    dense is c(1) per token (the proposal's n-gram lookup on the host is not priced: measured apart
    in the step trace as t_draft)."""
    blocks = [t["nodes"] for g in mode_gens for t in g.trace]
    emitted = sum(t.get("emitted", 1) for g in mode_gens for t in g.trace)
    table = measure_block_costs(rt, ids, sorted(set(blocks) | {1}), rounds=max(rounds, 3))
    per_round = []
    for r in range(table["rounds"]):
        c = {int(n): v[r] for n, v in table["samples_us"].items()}
        per_round.append(c[1] * emitted / sum(c[n] for n in blocks))
    med = {int(n): v for n, v in table["median_us"].items()}
    value = med[1] * emitted / sum(med[n] for n in blocks)
    lo, hi = sorted(per_round)[max(0, int(0.025 * len(per_round)))], sorted(per_round)[int(0.975 * (len(per_round) - 1))]
    return {"modelled_speedup_vs_dense": value, "modelled_band": [lo, hi],
            "measured_in_model_band": bool(lo <= measured <= hi),
            "model_in_measured_ci": bool(ci[0] <= value <= ci[1]), "unmodelled_share": 1 - measured / value,
            "method": "sum over steps of c(block) against c(1) per token, block-cost table measured here",
            "block_costs": table, "counts": {"steps_per_token": len(blocks) / max(emitted, 1),
                                             "mean_block": sum(blocks) / max(len(blocks), 1)}}
