"""Recipe: decode a prompt set with the configured mode, beside dense and HF generate, one run.

    python run.py experiment=speed ablation=dense model=tiny dataset.count=2 dataset.max_new_tokens=64
"""
from __future__ import annotations

import time

import torch
from tqdm import tqdm

from specee import results
from specee.bench.power import EnergyMeter
from specee.bench.speed import (hf_generate, match_rate, noisy_reasons, paired_speedup_ci, peer_metrics,
                                speculation_sources, speed_metrics, time_sides)
from specee.env import machine_load
from specee.data import load_prompt_set
from specee.decoding import build_decoder, build_peer
from specee.decoding.hf_peer import HFGenerateDecoder
from specee.decoding.hf_peer import not_applicable as hf_not_applicable
from specee.decoding.base import generate_lockstep
from specee.decoding.dense import DenseDecoder
from specee.early_exit.replay import prompt_sha
from specee.errors import SpeceeError
from specee.io import project_path
from specee.models.loader import load_model, load_tokenizer
from specee.prompts import PromptEncoder, format_conversation
from specee.compiled import build_runtime, graph_stats
from specee.runtime import LayerwiseLM

WARMUP_TOKENS = 8  # tokens per untimed warm-up generation (the cache is still sized for the timed run)


def warm_up(decoders, prompt_ids, max_new_tokens: int, eos, hf=None, tokens: int = WARMUP_TOKENS) -> None:
    """Untimed generations of every decoder on each prompt, at the timed capacity: decoders size
    their caches from ``max_new_tokens`` (and a compiled runtime with cache_bucket compiles one
    graph per capacity), so the warm-up asks for the timed budget and stops after ``tokens``.
    ``hf(ids)``: HF generate's own warm-up, before its first timed call."""
    def stop(toks):
        return len(toks) >= tokens
    for ids in prompt_ids:
        for dec in decoders:
            if dec is not None:
                dec.generate(ids, max_new_tokens, eos, stop)
        if hf is not None:
            hf(ids)


def warm_key(rt, prompt_tokens: int):
    """What decides the compiled graphs a request needs beyond its block lengths: the prompt
    length under cache_bucket (capacity buckets), nothing otherwise."""
    return prompt_tokens if rt.kind == "compiled" and getattr(rt, "cache_bucket", 0) else None


