"""Recipe: decode a prompt set with the configured mode, beside dense and HF generate, one run.

    python run.py experiment=speed ablation=dense model=tiny dataset.count=2 dataset.max_new_tokens=64
"""
from __future__ import annotations

import time

import torch
from tqdm import tqdm

from specee import results
from specee.bench.exit_metrics import early_exit_metrics, oracle_gap
from specee.bench.inputs import check_disjoint_from_calibration, generation_eos, load_prompts
from specee.bench.modelled_speed import cost_model
from specee.bench.power import EnergyMeter
from specee.bench.speed import (HFStaticCompiled, hf_generate, machine_fingerprint, match_rate, noisy_reasons,
                                paired_speedup_ci, peer_metrics, print_summary, speculation_sources, speed_metrics,
                                strongest_dense, time_sides)
from specee.bench.timing import WARMUP_TOKENS, energy_pass, warm_key, warm_up
from specee.compiled import graph_stats
from specee.decoding import build_decoder, build_peer, modes
from specee.decoding.dense import DenseDecoder
from specee.decoding.hf_peer import HFGenerateDecoder
from specee.decoding.hf_peer import not_applicable as hf_not_applicable
from specee.early_exit.replay import prompt_sha
from specee.env import machine_load
from specee.models.loader import load_model
from specee.prompts import PromptEncoder, format_conversation
from specee.runtime import LayerwiseLM, build_runtime


def build_peer_side(cfg, rt, decoder, eos):
    """The transformers peer the mode's spec names, timed beside it: for prompt lookup,
    transformers' prompt lookup at the same proposal length and n-gram size; for a transformers
    mode, plain generate (its own baseline)."""
    peer = modes.of(cfg.ablation).peer
    if peer is None:
        return None
    return build_peer(cfg, rt, peer, eos, num_tokens=getattr(decoder, "num_tokens", None))


