"""Per-run cost model: counted work x measured unit costs.

A mode's work per emitted token is fixed by its decisions and counted exactly in the per-step
traces (layers run, LM heads, predictor calls, draft steps, host syncs); only the price of each
unit of work varies from run to run. Splitting the two explains a measured speedup (which unit
eats the ideal layer ratio L / avg_layers) and predicts it where only the unit prices change:
another machine (units measured there, or the analytic bandwidth-bound prices below) or a
deeper model (layer-proportional counts rescaled).

- :func:`count_work`: per-token work of a run's generations.
- :func:`measure_unit_costs`: unit prices at the run's context, interleaved over rounds.
- :func:`modelled_time_us`, :func:`modelled_speedup`, :func:`explain_gap`: counts x prices.
- :func:`analytic_unit_costs`, :data:`SHAPES`, :func:`predict_speedup`: other hardware / depths.
"""
from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path

import torch

# Each priced term: (count key, unit). Counts are per emitted token; every unit's price includes
# the host reads it does itself, so ``extra_syncs`` holds only the reads no unit contains.
PRICED = (
    ("layer_steps", "layer"),
    ("wasted_layers", "layer"),  # exit_control=lookahead: the layer queued behind a decision that exited
    ("tree_layer_steps", "tree_layer"),
    ("priced_lm_heads", "lm_head"),
    ("tree_lm_heads", "tree_lm_head"),
    ("priced_predictor_calls", "predictor"),
    ("delta_probes", "probe"),
    ("adainfer_probes", "adainfer_probe"),
    ("rule_probes", "rule_probe"),  # an exit rule's decision after a layer (specee/exit_rules/)
    ("draft_steps", "draft_step"),
    ("draft_trees", "draft_tree"),
    ("extra_syncs", "sync"),
    ("steps", "step_overhead"),
)

# Counts proportional to the model's depth (rescaled by predict_speedup); the rest are per step.
PER_LAYER_COUNTS = ("layer_steps", "tree_layer_steps", "predictor_calls", "priced_predictor_calls",
                    "delta_probes", "adainfer_probes", "rule_probes")