def energy_pass(sides: dict, meters: dict, prompt_ids, max_new_tokens: int, eos, rounds: int = 1) -> dict:
    """Energy per side in long windows: one window per side over all prompts (NVML's counter
    advances about every 100 ms, so a window per generation would be quantised), sides in
    alternating order over rounds. Untimed: throughput comes from the interleaved pass. Returns
    the tokens each side generated inside its windows."""
    names = [k for k, dec in sides.items() if dec is not None and meters[k].available]
    tokens = {k: 0 for k in names}
    for r in range(rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            with meters[k].region():
                for ids in prompt_ids:
                    tokens[k] += len(sides[k].generate(ids, max_new_tokens, eos).tokens)
    return tokens


def load_prompts(cfg) -> list[dict]:
    """Prompts with their user turns (up to dataset.turns); ``text`` is the formatted first turn."""
    prompts = load_prompt_set(project_path(cfg.paths.data_root), cfg.dataset)
    tokenizer = load_tokenizer(cfg.model)  # the checkpoint's own chat template, when it has one
    return [{"id": p.id, "category": p.category, "turns": p.turns[: max(1, cfg.dataset.turns)],
             "text": format_conversation(cfg.model.chat_template, [(p.turns[0], None)], tokenizer)}
            for p in prompts]


def generation_eos(cfg, tokenizer):
    """A random-weight model has no meaningful end of sequence: it generates the full budget."""
    return None if cfg.model.init == "random" else tokenizer.eos_token_id


def early_exit_metrics(gens, m: dict, split_gens=None, split_method: str | None = None) -> dict:
    """Where the early-exit modes spend their time, from the per-step traces. Counters come from
    the timed pass ``gens``; the phase split from ``split_gens`` (default: the same pass — right on
    a CPU; on CUDA a separate synchronized profiling pass)."""
    trace = [t for g in gens for t in g.trace]
    if not trace:
        return {}
    split_gens = split_gens if split_gens is not None else gens
    split = [t for g in split_gens for t in g.trace]
    split_decode_s = sum(g.decode_s for g in split_gens)
    phase = {k: sum(t.get(key, 0.0) for t in split) for k, key in (
        ("layers", "t_layers"), ("predictors", "t_pred"), ("verification", "t_verify"),
        ("draft", "t_draft"), ("other", "t_other"))}
    n = len(trace)
    # Tree modes trace one entry per verification step, which may emit several tokens.
    tokens = sum(t.get("emitted", 1) for t in trace)
    per_step = {}
    if any("emitted" in t for t in trace):
        per_step = {"verification_steps": n,
                    "predictor_calls_per_step": sum(t["pred_calls"] for t in trace) / n}
    measured = sum(phase.values()) > 0
    targets = [t["replay_target"] + 1 for t in trace if "replay_target" in t]
    verifies = sum(t["verify_calls"] for t in trace)
    if targets:  # what the replay asked for, beside what the schedule delivered (avg_layers)
        per_step["replay_target_avg_layers"] = sum(targets) / len(targets)
    return {
        **per_step,
        "predictor_calls_per_token": sum(t["pred_calls"] for t in trace) / tokens,
        "verify_calls_per_token": sum(t["verify_calls"] for t in trace) / tokens,
        "syncs_per_token": sum(t.get("syncs", 0) for t in trace) / tokens,
        "exit_rate": sum(t["exit_layer"] < m["num_layers"] - 1 for t in trace) / n,
        # Of the steps where a predictor fired and the LM head verified, the share that exited
        # (replay forces its exits, so this is about real predictor decisions only).
        "fire_precision": (sum(t["exit_layer"] < m["num_layers"] - 1 for t in trace) / verifies)
        if verifies and not targets else None,
        "overhead_share": (phase["predictors"] + phase["verification"]) / split_decode_s if measured else None,
        "draft_share": phase["draft"] / split_decode_s if measured else None,
        "time_split_s": {**phase, "decode_total": split_decode_s},
        "time_split_method": split_method,
        # Phases are contiguous laps of each step, so they should account for (nearly) all of it.
        "time_split_coverage": sum(phase.values()) / split_decode_s if measured else None,
        "efficiency": m["speedup_vs_dense"] / (m["num_layers"] / m["avg_layers"]),
    }


def oracle_gap(rt, inputs, gens, n: int, verified: bool = True) -> dict:
    """Exits against the oracle on the mode's own tokens (the first ``n`` generations: one
    repeat), untimed, with an eager runtime over the same weights; plus the fires the LM-head
    verification refuted (each cost a full LM head and bought nothing)."""
    from specee.bench.oracle import exit_gap, own_oracle
    used, oracle, wrong = [], [], 0
    for ids, g in zip(inputs[:n], gens[:n]):
        first, differs = own_oracle(rt, ids, g.tokens)
        used += g.exit_layers[1:len(first) + 1]
        oracle += first
        wrong += sum(differs)
    gap = exit_gap(used, oracle, rt.num_layers)
    if not gap:
        return {}
    trace = [t for g in gens for t in g.trace]
    tokens = sum(t.get("emitted", 1) for t in trace)
    exits = sum(t["exit_layer"] < rt.num_layers - 1 for t in trace)
    replayed = any("replay_target" in t for t in trace)  # replay forces exits: no real decisions
    refuted = sum(t["verify_calls"] for t in trace) - exits if verified and not replayed else None
    return {"oracle_gap": gap, "avg_layers_over_oracle": gap["avg_layers_over_oracle"],
            "oracle_avg_layers": gap["oracle_avg_layers"],
            "tokens_not_full_stack_prediction": wrong / max(1, len(used)),
            "refuted_fires_per_token": refuted / tokens if refuted is not None and tokens else None}


# Prices for the GPU prediction when no GPU-measured table is given: a bandwidth-bound A100-80GB
# (spec HBM bandwidth), with a stated floor per kernel launch and per host sync. Analytic.
GPU_ANALYTIC = {"name": "analytic A100-80GB", "bandwidth_gb_s": 2039.0, "kernel_us": 4.0, "sync_us": 10.0}


def cost_model(cfg, rt, decoder, dense, inputs, mode_gens, dense_gens, measured: float, ci: list) -> dict:
    """Counted work x unit costs measured here, interleaved, after the clock (one prompt of
    typical length): the modelled speedup beside the measured one, the two costs that explain
    the gap to the layer ratio, and the same counts priced for Llama-2-7B/13B on a GPU."""
    from specee.bench import cost_model as cm
    lengths = [ids.shape[1] for ids in inputs]
    mean = sum(lengths) / len(lengths)
    ids = inputs[min(range(len(inputs)), key=lambda i: abs(lengths[i] - mean))]
    if cfg.ablation.mode == "pld":
        return block_cost_model(rt, ids, mode_gens, cfg.experiment.cost_rounds, measured, ci)
    units = cm.measure_unit_costs(rt, decoder, dense, ids, cfg.dataset.max_new_tokens, rounds=cfg.experiment.cost_rounds)
    L, mode, decoding = rt.num_layers, cfg.ablation.mode, cfg.ablation.decoding
    mode_counts = cm.count_work(mode_gens, L, mode, decoding, units.get("draft_tree_syncs") or 0)
    dense_counts = cm.count_work(dense_gens, L, "dense")
    model = cm.modelled_speedup(mode_counts, dense_counts, units)
    context = units["context"]
    predicted = {}
    for target in ("llama2_7b", "llama2_13b"):
        g = GPU_ANALYTIC
        table = cm.analytic_unit_costs(cm.SHAPES[target], g["bandwidth_gb_s"], g["sync_us"], g["kernel_us"], context)
        predicted[target] = cm.predict_speedup(mode_counts, dense_counts, L, target, table)
    lo, hi = model["band"]
    return {"modelled_speedup_vs_dense": model["value"], "modelled_band": model["band"],
            "measured_in_model_band": bool(lo <= measured <= hi),
            "model_in_measured_ci": bool(ci[0] <= model["value"] <= ci[1]),
            "unmodelled_share": 1 - measured / model["value"],  # > 0: time no counted unit explains
            "units_us": units["median_us"], "unit_rounds": len(next(iter(units["samples_us"].values()))),
            "context": context, "counts": mode_counts, "dense_counts": dense_counts,
            "breakdown_us_per_token": model["breakdown_us"], "gap_to_layer_ratio": cm.explain_gap(
                mode_counts, dense_counts, units["median_us"], L),
            "predicted_gpu": {"method": g["name"] + ": " + table["method"], "speedup_vs_dense": predicted}}


def block_cost_model(rt, ids, mode_gens, rounds: int, measured: float, ci: list) -> dict:
    """Prompt lookup's modelled speedup: each step is one verification block of n tokens (the last
    token + its proposal), so its time is c(n) from the shared block-cost table measured here, and
    dense is c(1) per token (the proposal's n-gram lookup on the host is not priced: measured apart
    in the step trace as t_draft)."""
    from specee.bench.block_cost import measure_block_costs
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


def build_peer_side(cfg, rt, decoder, eos):
    """The transformers peer timed beside the mode: for pld, transformers' prompt lookup at the
    same proposal length and n-gram size; for an hf_ mode, plain generate (its own baseline)."""
    if cfg.ablation.mode == "pld":
        return build_peer(cfg, rt, "hf_pld", eos, num_tokens=decoder.num_tokens)
    if isinstance(decoder, HFGenerateDecoder):
        return build_peer(cfg, rt, "hf_plain", eos)
    return None


def record_not_applicable(cfg, out, decoder, why: str, prompts: int) -> dict:
    """A peer transformers cannot run on this model: a result that says so, in one line."""
    print(f"{cfg.ablation.name}: not applicable: {why}")
    m = {"not_applicable": why, "prompts": prompts, **{"transformers_peer": decoder.describe()}}
    path = results.save(out, cfg, m, {"prompts": [], "chat_template": cfg.model.chat_template,
                                      "device": str(decoder.rt.device)})
    print(f"wrote {path}")
    return m


def machine_fingerprint(m: dict, d: dict) -> dict:
    """What a speed ratio here depends on, so two runs on different machines can be compared honestly:
    the processor, its caches and vector units, the threads, dense's own ms/token and the LM head's
    time over a layer's (the cost model's units, when it ran). The speedup's interval covers this
    machine's noise over prompts, not the spread between machines."""
    from specee.env import environment
    env = environment()
    units = (m.get("cost_model") or {}).get("units_us") or {}
    return {"cpu": env["cpu"], "cpu_caches": env["cpu_caches"], "cpu_vector_flags": env["cpu_vector_flags"],
            "threads": env["torch_threads"], "gpus": [g.get("name") for g in env["gpus"]],
            "dense_ms_per_token": d["ms_per_token"],
            "lm_head_over_layer_time": units["lm_head"] / units["layer"] if units.get("layer") else None,
            "interval_covers": "this machine's noise over prompts (paired, interleaved); not the spread between machines"}


def check_disjoint_from_calibration(cfg, prompts: list[dict]) -> None:
    """Evaluation prompts must not be ones the predictors were trained on."""
    if cfg.ablation.mode != "specee":
        return
    import json
    card = project_path(cfg.early_exit.predictors_path) / "predictors_card.json"
    if not card.is_file():
        return  # build_decoder reports the missing predictors
    calib = set(json.loads(card.read_text()).get("calibration_prompt_ids", []))
    overlap = sorted({p["id"] for p in prompts} & calib)
    if overlap:
        raise SpeceeError(f"evaluation prompts {overlap[:5]} were used to train the predictors; "
                          "choose dataset.offset/count below the calibration offset")


def run(cfg) -> dict:
    out = results.output_dir()
    if not cfg.force and (done := results.finished(out)):
        print(f"results exist, skipping (force=true reruns): {out / results.RESULTS}")
        return done["metrics"]
    prompts = load_prompts(cfg)  # a bad prompt file fails before the model loads
    check_disjoint_from_calibration(cfg, prompts)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    rt = build_runtime(cfg.runtime, model)
    decoder = build_decoder(cfg, rt, eos_id=generation_eos(cfg, tokenizer))
    dense = DenseDecoder(rt)
    # A transformers peer timed in the same job: pld beside transformers' prompt lookup at the same
    # settings (tokens, accepted per step and speed compared); an hf_ peer beside plain generate.
    peer = build_peer_side(cfg, rt, decoder, generation_eos(cfg, tokenizer))
    # On the compiled runtime, eager dense runs beside it (same weights): the runtime's own gain.
    eager_dense = DenseDecoder(LayerwiseLM(model)) if rt.kind == "compiled" else None
    eos = generation_eos(cfg, tokenizer)
    n_new = cfg.dataset.max_new_tokens
    template = cfg.model.chat_template
    encode = PromptEncoder.for_runtime(tokenizer, rt, n_new)
    for p in prompts:  # cut over-long prompts now, and say so once
        encode(p["text"], p["id"])
    if encode.note():
        print(f"note: {encode.note()}")

    # Warm caches, allocator and kernels (and HF generate, timed beside them). A compiled runtime
    # also warms on one prompt of every KV capacity bucket (cache_bucket; with symbolic lengths one
    # key covers all), so its graphs are compiled before the clock starts; compile time is
    # reported apart, and a graph compiled while timed marks the result noisy.
    stats0, t_warm = graph_stats(rt), time.perf_counter()
    warm = list(prompts[: cfg.experiment.warmup])
    if rt.kind == "compiled":
        keys = {warm_key(rt, encode(p["text"], p["id"]).shape[1]) for p in warm}
        for p in prompts[cfg.experiment.warmup:]:
            if (key := warm_key(rt, encode(p["text"], p["id"]).shape[1])) not in keys:
                keys.add(key)
                warm.append(p)
    hf_warm = (lambda ids: hf_generate(model, ids, min(WARMUP_TOKENS, n_new), eos)) \
        if cfg.experiment.compare_hf_generate else None
    # Where transformers cannot run a peer on this model: one line in the result, and the sweep goes on.
    first_ids = encode(prompts[0]["text"], prompts[0]["id"])  # warm is empty with experiment.warmup=0
    if isinstance(decoder, HFGenerateDecoder) and (why := hf_not_applicable(decoder, first_ids, eos)):
        return record_not_applicable(cfg, out, decoder, why, len(prompts))
    if peer is not None and (why := hf_not_applicable(peer, first_ids, eos)):
        print(f"note: {why}; timed without it")
        peer = None
    warm_up((dense, decoder, eager_dense, peer), [encode(p["text"], p["id"]) for p in warm], n_new, eos, hf_warm)
    warmed = {warm_key(rt, encode(p["text"], p["id"]).shape[1]) for p in warm}
    stats1 = graph_stats(rt)
    runtime_info = {"kind": rt.kind, "fallback": rt.fallback, "warmup_s": time.perf_counter() - t_warm,
                    "compile_s": getattr(rt, "compile_seconds", 0.0),
                    "graphs_compiled_in_warmup": stats1["graphs_compiled"] - stats0["graphs_compiled"],
                    "cudagraphs": bool(getattr(rt, "cudagraphs", False)),
                    "cudagraph_skips_in_warmup": stats1["cudagraph_skips"] - stats0["cudagraph_skips"],
                    "cudagraph_captures_in_warmup": (None if stats1["cudagraph_captures"] is None else
                                                     stats1["cudagraph_captures"] - (stats0["cudagraph_captures"] or 0))}
    in_loop_warm = {"graphs_compiled": 0, "cudagraph_skips": 0, "cudagraph_captures": 0, "compiled_calls": 0}

    meters = {"mode": EnergyMeter.for_device(rt.device), "dense": EnergyMeter.for_device(rt.device),
              "eager_dense": EnergyMeter.for_device(rt.device)}
    dense_gens, mode_gens, eager_gens, hf_s, hf_tokens_total, hf_match = [], [], [], 0.0, 0, []
    peer_gens, peer_rows = [], []
    mode_inputs = []
    per_prompt = []
    load_before = machine_load(device=rt.device)
    if load_before["busy"]:
        print(f"warning: the machine is busy (other processes' CPU share {load_before['other_cpu_share']}); "
              "timings will be noise and the result will be marked noisy")
    slot = 0
    for _ in range(cfg.experiment.repeats):
        for p in tqdm(prompts, desc=f"speed {cfg.ablation.name}"):
            # Multi-turn prompts run as a conversation: turn k sees the dense model's earlier
            # answers, so every mode is timed on the same token sequences.
            history = []
            for turn, user in enumerate(p["turns"]):
                ids = encode(format_conversation(template, history + [(user, None)], tokenizer),
                             p["id"] if turn == 0 else f"{p['id']}/turn{turn + 1}")
                key = warm_key(rt, ids.shape[1])
                if key not in warmed:  # a later turn's capacity bucket: compile it untimed, apart
                    before = graph_stats(rt)
                    warm_up((dense, decoder, eager_dense, peer), [ids], n_new, eos)
                    after = graph_stats(rt)
                    for k in in_loop_warm:
                        in_loop_warm[k] += (after[k] or 0) - (before[k] or 0)
                    warmed.add(key)
                # Alternate the order (dense, mode), (mode, dense), ... so drift in the machine's
                # speed (clocks, caches, neighbours) does not favour one side; with interleave=step
                # the sides also take turns step by step within the request.
                sides = {"dense": dense, "mode": decoder, "eager_dense": eager_dense, "peer": peer}
                side_gen = time_sides({k: v for k, v in sides.items() if v is not None}, ids, n_new, eos,
                                      cfg.experiment.interleave, slot, cfg.seed)
                slot += 1
                ref, gen = side_gen["dense"], side_gen["mode"]
                dense_gens.append(ref)
                mode_gens.append(gen)
                mode_inputs.append(ids)
                if eager_dense is not None:
                    eager_gens.append(side_gen["eager_dense"])
                if peer is not None:
                    pg = side_gen["peer"]
                    peer_gens.append(pg)
                    peer_rows.append({"id": p["id"], "tokens": len(gen.tokens), "decode_s": gen.decode_s,
                                      "dense_tokens": len(pg.tokens), "dense_decode_s": pg.decode_s,
                                      "peer_identical": pg.tokens == gen.tokens})
                row = {"id": p["id"], "category": p["category"], "turn": turn, "prompt_tokens": ids.shape[1],
                       "prompt_sha": prompt_sha(ids),
                       "dense_tokens": len(ref.tokens), "tokens": len(gen.tokens),
                       "match_rate_vs_dense": match_rate([ref.tokens], [gen.tokens]),
                       "decode_s": gen.decode_s, "dense_decode_s": ref.decode_s,
                       "exit_layers": gen.exit_layers, "trace": gen.trace}
                if peer is not None:
                    row.update({"peer_tokens": len(side_gen["peer"].tokens), "peer_decode_s": side_gen["peer"].decode_s,
                                "peer_identical_to_mode": side_gen["peer"].tokens == gen.tokens,
                                "peer_identical_to_dense": side_gen["peer"].tokens == ref.tokens})
                if cfg.experiment.compare_hf_generate:
                    hf_tokens, secs = hf_generate(model, ids, n_new, eos)
                    hf_s += secs
                    hf_tokens_total += len(hf_tokens)
                    hf_match.append(hf_tokens == ref.tokens)
                    row["hf_generate_identical"] = hf_tokens == ref.tokens
                per_prompt.append(row)
                history.append((user, tokenizer.decode(ref.tokens, skip_special_tokens=True)))

    stats2 = graph_stats(rt)
    runtime_info["graphs_compiled_in_timed_runs"] = (stats2["graphs_compiled"] - stats1["graphs_compiled"]
                                                     - in_loop_warm["graphs_compiled"])
    runtime_info["graphs_compiled_between_turns"] = in_loop_warm["graphs_compiled"]
    runtime_info["cudagraph_skips_in_timed_runs"] = (stats2["cudagraph_skips"] - stats1["cudagraph_skips"]
                                                     - in_loop_warm["cudagraph_skips"])
    runtime_info["cudagraph_captures_in_timed_runs"] = (
        None if stats2["cudagraph_captures"] is None else
        stats2["cudagraph_captures"] - (stats1["cudagraph_captures"] or 0) - in_loop_warm["cudagraph_captures"])
    runtime_info["compiled_calls_in_timed_runs"] = (stats2["compiled_calls"] - stats1["compiled_calls"]
                                                    - in_loop_warm["compiled_calls"])
    # Energy in long windows, after the timed pass and apart from it (first turns of the prompts).
    energy_tokens = energy_pass({"dense": dense, "mode": decoder, "eager_dense": eager_dense}, meters,
                                [encode(p["text"], p["id"]) for p in prompts], n_new, eos,
                                rounds=max(1, cfg.experiment.repeats))
    m = speed_metrics(mode_gens, rt.num_layers)
    d = speed_metrics(dense_gens, rt.num_layers)
    m["runtime"] = runtime_info
    if eager_gens:  # this runtime against the eager reference, timed interleaved in this run
        e = speed_metrics(eager_gens, rt.num_layers)
        e["energy"] = meters["eager_dense"].summary(energy_tokens.get("eager_dense", 0))
        e["identical_to_runtime_dense_share"] = sum(a.tokens == b.tokens for a, b in zip(eager_gens, dense_gens)) / len(eager_gens)
        m["eager_dense"] = e
        m["speedup_vs_eager_dense"] = m["decode_tokens_per_s"] / e["decode_tokens_per_s"]
        d["speedup_vs_eager_dense"] = d["decode_tokens_per_s"] / e["decode_tokens_per_s"]
    m["speedup_vs_dense"] = m["decode_tokens_per_s"] / d["decode_tokens_per_s"]
    m["speedup_vs_dense_ci"] = paired_speedup_ci(per_prompt, seed=cfg.seed)
    m["match_rate_vs_dense"] = match_rate([g.tokens for g in dense_gens], [g.tokens for g in mode_gens])
    m["dense"] = d
    m["energy"] = meters["mode"].summary(energy_tokens.get("mode", 0))
    d["energy"] = meters["dense"].summary(energy_tokens.get("dense", 0))
    split_gens, method = mode_gens, decoder.timer().method
    if rt.device.type == "cuda" and any(g.trace for g in mode_gens) and not isinstance(decoder, HFGenerateDecoder):
        # The timed pass read no phase boundaries; a synchronized pass bills each phase its GPU time.
        profiler = build_decoder(cfg, rt, profile_phases=True)
        split_gens = [profiler.generate(encode(p["text"], p["id"]), n_new, eos) for p in prompts]
        method = profiler.timer().method
    m.update(early_exit_metrics(mode_gens, m, split_gens, method))
    if cfg.ablation.mode in ("specee", "adainfer"):  # after the clock: the exits against the oracle
        m.update(oracle_gap(LayerwiseLM(model), mode_inputs, mode_gens, len(per_prompt) // max(1, cfg.experiment.repeats),
                             verified=cfg.ablation.mode == "specee"))
    if peer is not None:
        m["peer"] = peer_metrics(peer, peer_gens, peer_rows, dense_gens, mode_gens, rt.num_layers, cfg.seed)
        m[f"speedup_vs_{peer.name}"] = m["peer"]["mode_speedup_vs_peer"]  # e.g. speedup_vs_hf_pld
        m[f"speedup_vs_{peer.name}_ci"] = m["peer"]["mode_speedup_vs_peer_ci"]
    if isinstance(decoder, HFGenerateDecoder):
        m["transformers_peer"] = {**decoder.describe(), "exit_layer_choice": decoder.choice}
        m["cost_model"] = {"not_modelled": "transformers' generate runs its own loop: its work is not counted "
                                           "step by step, so no cost model prices it"}
    elif cfg.experiment.cost_rounds:
        try:
            m["cost_model"] = cost_model(cfg, rt, decoder, dense, mode_inputs, mode_gens, dense_gens,
                                         m["speedup_vs_dense"], m["speedup_vs_dense_ci"])
            m["modelled_speedup_vs_dense"] = m["cost_model"]["modelled_speedup_vs_dense"]
        except (RuntimeError, ValueError, KeyError, IndexError) as err:
            # The timed measurement stands on its own: keep it, and say why it has no model.
            m["cost_model"] = {"failed": f"{type(err).__name__}: {err}"}
            print(f"warning: the cost model failed ({type(err).__name__}: {err}); the measured speed is kept")
    if cfg.ablation.mode == "pld":  # Spec-Bench's metrics for a proposal method
        steps = [t for g in mode_gens for t in g.trace]
        m["prompt_lookup"] = {"num_tokens": decoder.num_tokens, "num_tokens_setting": cfg.ablation.num_tokens,
                              "ngram_size": cfg.ablation.ngram_size,
                              "steps": len(steps), "match_share": sum(t["matched"] for t in steps) / max(len(steps), 1),
                              "proposed_per_step": sum(t["proposed"] for t in steps) / max(len(steps), 1),
                              "num_tokens_choice": decoder.lookup_choice}
    if any("spec_source" in t for g in mode_gens for t in g.trace):  # specee_pld: which source served
        m["speculation"] = speculation_sources(mode_gens, rt.num_layers)
    if any("accepted" in t for g in mode_gens for t in g.trace):
        from specee.decoding.tree import mean_accepted_length
        m["mean_accepted_length"] = mean_accepted_length(mode_gens)
    else:  # one token per step (dense, autoregressive SpecEE): Spec-Bench's tau is 1 by construction
        m["mean_accepted_length"] = 1.0
    if getattr(decoder, "tree", None) is not None:  # both mappings' costs for this tree (paper §6)
        from specee.decoding.tree_shape import describe
        m["tree_shape"] = describe(decoder.tree)
        if getattr(decoder, "tree_choice", None):  # ablation.tree_select=auto: what was chosen and why
            m["tree_choice"] = decoder.tree_choice
    if cfg.experiment.compare_hf_generate:
        dense_total = sum(g.prefill_s + g.decode_s for g in dense_gens)
        m["hf_generate_ratio"] = dense_total / hf_s
        m["hf_generate_identical_share"] = sum(hf_match) / len(hf_match)
    # The paper's speedup: end-to-end tokens/s, prefill included, against HF generate (the
    # decode-only speedup_vs_dense above is this harness's own, cleaner quantity).
    hf_tps = hf_tokens_total / hf_s if cfg.experiment.compare_hf_generate and hf_s else None
    m["hf_generate_tokens_per_s"] = hf_tps
    m["speedup_vs_hf_generate"] = m["tokens_per_s"] / hf_tps if hf_tps else None
    d["speedup_vs_hf_generate"] = d["tokens_per_s"] / hf_tps if hf_tps else None
    # The bandwidth floor, measured after the timed runs: ms/token as a multiple of it.
    from specee.bench.bandwidth import bound, copy_bandwidth
    context = sum(r["prompt_tokens"] + r["dense_tokens"] / 2 for r in per_prompt) / len(per_prompt)
    m["bandwidth_bound"] = bound(rt, context, copy_bandwidth(rt.device))
    for side in (m, d, *([m["eager_dense"]] if eager_gens else [])):
        side["ms_per_token"] = 1e3 / side["decode_tokens_per_s"]
        side["ms_per_token_over_limit"] = side["ms_per_token"] / m["bandwidth_bound"]["limit_ms_per_token"]
    m["machine"] = machine_fingerprint(m, d)
    m["noisy_reasons"] = noisy_reasons(m, cfg.ablation.mode, load_before, machine_load(device=rt.device),
                                       decoder.multi_token)
    if runtime_info["graphs_compiled_in_timed_runs"]:
        m["noisy_reasons"].append(f"{runtime_info['graphs_compiled_in_timed_runs']} graph(s) compiled inside "
                                  "the timed runs (compile time counted as decoding)")
    if runtime_info["cudagraphs"] and runtime_info["cudagraph_captures_in_timed_runs"]:
        m["noisy_reasons"].append(f"{runtime_info['cudagraph_captures_in_timed_runs']} CUDA graph(s) recorded "
                                  "inside the timed runs (recording counted as decoding)")
    if runtime_info["cudagraphs"] and (runtime_info["cudagraph_skips_in_warmup"]
                                       or runtime_info["cudagraph_skips_in_timed_runs"]):
        m["noisy_reasons"].append("inductor skipped CUDA graphs (counters['inductor']['cudagraph_skips']): this "
                                  f"is plain compiled mode, not {cfg.runtime.compile_mode}")
    m["noisy"] = bool(m["noisy_reasons"])
    m["machine_load_before"] = load_before
    if m["noisy"]:
        print("warning: this measurement is marked noisy: " + "; ".join(m["noisy_reasons"]))
    m["prompts"] = len(prompts)
    m["truncated_prompts"] = len(encode.truncated)  # kept their last max_positions - max_new_tokens tokens
    m["truncated"] = encode.record()
    m["turns"] = len(per_prompt) // max(1, cfg.experiment.repeats)
    m["repeats"] = cfg.experiment.repeats
    m["interleave"] = cfg.experiment.interleave
    path = results.save(out, cfg, m, {"prompts": per_prompt, "chat_template": cfg.model.chat_template,
                                      "device": str(rt.device)})
    print(f"{cfg.ablation.name}: {m['tokens_per_s']:.1f} tok/s, avg_layers {m['avg_layers']:.2f}/"
          f"{m['num_layers']}, speedup_vs_dense {m['speedup_vs_dense']:.3f} "
          f"[{m['speedup_vs_dense_ci'][0]:.3f}, {m['speedup_vs_dense_ci'][1]:.3f}], "
          f"match {m['match_rate_vs_dense']:.3f}"
          + (f", hf_generate_ratio {m['hf_generate_ratio']:.3f}" if "hf_generate_ratio" in m else "")
          + (f", speedup_vs_hf_generate {m['speedup_vs_hf_generate']:.3f}" if m["speedup_vs_hf_generate"] else "")
          + (f", speedup_vs_eager_dense {m['speedup_vs_eager_dense']:.3f} (runtime {rt.kind}; "
             f"{runtime_info['compile_s']:.1f} s compiling, {runtime_info['graphs_compiled_in_timed_runs']} "
             "graphs compiled while timed)" if eager_gens else ""))
    if "modelled_speedup_vs_dense" in m and "block_costs" in m["cost_model"]:
        c = m["cost_model"]
        print(f"block-cost model: modelled speedup {c['modelled_speedup_vs_dense']:.3f} [{c['modelled_band'][0]:.3f}, "
              f"{c['modelled_band'][1]:.3f}] (measured {m['speedup_vs_dense']:.3f}); mean block "
              f"{c['counts']['mean_block']:.2f} tokens, {c['counts']['steps_per_token']:.3f} steps per token")
    elif "modelled_speedup_vs_dense" in m:
        c = m["cost_model"]
        print(f"cost model: modelled speedup {c['modelled_speedup_vs_dense']:.3f} [{c['modelled_band'][0]:.3f}, "
              f"{c['modelled_band'][1]:.3f}] (measured {m['speedup_vs_dense']:.3f}); gap to the layer ratio: "
              + ", ".join(f"{g['cost']} {g['layer_units_per_token']:.2f} layers/token" for g in c["gap_to_layer_ratio"])
              + "; Llama-2-7B/13B on " + c["predicted_gpu"]["method"].split(":")[0] + ": "
              + " / ".join(f"{v:.2f}x" for v in c["predicted_gpu"]["speedup_vs_dense"].values()))
    print(f"bandwidth floor {m['bandwidth_bound']['limit_ms_per_token']:.3f} ms/token "
          f"({m['bandwidth_bound']['copy_gb_per_s']:.1f} GB/s copy): this mode {m['ms_per_token_over_limit']:.1f}x, "
          f"dense {d['ms_per_token_over_limit']:.1f}x")
    print(f"wrote {path}")
    return m