def record_not_applicable(cfg, out, decoder, why: str, prompts: int) -> dict:
    """A peer transformers cannot run on this model: a result that says so, in one line."""
    print(f"{cfg.ablation.name}: not applicable: {why}")
    m = {"not_applicable": why, "prompts": prompts, **{"transformers_peer": decoder.describe()}}
    path = results.save(out, cfg, m, {"prompts": [], "chat_template": cfg.model.chat_template,
                                      "device": str(decoder.rt.device)})
    print(f"wrote {path}")
    return m


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
    spec = modes.of(cfg.ablation)
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
    # transformers' own fast path (static cache, compiled decode), compiled and recorded here, before
    # the runtime's counters start: one cache sized for the longest first turn, warmed on it.
    hf_static = None
    if cfg.experiment.hf_static_compiled:
        longest = max((encode(p["text"], p["id"]) for p in prompts), key=lambda x: x.shape[1])
        hf_static = HFStaticCompiled(model, longest.shape[1] + n_new, cfg.experiment.hf_static_compiled_backend)
        hf_static.warm(longest, min(WARMUP_TOKENS, n_new), eos)
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
    if getattr(rt, "cudagraphs", False) and cfg.experiment.interleave == "step":
        # Sides stepping in turn hold their KV buffers at once, so the second takes other buffers
        # from the pool than any lone warm-up generation did: its CUDA graphs (one per layer) would
        # be recorded inside the timed runs. One untimed lockstep pass per order records them.
        sides = {k: v for k, v in {"dense": dense, "mode": decoder, "eager_dense": eager_dense}.items() if v is not None}
        for slot in (0, 1):
            time_sides(sides, encode(warm[0]["text"], warm[0]["id"]) if warm else first_ids,
                       n_new, eos, "step", slot, cfg.seed)  # the timed capacity: the same buffers
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
    hf_static_warm0 = dict(hf_static.warmup) if hf_static else {}
    hf_static_s, hf_static_tokens, hf_static_match = 0.0, 0, []

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
                       # the results contract's name for the layers run per token (exit layer + 1)
                       "exit_layers": gen.layers_run, "trace": gen.trace}
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
                if hf_static is not None:
                    if not hf_static.fits(ids, n_new):  # a longer later turn: a new cache, warmed untimed
                        hf_static.grow(ids.shape[1] + n_new)
                        hf_static.warm(ids, min(WARMUP_TOKENS, n_new), eos)
                    hs_tokens, secs = hf_static.generate(ids, n_new, eos)
                    hf_static_s += secs
                    hf_static_tokens += len(hs_tokens)
                    hf_static_match.append(hs_tokens == ref.tokens)
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
    if hf_static is not None:  # the counters are process-wide: the fast path's compiles are its own
        for k in HFStaticCompiled.COUNTERS:
            if runtime_info[f"{k}_in_timed_runs"] is not None:
                runtime_info[f"{k}_in_timed_runs"] -= hf_static.timed[k] + hf_static.warmup[k] - hf_static_warm0[k]
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
    if spec.early_exit:  # after the clock: the exits against the oracle
        m.update(oracle_gap(LayerwiseLM(model), mode_inputs, mode_gens, len(per_prompt) // max(1, cfg.experiment.repeats),
                            verified=spec.verified_exits))
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
    if spec.costs.block_cost:  # Spec-Bench's metrics for a proposal method
        steps = [t for g in mode_gens for t in g.trace]
        m["prompt_lookup"] = {"num_tokens": decoder.num_tokens, "num_tokens_setting": cfg.ablation.num_tokens,
                              "ngram_size": cfg.ablation.ngram_size,
                              "steps": len(steps), "match_share": sum(t["matched"] for t in steps) / max(len(steps), 1),
                              "proposed_per_step": sum(t["proposed"] for t in steps) / max(len(steps), 1),
                              "num_tokens_choice": decoder.lookup_choice}
    if cfg.ablation.speculation != "draft":  # which source served the speculative set (specee_pld)
        m["speculation"] = speculation_sources(mode_gens, rt.num_layers)
    if decoder.multi_token:  # a step verifies a proposal: Spec-Bench's tau from the accepted counts
        from specee.decoding.tree import mean_accepted_length
        m["mean_accepted_length"] = mean_accepted_length(mode_gens)
    else:  # one token per step (dense, autoregressive SpecEE): Spec-Bench's tau is 1 by construction
        m["mean_accepted_length"] = 1.0
    if spec.is_tree(cfg.ablation):  # both mappings' costs for this tree (paper §6)
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
    hs_tps = hf_static_tokens / hf_static_s if hf_static is not None and hf_static_s else None
    if hf_static is not None:
        m["hf_static_compiled"] = {**hf_static.describe(), "tokens_per_s": hs_tps,
                                   "identical_share": sum(hf_static_match) / max(len(hf_static_match), 1)}
    m["hf_static_compiled_tokens_per_s"] = hs_tps
    m["speedup_vs_hf_static_compiled"] = m["tokens_per_s"] / hs_tps if hs_tps else None
    d["speedup_vs_hf_static_compiled"] = d["tokens_per_s"] / hs_tps if hs_tps else None
    # Every figure against the fastest dense baseline this job timed, beside the paper's HF one.
    dense_name = ("dense_graphed" if getattr(rt, "cudagraphs", False) else f"dense_{rt.kind}")
    candidates = {"hf_generate_eager": hf_tps, "hf_static_compiled": hs_tps, dense_name: d["tokens_per_s"]}
    if eager_gens:
        candidates["dense_eager"] = m["eager_dense"]["tokens_per_s"]
    m["strongest_dense_baseline"] = strongest_dense(candidates)
    m["speedup_vs_strongest_dense"] = (m["tokens_per_s"] / m["strongest_dense_baseline"]["tokens_per_s"]
                                       if m["strongest_dense_baseline"] else None)
    # The bandwidth floor, measured after the timed runs: ms/token as a multiple of it.
    from specee.bench.bandwidth import bound, copy_bandwidth
    context = sum(r["prompt_tokens"] + r["dense_tokens"] / 2 for r in per_prompt) / len(per_prompt)
    m["bandwidth_bound"] = bound(rt, context, copy_bandwidth(rt.device))
    for side in (m, d, *([m["eager_dense"]] if eager_gens else [])):
        side["ms_per_token"] = 1e3 / side["decode_tokens_per_s"]
        side["ms_per_token_over_limit"] = side["ms_per_token"] / m["bandwidth_bound"]["limit_ms_per_token"]
    m["machine"] = machine_fingerprint(m, d)
    m["noisy_reasons"] = noisy_reasons(m, spec.name, load_before, machine_load(device=rt.device),
                                       decoder.multi_token)
    if hf_static is not None and (hf_static.timed["graphs_compiled"] or hf_static.timed["cudagraph_captures"]):
        m["noisy_reasons"].append(f"HF static-compiled generate compiled {hf_static.timed['graphs_compiled']} graph(s) "
                                  f"and recorded {hf_static.timed['cudagraph_captures']} CUDA graph(s) while timed")
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
    print_summary(cfg.ablation.name, m, d, rt.kind if eager_gens else None)
    print(f"wrote {path}")
    return m