def count_work(gens, num_layers: int, mode: str, decoding: str = "autoregressive",
               draft_tree_syncs: int = 0) -> dict:
    """Per-emitted-token work of ``gens`` (a run's Generations) for ``mode`` (dense, specee,
    adainfer, eagle) and ``decoding`` (autoregressive, tree), read from the step traces.

    ``draft_tree_syncs``: host reads one ``draft_tree`` call does itself (measure_unit_costs
    reports it), so they are not priced twice as extra syncs."""
    from specee.decoding import modes
    spec = modes.spec(mode)
    L = num_layers
    tokens = sum(len(g.tokens) - 1 for g in gens)  # the first token comes from prefill
    if spec.costs.dense:
        # Dense: each step = one token, all L layers, one LM head whose argmax is read (in lm_head).
        c = {"steps": 1.0, "layer_steps": float(L), "tree_layer_steps": 0.0, "lm_heads": 1.0,
             "tree_lm_heads": 0.0, "predictor_calls": 0.0, "delta_probes": 0.0, "adainfer_probes": 0.0,
             "rule_probes": 0.0,
             "draft_steps": 0.0, "draft_trees": 0.0, "syncs": 1.0, "extra_syncs": 0.0, "nodes": 1.0,
             "avg_layers": float(L)}
        return _priced(c) | {"tokens": float(tokens)}
    trace = [t for g in gens for t in g.trace]
    tree = spec.is_tree({"decoding": decoding})
    # tokens per step: tree steps emit t["emitted"]; autoregressive steps emit one token.
    emitted = sum(t.get("emitted", 1) for t in trace)
    n = max(emitted, 1)
    no_exit = [t["exit_layer"] >= L - 1 for t in trace]
    s = lambda key: sum(t.get(key, 0) for t in trace)  # noqa: E731
    c = {
        # one step = one pass of the decoder's step(): AR one token, tree one verification.
        "steps": len(trace) / n,
        # AR: layers 0..exit run on a block of one token.
        "layer_steps": 0.0 if tree else s("layers") / n,
        # lookahead reads: layers run ahead of a decision that exited (their work bought nothing)
        "wasted_layers": s("wasted_layers") / n,
        # tree: layers 0..exit run on a block of `nodes` tokens with the tree mask.
        "tree_layer_steps": s("layers") / n if tree else 0.0,
        # full-vocab heads on one row: AR verify_calls + the final head when no exit; AdaInfer's
        # every pred_call (rt.logits per layer) + the final head when no exit.
        "lm_heads": 0.0 if tree else (s("verify_calls") + s("pred_calls") * spec.costs.lm_head_per_predictor_call
                                      + s("emit_heads") + sum(no_exit)) / n,
        # tree: the final head when no exit (over `nodes` rows) + the exit verifications, in
        # whole-tree heads: their rows over the tree's (merged SpecEE computes only fired paths'
        # rows; a head's cost is taken as proportional to its rows), else one head per verify_call.
        "tree_lm_heads": ((sum(t.get("head_rows", t.get("verify_calls", 0) * t["nodes"]) / t["nodes"]
                               for t in trace) + sum(no_exit)) / n) if tree else 0.0,
        # predictor evaluations (SpecEE: one per unit per layer; AdaInfer: one SVM per layer).
        "predictor_calls": s("pred_calls") / n,
        # reduced-head probes without a predictor (p_prev for the next predictor layer).
        "delta_probes": s("delta_probes") / n,
        # AdaInfer: each predictor call is full logits + SVM decision (priced as adainfer_probe).
        "adainfer_probes": s("pred_calls") / n if spec.costs.lm_head_per_predictor_call else 0.0,
        # an exit rule: each predictor call is one decision of the rule (with the layer's LM head
        # where the rule reads it), priced as rule_probe; a rule that does not read the head pays
        # one head where it exits (emit_heads, in lm_heads)
        "rule_probes": s("pred_calls") / n if spec.costs.rule_probe else 0.0,
        # SpecEE AR: one draft proposal (draft layer + draft head + top-K read) per step.
        # (SpecEE with prompt-lookup speculation: only the steps the draft served, draft_calls.)
        "draft_steps": sum(t.get("draft_calls", 1) for t in trace) / n if (spec.costs.draft_step_per_step and not tree)
        else 0.0,
        # tree modes: one tree draft per verification step.
        "draft_trees": len(trace) / n if tree else 0.0,
        # every host read of a device value the step did (PhaseTimer's count).
        "syncs": s("syncs") / n,
        # mean tree size (block length of the verification forward); 1 for AR.
        "nodes": (s("nodes") / len(trace)) if tree and trace else 1.0,
        # layers executed per emitted token as speed_metrics counts them (exit layer + 1 each).
        "avg_layers": sum((t["exit_layer"] + 1) * t.get("emitted", 1) for t in trace) / n,
    }
    # Host reads inside priced units: the draft's top-K read, one per predictor call, one per
    # LM head (AR verify reads its argmax; the final head's token is read at step end), one per
    # tree LM head, and the tree draft's own reads; the rest (e.g. the token re-read after an
    # exit, the tree's index uploads) are priced as extra syncs.
    inside = (c["draft_steps"] + c["predictor_calls"] + c["lm_heads"] - c["adainfer_probes"]
              + c["tree_lm_heads"] + c["draft_trees"] * draft_tree_syncs)
    c["extra_syncs"] = max(0.0, c["syncs"] - inside)
    return _priced(c) | {"tokens": float(emitted)}


def _priced(c: dict) -> dict:
    """The disjoint counts the time model prices: AdaInfer's per-layer heads and SVM calls are
    priced once, as adainfer_probe, not again as lm_head and predictor."""
    return c | {"priced_lm_heads": c["lm_heads"] - c["adainfer_probes"],
                "priced_predictor_calls": c["predictor_calls"] - c["adainfer_probes"] - c.get("rule_probes", 0.0)}


# -- measuring unit costs --------------------------------------------------------------------

def _undo_append(cache, layer: int, t: int) -> None:
    """Drop the ``t`` K/V entries a timed call appended to ``layer`` (host and device lengths)."""
    cache.undo_append(layer, t)


@torch.inference_mode()
def measure_unit_costs(rt, decoder, dense_decoder, prompt_ids: torch.Tensor, max_new_tokens: int,
                       rounds: int = 40, calls: int = 3, warmup_rounds: int = 2) -> dict:
    """Microsecond prices of each unit of work at the run's context (prompt + half the budget
    cached), measured interleaved: every round times every unit once, in a fixed order, as the
    mean of ``calls`` back-to-back calls (a layer unit cycles over all layers, so weights stream
    from memory as in decoding); any K/V a call appends is undone, so every call sees the same
    context. A round is one consistent snapshot of the machine, so per-round samples give the
    spread of a modelled speedup. Units the decoder does not use are not measured.

    Returns ``samples_us`` (unit -> per-round list), ``median_us``, and ``step_overhead_us``
    (dense_step - L * layer - lm_head: embedding, RoPE and bookkeeping outside layers and head;
    noise can make it negative)."""
    from specee.phases import Clock
    from specee.early_exit.features import SpecProbe, adainfer_features, initial_p

    L, dev = rt.num_layers, rt.device
    clock = Clock(dev)
    filler = prompt_ids[:, -1:].repeat(1, max(0, max_new_tokens // 2))
    ctx_ids = torch.cat([prompt_ids, filler], 1)
    context = ctx_ids.shape[1]
    dense_s, _ = dense_decoder.prefill(ctx_ids, max_new_tokens)
    cache = dense_s.cache
    token = dense_s.token.view(1, 1)
    h = rt.embed(token)
    pos = rt.positions(cache, 1)
    rope = rt.rope(h, pos, cache.seq_len)
    layer_order = itertools.cycle(range(L))
    units: dict = {}

    def layer():
        i = next(layer_order)
        rt.run_layer(i, h, rope, cache, None, pos)
        _undo_append(cache, i, 1)
    units["layer"] = (layer, L)

    def lm_head():
        int(rt.lm_head(rt.norm(h)[0, 0]).argmax())
    units["lm_head"] = (lm_head, calls)

    predictors = getattr(decoder, "predictors", None)
    k = getattr(decoder, "k", 4)
    spec = torch.arange(1, k + 1, device=dev)
    if predictors is not None:
        probe = SpecProbe(rt, spec)
        pred_layers = itertools.cycle([i for i in range(L) if bool(predictors.has[i])] or [0])
        p0 = initial_p(k, spec)

        def predictor():
            fire, _ = rt.predict(probe, predictors, next(pred_layers), h, p0)
            bool(fire)

        def probe_unit():
            torch.softmax(probe.logits(h), -1)
        units["predictor"] = (predictor, calls)
        units["probe"] = (probe_unit, calls)

    draft_tree_syncs = None
    if hasattr(decoder, "propose"):  # autoregressive SpecEE: one draft proposal per step
        ar_s, _ = decoder.prefill(ctx_ids, max_new_tokens)
        d_len = ar_s.dcache.seq_len

        def draft_step():
            decoder.propose(ar_s.token, ar_s.f, ar_s.dcache).tolist()
            ar_s.dcache.crop(d_len)
        units["draft_step"] = (draft_step, calls)

    nodes = 1
    if hasattr(decoder, "draft_tree"):  # tree decoders: draft + blocks of `nodes` tokens
        tree_s, _ = decoder.prefill(ctx_ids, max_new_tokens)
        d_len = tree_s.dcache.seq_len
        timer = decoder.timer()

        def draft_tree():
            decoder.draft_tree(tree_s.root, tree_s.pend_ids, tree_s.pend_feats, tree_s.dcache, timer)
            tree_s.dcache.crop(d_len)
        timer.start()
        draft_tree()
        draft_tree_syncs = timer.syncs
        units["draft_tree"] = (draft_tree, calls)

        tr = decoder.tree
        nodes = tr.size
        ids = token.repeat(1, nodes)
        h_block = rt.embed(ids)
        pos_block = (cache.seq_len + decoder.depth)[None]
        rope_block = rt.rope(h_block, pos_block, cache.seq_len + tr.max_depth)
        block_order = itertools.cycle(range(L))

        def tree_layer():
            i = next(block_order)
            rt.run_layer(i, h_block, rope_block, cache, decoder.block, pos_block)
            _undo_append(cache, i, nodes)

        def tree_lm_head():
            rt.lm_head(rt.norm(h_block)[0]).argmax(-1).tolist()
        units["tree_layer"] = (tree_layer, L)
        units["tree_lm_head"] = (tree_lm_head, calls)

    svm = getattr(decoder, "svm", None)
    if svm is not None:  # AdaInfer: full logits + SVM decision after a layer
        def adainfer_probe():
            bool(svm.decide(adainfer_features(rt.logits(h)[0, 0])))
        units["adainfer_probe"] = (adainfer_probe, calls)

    rule = getattr(decoder, "rule", None)
    if rule is not None:  # an exit rule: one decision after a layer, its LM head included where it reads one
        h_prev = rt.embed(token)

        def rule_probe():
            bool(decoder.decide(0, h_prev, h)[0])
        units["rule_probe"] = (rule_probe, calls)

    small = torch.zeros((), dtype=torch.long, device=dev)

    def sync():
        int(small)
    units["sync"] = (sync, calls)

    def dense_step():
        dense_decoder.step(dense_s)
        cache.crop(context)
    units["dense_step"] = (dense_step, calls)

    samples: dict[str, list[float]] = {u: [] for u in units}
    for r in range(warmup_rounds + rounds):
        for u, (fn, n_calls) in units.items():
            t0 = clock()
            for _ in range(n_calls):
                fn()
            dt = (clock() - t0) / n_calls
            if r >= warmup_rounds:
                samples[u].append(1e6 * dt)
    samples["step_overhead"] = [d - L * la - hd for d, la, hd in
                                zip(samples["dense_step"], samples["layer"], samples["lm_head"])]
    median = {u: statistics.median(v) for u, v in samples.items()}
    return {"samples_us": samples, "median_us": median, "step_overhead_us": median["step_overhead"],
            "rounds": rounds, "calls": calls, "context": context, "nodes": nodes,
            "draft_tree_syncs": draft_tree_syncs, "method": "measured, interleaved rounds"}


# -- modelled time and speedup ---------------------------------------------------------------

def modelled_time_us(counts: dict, unit_us: dict) -> tuple[float, dict]:
    """Modelled microseconds per emitted token: each priced count x its unit's price (every step
    also pays ``step_overhead``). Returns (total, unit -> us per token).

    A price below zero is read as zero: only ``step_overhead`` can be (it is dense_step minus the
    separately timed layers and head), and only from noise; taken as it is, a loaded machine's
    negative overhead can leave a mode that runs few layers a time of zero or less."""
    breakdown = {}
    for key, unit in PRICED:
        n = counts.get(key, 0.0)
        if n:
            if unit not in unit_us:
                raise KeyError(f"the work counts {key}={n:g} per token but no {unit!r} price is given")
            breakdown[unit] = breakdown.get(unit, 0.0) + n * max(unit_us[unit], 0.0)
    return sum(breakdown.values()), breakdown


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def modelled_speedup(mode_counts: dict, dense_counts: dict, unit_samples: dict) -> dict:
    """Dense time over mode time per token. ``value`` from the units' medians; ``band`` the
    [2.5, 97.5] percentiles of the per-round speedups (each round's prices are one snapshot)."""
    unit_samples = unit_samples.get("samples_us", unit_samples)  # a measure_unit_costs result too
    rounds = len(next(iter(unit_samples.values())))
    med = {u: statistics.median(v) for u, v in unit_samples.items()}
    t_mode, br_mode = modelled_time_us(mode_counts, med)
    t_dense, br_dense = modelled_time_us(dense_counts, med)
    per_round = []
    for r in range(rounds):
        snap = {u: v[r] for u, v in unit_samples.items()}
        t_m, t_d = modelled_time_us(mode_counts, snap)[0], modelled_time_us(dense_counts, snap)[0]
        if t_m > 0 and t_d > 0:  # a noisy round's negative step overhead can leave no time at all
            per_round.append(t_d / t_m)
    band = [_percentile(per_round, 2.5), _percentile(per_round, 97.5)] if per_round else [math.nan, math.nan]
    return {"value": t_dense / t_mode, "band": band, "per_round": per_round,
            "rounds_dropped": rounds - len(per_round), "mode_us_per_token": t_mode, "dense_us_per_token": t_dense,
            "breakdown_us": {"mode": br_mode, "dense": br_dense}}


def layer_passes(counts: dict) -> float:
    """Layer passes per emitted token, a tree block counted as one pass (avg_layers for AR)."""
    return counts.get("layer_steps", 0.0) + counts.get("tree_layer_steps", 0.0)


def explain_gap(mode_counts: dict, dense_counts: dict, unit_us: dict, num_layers: int) -> list:
    """The (up to) two costs that most separate the modelled speedup from the layer ratio
    L / layer passes: each one's extra over dense, in layer-units (one block-1 layer step) per
    token; savings (a tree's fewer heads and steps per token) are not listed. A tree block's
    extra over a block-1 layer is its own cost ("tree_block")."""
    layer = unit_us["layer"]
    _, mode_br = modelled_time_us(mode_counts, unit_us)
    _, dense_br = modelled_time_us(dense_counts, unit_us)
    extra = {u: mode_br.get(u, 0.0) - dense_br.get(u, 0.0)
             for u in set(mode_br) | set(dense_br) if u not in ("layer", "tree_layer")}
    if mode_counts.get("tree_layer_steps"):
        extra["tree_block"] = mode_counts["tree_layer_steps"] * (unit_us["tree_layer"] - layer)
    if "tree_lm_head" in extra:  # a tree's heads replace dense's: one LM-head line
        extra["lm_head"] = extra.get("lm_head", 0.0) + extra.pop("tree_lm_head")
    ranked = sorted(((u, us) for u, us in extra.items() if us > 0), key=lambda kv: -kv[1])[:2]
    ratio = num_layers / layer_passes(mode_counts)
    return [{"cost": u, "layer_units_per_token": us / layer, "us_per_token": us, "layer_ratio": ratio}
            for u, us in ranked]


# -- other hardware: analytic prices and depth rescaling --------------------------------------

# Llama-2 shapes (their config.json): the targets a measured run is projected onto.
SHAPES = {
    "llama2_7b": {"num_layers": 32, "hidden": 4096, "intermediate": 11008, "heads": 32, "kv_heads": 32,
                  "vocab": 32000},
    "llama2_13b": {"num_layers": 40, "hidden": 5120, "intermediate": 13824, "heads": 40, "kv_heads": 40,
                   "vocab": 32000},
}

# Kernels one eager call launches (HF Llama layer: two RMSNorms, q/k/v/o, RoPE, cache writes,
# SDPA, gated MLP, residuals), the floor of a call whose bytes stream faster than it launches.
KERNELS = {"layer": 30, "lm_head": 8, "predictor": 12, "probe": 6, "adainfer_probe": 14,
           "draft_extra": 6, "step_overhead": 10, "sync": 0}

PREDICTOR_HIDDEN = 512


def layer_params(shape: dict) -> int:
    """Weights of one Llama decoder layer: q, o (d x d), k, v (d x kv_dim), gate/up/down, 2 norms."""
    d, kv = shape["hidden"], shape["hidden"] // shape["heads"] * shape["kv_heads"]
    return 2 * d * d + 2 * d * kv + 3 * d * shape["intermediate"] + 2 * d


def analytic_unit_costs(shape: dict, bandwidth_gb_s: float, sync_us: float, kernel_us: float, context: int,
                        dtype_bytes: int = 2, k: int = 4, tree_levels: int = 4) -> dict:
    """Analytic unit prices (us) on a bandwidth-bound device: each unit = max(bytes it reads /
    bandwidth, its kernels x ``kernel_us``), plus ``sync_us`` for each host read it contains.
    Bytes: a layer's weights + its K/V at ``context``; the LM head vocab x hidden;
    the probe k x hidden; the predictor the probe + its float32 MLP (3k x 512 + 512, biases);
    an EAGLE draft step = fc (2d x d) + one decoder layer + the base LM head; a tree draft one
    such step per level; tree blocks read the same bytes as block 1 (bandwidth-bound)."""
    bw = bandwidth_gb_s * 1e9 / 1e6  # bytes per us
    d = shape["hidden"]
    kv_dim = d // shape["heads"] * shape["kv_heads"]
    t = lambda nbytes, kernels: max(nbytes / bw, kernels * kernel_us)  # noqa: E731
    layer_b = layer_params(shape) * dtype_bytes + 2 * kv_dim * context * dtype_bytes
    head_b = shape["vocab"] * d * dtype_bytes
    probe_b = k * d * dtype_bytes
    mlp_b = (3 * k * PREDICTOR_HIDDEN + PREDICTOR_HIDDEN + PREDICTOR_HIDDEN + 1) * 4
    draft_b = (2 * d * d + d) * dtype_bytes + layer_b + head_b
    u = {
        "layer": t(layer_b, KERNELS["layer"]),
        "lm_head": t(head_b, KERNELS["lm_head"]) + sync_us,
        "probe": t(probe_b, KERNELS["probe"]),
        "predictor": t(probe_b + mlp_b, KERNELS["predictor"]) + sync_us,
        "adainfer_probe": t(head_b, KERNELS["adainfer_probe"]) + sync_us,
        "draft_step": t(draft_b, KERNELS["layer"] + KERNELS["lm_head"] + KERNELS["draft_extra"]) + sync_us,
        "sync": sync_us,
        "step_overhead": KERNELS["step_overhead"] * kernel_us,
    }
    u["draft_tree"] = tree_levels * u["draft_step"]
    u["tree_layer"], u["tree_lm_head"] = u["layer"], u["lm_head"]
    u["dense_step"] = shape["num_layers"] * u["layer"] + u["lm_head"] + u["step_overhead"]
    bytes_ = {"layer": layer_b, "lm_head": head_b, "probe": probe_b, "predictor": probe_b + mlp_b,
              "draft_step": draft_b}
    return {"median_us": u, "bytes": bytes_, "layer_params": layer_params(shape),
            "method": f"analytic: max(bytes / {bandwidth_gb_s} GB/s, kernels x {kernel_us} us) "
                      f"+ {sync_us} us per host read; context {context}, {dtype_bytes}-byte weights"}


def _unit_table(unit_us) -> dict:
    """unit -> us from a dict, a measure/analytic result (its ``median_us``), a speed job's
    results.json or its ``cost_model`` (``units_us``: a GPU run's speed results are a GPU table),
    or a JSON file of any of these;
    ``step_overhead`` derived from ``dense_step`` when the table lacks it."""
    if isinstance(unit_us, (str, Path)):
        unit_us = json.loads(Path(unit_us).read_text())
    if "metrics" in unit_us:  # a speed job's results.json: its measured units (a GPU run's are a GPU table)
        unit_us = unit_us["metrics"]["cost_model"]
    if "units_us" in unit_us:
        unit_us = {"median_us": unit_us["units_us"]}
    table = dict(unit_us.get("median_us", unit_us))
    if "step_overhead" not in table and "dense_step" in table and "num_layers" in unit_us:
        table["step_overhead"] = table["dense_step"] - unit_us["num_layers"] * table["layer"] - table["lm_head"]
    return table


def rescale_depth(counts: dict, factor: float) -> dict:
    """Counts on a model ``factor`` times as deep: per-layer work (layer steps, predictor calls,
    probes, AdaInfer's per-layer heads) scales, per-step work (verify and final heads, draft
    steps, extra syncs, step overhead) stays as counted."""
    out = dict(counts)
    for key in PER_LAYER_COUNTS:
        if key in out:
            out[key] = out[key] * factor
    out["lm_heads"] = counts.get("priced_lm_heads", 0.0) + out.get("adainfer_probes", 0.0)
    return out


def predict_speedup(mode_counts: dict, dense_counts: dict, num_layers_measured: int, target_shape,
                    unit_us) -> float:
    """Modelled speedup of a counted run on ``target_shape`` (a SHAPES name or shape dict) with
    the target's unit prices ``unit_us`` (analytic, a GPU-measured table, or its JSON file):
    layer-proportional counts rescaled to the target's depth, per-step counts kept."""
    shape = SHAPES[target_shape] if isinstance(target_shape, str) else target_shape
    factor = shape["num_layers"] / num_layers_measured
    table = _unit_table(unit_us)
    t_mode = modelled_time_us(rescale_depth(mode_counts, factor), table)[0]
    t_dense = modelled_time_us(rescale_depth(dense_counts, factor), table)[0]
    return t_dense / t_mode


# -- GPU decoding paths: eager, graphed with host exits, graphed with device exits ----------------
# A CUDA-graph replay's launch on the host (one call, however many kernels it holds) and one
# conditional node evaluated on the device: stated floors, like KERNELS' launch price, not measured.
GRAPH_US = 8.0
COND_US = 1.5
PATHS = ("eager", "graphed_host_exits", "graphed_device_exits")


def path_time_us(counts: dict, shape: dict, path: str, bandwidth_gb_s: float, sync_us: float, kernel_us: float,
                 context: int, dtype_bytes: int = 2, k: int = 4) -> dict:
    """Modelled us per emitted token of counted work ``counts`` (already at ``shape``'s depth) on
    one decoding path, by part: the bytes each unit streams (the floor on every path) and what the
    path adds on the host side.

    - ``eager``: each unit max(bytes / bandwidth, kernels x ``kernel_us``) and ``sync_us`` per host
      read (:func:`analytic_unit_costs`).
    - ``graphed_host_exits``: each layer step, predictor call, probe, LM head and draft step is one
      CUDA-graph replay (``GRAPH_US`` each, overlapping the device work while the queue is full);
      a host read drains the queue, so it costs ``sync_us`` plus the next replay's launch, exposed.
    - ``graphed_device_exits``: one replay per step; every layer, predictor and verification is a
      conditional node (``COND_US`` each, ~3 per layer); the host reads once per step."""
    a = analytic_unit_costs(shape, bandwidth_gb_s, sync_us, kernel_us, context, dtype_bytes, k)
    bw = bandwidth_gb_s * 1e9 / 1e6
    b = a["bytes"]
    c = lambda key: counts.get(key, 0.0)  # noqa: E731
    heads = c("priced_lm_heads") + c("adainfer_probes") + c("tree_lm_heads")
    layers = c("layer_steps") + c("tree_layer_steps") + c("wasted_layers")
    stream = {"layers": layers * b["layer"] / bw, "lm_heads": heads * b["lm_head"] / bw,
              "predictors": (c("priced_predictor_calls") * b["predictor"] + c("delta_probes") * b["probe"]) / bw,
              "draft": (c("draft_steps") + 4 * c("draft_trees")) * b["draft_step"] / bw}
    steps, syncs = c("steps"), c("syncs")
    if path == "eager":
        table = a["median_us"]
        host = modelled_time_us(counts, table)[0] - sum(stream.values())
        return {**stream, "host": max(host, 0.0), "total": sum(stream.values()) + max(host, 0.0)}
    if path == "graphed_host_exits":
        replays = (layers + c("priced_predictor_calls") + c("delta_probes") + heads + c("draft_steps")
                   + c("draft_trees") + steps)
        hidden = sum(stream.values())  # launches overlap device work while the queue is full...
        launch = max(replays * GRAPH_US - hidden, 0.0)
        exposed = syncs * (sync_us + GRAPH_US)  # ...but a host read empties it
        return {**stream, "host": launch + exposed, "total": hidden + launch + exposed}
    if path == "graphed_device_exits":
        conds = steps * 3 * shape["num_layers"]  # each layer: run or skip, predict or not, verify or not
        host = steps * (GRAPH_US + sync_us) + conds * COND_US
        return {**stream, "host": host, "total": sum(stream.values()) + host}
    raise ValueError(f"unknown path {path!r}; valid: {', '.join(PATHS)}")


def predict_paths(mode_counts: dict, dense_counts: dict, num_layers_measured: int, target_shape, gpu: dict,
                  context: int, device_exits: bool = True) -> dict:
    """Per path, modelled us/token of the mode and of dense on ``target_shape`` priced for ``gpu``
    (name, bandwidth_gb_s, kernel_us, sync_us), the mode's speedup over dense on the same path and
    over the strongest dense path. Dense never branches, so its graphed paths are one price.
    ``device_exits``: whether the mode can take the device-exit path (autoregressive SpecEE)."""
    shape = SHAPES[target_shape] if isinstance(target_shape, str) else target_shape
    factor = shape["num_layers"] / num_layers_measured
    mode, dense = rescale_depth(mode_counts, factor), rescale_depth(dense_counts, factor)
    kw = dict(bandwidth_gb_s=gpu["bandwidth_gb_s"], sync_us=gpu["sync_us"], kernel_us=gpu["kernel_us"],
              context=context)
    dense_us = {"eager": path_time_us(dense, shape, "eager", **kw)["total"],
                "graphed": path_time_us(dense, shape, "graphed_host_exits", **kw)["total"]}
    strongest = min(dense_us.values())
    out = {"dense_us_per_token": dense_us, "strongest_dense": min(dense_us, key=dense_us.get), "paths": {}}
    for path in PATHS:
        if path == "graphed_device_exits" and not device_exits:
            continue
        t = path_time_us(mode, shape, path, **kw)
        same = dense_us["eager" if path == "eager" else "graphed"]
        out["paths"][path] = {"us_per_token": t, "speedup_vs_dense_same_path": same / t["total"],
                              "speedup_vs_strongest_dense": strongest / t["total"]}
    return out
