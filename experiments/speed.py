"""Recipe: decode a prompt set with the configured mode, beside dense and HF generate, one run.

    python run.py experiment=speed ablation=dense model=tiny dataset.count=2 dataset.max_new_tokens=64
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from specee import results
from specee.bench.exit_metrics import early_exit_metrics, oracle_gap
from specee.bench.inputs import check_disjoint_from_calibration, generation_eos, load_prompts
from specee.cost_model.speed_job import cost_model
from specee.bench.power import EnergyMeter
from specee.bench.speed import (HFStaticCompiled, hf_generate, machine_fingerprint, match_rate, noisy_reasons,
                                paired_speedup_ci, peer_metrics, print_summary, speculation_sources, speed_metrics,
                                strongest_dense, time_sides)
from specee.bench.timing import WARMUP_TOKENS, energy_pass, warm_key, warm_up
from specee.runtime.compiled import graph_stats
from specee.builders import build_decoder, build_peer
from specee.decoding import modes
from specee.decoding.dense import DenseDecoder
from specee.decoding.hf_peer import HFGenerateDecoder
from specee.decoding.hf_peer import not_applicable as hf_not_applicable
from specee.early_exit.replayed_exits import prompt_sha
from specee.env import machine_load
from specee.frontier.certify import Unit, own_context_loss
from specee.models.loader import load_model
from specee.prompts import PromptEncoder, format_conversation
from specee.runtime.layerwise import LayerwiseLM
from specee.runtime.build import build_runtime


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


@dataclass
class SpeedJob:
    """What one speed job times, built once: the mode's decoder and every side timed beside it."""
    cfg: Any
    model: Any
    tokenizer: Any
    rt: Any
    spec: Any  # the mode's spec (specee/decoding/modes.py)
    decoder: Any
    dense: Any  # dense on the same runtime: every speedup's reference
    peer: Any  # the transformers decoder the mode's spec names, or None
    eager_dense: Any  # on the compiled runtime, eager dense on the same weights (the runtime's own gain)
    eos: Any
    encode: Any  # PromptEncoder: prompts cut to the model's positions, said once
    prompts: list
    hf_static: Any = None  # transformers' own fast path (experiment.hf_static_compiled)

    @property
    def n_new(self) -> int:
        return self.cfg.dataset.max_new_tokens

    def ids(self, p) -> torch.Tensor:
        return self.encode(p["text"], p["id"])

    def sides(self) -> dict:
        """The decoders timed in turn (dense first: the reference)."""
        sides = {"dense": self.dense, "mode": self.decoder, "eager_dense": self.eager_dense, "peer": self.peer}
        return {k: v for k, v in sides.items() if v is not None}


@dataclass
class Warmed:
    """What warming up left: the runtime's counters before the clock, the KV capacity buckets seen."""
    runtime_info: dict
    keys: set  # warm_key values warmed (compiled runtime: KV capacity buckets)
    stats: dict  # graph_stats after warm-up
    in_loop: dict = field(default_factory=lambda: {"graphs_compiled": 0, "cudagraph_skips": 0,
                                                     "cudagraph_captures": 0, "compiled_calls": 0,
                                                     "device_walk_captures": 0})
    hf_static_warm: dict = field(default_factory=dict)


@dataclass
class Timed:
    """What the timed pass collected, per request and per side."""
    dense_gens: list = field(default_factory=list)
    mode_gens: list = field(default_factory=list)
    eager_gens: list = field(default_factory=list)
    peer_gens: list = field(default_factory=list)
    peer_rows: list = field(default_factory=list)
    mode_inputs: list = field(default_factory=list)
    per_prompt: list = field(default_factory=list)
    hf_s: float = 0.0
    hf_tokens: int = 0
    hf_match: list = field(default_factory=list)
    hf_static_s: float = 0.0
    hf_static_tokens: int = 0
    hf_static_match: list = field(default_factory=list)
    load_before: dict = field(default_factory=dict)


def build_job(cfg) -> SpeedJob:
    prompts = load_prompts(cfg)  # a bad prompt file fails before the model loads
    check_disjoint_from_calibration(cfg, prompts)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    rt = build_runtime(cfg.runtime, model)
    eos = generation_eos(cfg, tokenizer)
    decoder = build_decoder(cfg, rt, eos_id=eos)
    encode = PromptEncoder.for_runtime(tokenizer, rt, cfg.dataset.max_new_tokens)
    job = SpeedJob(cfg, model, tokenizer, rt, modes.of(cfg.ablation), decoder, DenseDecoder(rt),
                   # pld beside transformers' prompt lookup at the same settings; an hf_ peer beside plain generate
                   build_peer_side(cfg, rt, decoder, eos),
                   DenseDecoder(LayerwiseLM(model)) if rt.kind == "compiled" else None, eos, encode, prompts)
    for p in prompts:  # cut over-long prompts now, and say so once
        job.ids(p)
    if encode.note():
        print(f"note: {encode.note()}")
    if cfg.experiment.hf_static_compiled:
        # transformers' own fast path (static cache, compiled decode), compiled and recorded here, before
        # the runtime's counters start: one cache sized for the longest first turn, warmed on it.
        longest = max((job.ids(p) for p in prompts), key=lambda x: x.shape[1])
        job.hf_static = HFStaticCompiled(model, longest.shape[1] + job.n_new, cfg.experiment.hf_static_compiled_backend)
        job.hf_static.warm(longest, min(WARMUP_TOKENS, job.n_new), eos)
    return job


def not_applicable(job: SpeedJob, out) -> dict | None:
    """Where transformers cannot run a peer on this model: one line in the result (a transformers
    mode), or the job goes on without the peer beside it."""
    first_ids = job.ids(job.prompts[0])
    if isinstance(job.decoder, HFGenerateDecoder) and (why := hf_not_applicable(job.decoder, first_ids, job.eos)):
        return record_not_applicable(job.cfg, out, job.decoder, why, len(job.prompts))
    if job.peer is not None and (why := hf_not_applicable(job.peer, first_ids, job.eos)):
        print(f"note: {why}; timed without it")
        job.peer = None
    return None


def warm(job: SpeedJob) -> Warmed:
    """Warm caches, allocator and kernels (and HF generate, timed beside them). A compiled runtime
    also warms on one prompt of every KV capacity bucket (cache_bucket; with symbolic lengths one
    key covers all), so its graphs are compiled before the clock starts; compile time is reported
    apart, and a graph compiled while timed marks the result noisy."""
    cfg, rt, n_new, eos = job.cfg, job.rt, job.n_new, job.eos
    stats0, t_warm = graph_stats(rt), time.perf_counter()
    prompts = list(job.prompts[: cfg.experiment.warmup])
    if rt.kind == "compiled":
        keys = {warm_key(rt, job.ids(p).shape[1]) for p in prompts}
        for p in job.prompts[cfg.experiment.warmup:]:
            if (key := warm_key(rt, job.ids(p).shape[1])) not in keys:
                keys.add(key)
                prompts.append(p)
    hf_warm = (lambda ids: hf_generate(job.model, ids, min(WARMUP_TOKENS, n_new), eos)) \
        if cfg.experiment.compare_hf_generate else None
    warm_up((job.dense, job.decoder, job.eager_dense, job.peer), [job.ids(p) for p in prompts], n_new, eos, hf_warm)
    if getattr(rt, "cudagraphs", False) and cfg.experiment.interleave == "step":
        # Sides stepping in turn hold their KV buffers at once, so the second takes other buffers
        # from the pool than any lone warm-up generation did: its CUDA graphs (one per layer) would
        # be recorded inside the timed runs. One untimed lockstep pass per order records them.
        sides = {k: v for k, v in {"dense": job.dense, "mode": job.decoder, "eager_dense": job.eager_dense}.items()
                 if v is not None}
        for slot in (0, 1):  # at the timed capacity: the same buffers
            time_sides(sides, job.ids(prompts[0] if prompts else job.prompts[0]), n_new, eos, "step", slot, cfg.seed)
    stats1 = graph_stats(rt)
    info = {"kind": rt.kind, "fallback": rt.fallback, "warmup_s": time.perf_counter() - t_warm,
            "compile_s": getattr(rt, "compile_seconds", 0.0),
            "graphs_compiled_in_warmup": stats1["graphs_compiled"] - stats0["graphs_compiled"],
            "cudagraphs": bool(getattr(rt, "cudagraphs", False)),
            "cudagraph_skips_in_warmup": stats1["cudagraph_skips"] - stats0["cudagraph_skips"],
            "cudagraph_captures_in_warmup": (None if stats1["cudagraph_captures"] is None else
                                             stats1["cudagraph_captures"] - (stats0["cudagraph_captures"] or 0)),
            "device_walk_captures_in_warmup": (None if stats1["device_walk_captures"] is None else
                                               stats1["device_walk_captures"] - (stats0["device_walk_captures"] or 0))}
    return Warmed(info, {warm_key(rt, job.ids(p).shape[1]) for p in prompts}, stats1,
                  hf_static_warm=dict(job.hf_static.warmup) if job.hf_static else {})


def timed_pass(job: SpeedJob, w: Warmed) -> Timed:
    """Every prompt through every side, interleaved (repeated ``experiment.repeats`` times), with
    HF generate (and its fast path) beside dense. Multi-turn prompts run as a conversation: turn k
    sees the dense model's earlier answers, so every mode is timed on the same token sequences."""
    cfg, rt, n_new, eos, tokenizer = job.cfg, job.rt, job.n_new, job.eos, job.tokenizer
    t = Timed(load_before=machine_load(device=rt.device))
    if t.load_before["busy"]:
        print(f"warning: the machine is busy (other processes' CPU share {t.load_before['other_cpu_share']}); "
              "timings will be noise and the result will be marked noisy")
    slot = 0
    for _ in range(cfg.experiment.repeats):
        for p in tqdm(job.prompts, desc=f"speed {cfg.ablation.name}"):
            history = []
            for turn, user in enumerate(p["turns"]):
                ids = job.encode(format_conversation(cfg.model.chat_template, history + [(user, None)], tokenizer),
                                 p["id"] if turn == 0 else f"{p['id']}/turn{turn + 1}")
                key = warm_key(rt, ids.shape[1])
                if key not in w.keys:  # a later turn's capacity bucket: compile it untimed, apart
                    before = graph_stats(rt)
                    warm_up((job.dense, job.decoder, job.eager_dense, job.peer), [ids], n_new, eos)
                    after = graph_stats(rt)
                    for k in w.in_loop:
                        w.in_loop[k] += (after[k] or 0) - (before[k] or 0)
                    w.keys.add(key)
                # Alternate the order (dense, mode), (mode, dense), ... so drift in the machine's
                # speed (clocks, caches, neighbours) does not favour one side; with interleave=step
                # the sides also take turns step by step within the request.
                side_gen = time_sides(job.sides(), ids, n_new, eos, cfg.experiment.interleave, slot, cfg.seed)
                slot += 1
                ref = record_request(job, t, p, turn, ids, side_gen)
                history.append((user, tokenizer.decode(ref.tokens, skip_special_tokens=True)))
    return t


def record_request(job: SpeedJob, t: Timed, p: dict, turn: int, ids, side_gen: dict):
    """One request's generations and its per-prompt row (and HF generate's, timed after it);
    returns dense's generation (the conversation's history)."""
    ref, gen = side_gen["dense"], side_gen["mode"]
    t.dense_gens.append(ref)
    t.mode_gens.append(gen)
    t.mode_inputs.append(ids)
    if job.eager_dense is not None:
        t.eager_gens.append(side_gen["eager_dense"])
    row = {"id": p["id"], "category": p["category"], "turn": turn, "prompt_tokens": ids.shape[1],
           "prompt_sha": prompt_sha(ids),
           "dense_tokens": len(ref.tokens), "tokens": len(gen.tokens),
           "match_rate_vs_dense": match_rate([ref.tokens], [gen.tokens]),
           "decode_s": gen.decode_s, "dense_decode_s": ref.decode_s,
           # the results contract's name for the layers run per token (exit layer + 1)
           "exit_layers": gen.layers_run, "trace": gen.trace}
    if job.peer is not None:
        pg = side_gen["peer"]
        t.peer_gens.append(pg)
        t.peer_rows.append({"id": p["id"], "tokens": len(gen.tokens), "decode_s": gen.decode_s,
                            "dense_tokens": len(pg.tokens), "dense_decode_s": pg.decode_s,
                            "peer_identical": pg.tokens == gen.tokens})
        row.update({"peer_tokens": len(pg.tokens), "peer_decode_s": pg.decode_s,
                    "peer_identical_to_mode": pg.tokens == gen.tokens, "peer_identical_to_dense": pg.tokens == ref.tokens})
    if job.cfg.experiment.compare_hf_generate:
        hf_tokens, secs = hf_generate(job.model, ids, job.n_new, job.eos)
        t.hf_s += secs
        t.hf_tokens += len(hf_tokens)
        t.hf_match.append(hf_tokens == ref.tokens)
        row["hf_generate_identical"] = hf_tokens == ref.tokens
    if job.hf_static is not None:
        if not job.hf_static.fits(ids, job.n_new):  # a longer later turn: a new cache, warmed untimed
            job.hf_static.grow(ids.shape[1] + job.n_new)
            job.hf_static.warm(ids, min(WARMUP_TOKENS, job.n_new), job.eos)
        hs_tokens, secs = job.hf_static.generate(ids, job.n_new, job.eos)
        t.hf_static_s += secs
        t.hf_static_tokens += len(hs_tokens)
        t.hf_static_match.append(hs_tokens == ref.tokens)
    t.per_prompt.append(row)
    return ref


def runtime_counters(job: SpeedJob, w: Warmed) -> dict:
    """The runtime's graph counters inside the timed runs (warm-up and later turns' buckets apart;
    the HF fast path's own compiles taken out: the counters are process-wide)."""
    info, stats1, stats2, in_loop = w.runtime_info, w.stats, graph_stats(job.rt), w.in_loop
    info["graphs_compiled_in_timed_runs"] = (stats2["graphs_compiled"] - stats1["graphs_compiled"]
                                             - in_loop["graphs_compiled"])
    info["graphs_compiled_between_turns"] = in_loop["graphs_compiled"]
    info["cudagraph_skips_in_timed_runs"] = (stats2["cudagraph_skips"] - stats1["cudagraph_skips"]
                                             - in_loop["cudagraph_skips"])
    info["cudagraph_captures_in_timed_runs"] = (
        None if stats2["cudagraph_captures"] is None else
        stats2["cudagraph_captures"] - (stats1["cudagraph_captures"] or 0) - in_loop["cudagraph_captures"])
    info["compiled_calls_in_timed_runs"] = (stats2["compiled_calls"] - stats1["compiled_calls"]
                                            - in_loop["compiled_calls"])
    info["device_walk_captures_in_timed_runs"] = (
        None if stats2["device_walk_captures"] is None else
        stats2["device_walk_captures"] - (stats1["device_walk_captures"] or 0) - in_loop["device_walk_captures"])
    hs = job.hf_static
    if hs is not None:
        for k in HFStaticCompiled.COUNTERS:
            if info[f"{k}_in_timed_runs"] is not None:
                info[f"{k}_in_timed_runs"] -= hs.timed[k] + hs.warmup[k] - w.hf_static_warm[k]
    return info


def side_metrics(job: SpeedJob, t: Timed, runtime_info: dict) -> tuple[dict, dict]:
    """Each side's speed and energy (energy in long windows, after the timed pass and apart from
    it, on the prompts' first turns) and the mode against dense, with its paired interval."""
    cfg, rt = job.cfg, job.rt
    meters = {"mode": EnergyMeter.for_device(rt.device), "dense": EnergyMeter.for_device(rt.device),
              "eager_dense": EnergyMeter.for_device(rt.device)}
    energy_tokens = energy_pass({"dense": job.dense, "mode": job.decoder, "eager_dense": job.eager_dense}, meters,
                                [job.ids(p) for p in job.prompts], job.n_new, job.eos,
                                rounds=max(1, cfg.experiment.repeats))
    m = speed_metrics(t.mode_gens, rt.num_layers)
    d = speed_metrics(t.dense_gens, rt.num_layers)
    m["runtime"] = runtime_info
    if t.eager_gens:  # this runtime against the eager reference, timed interleaved in this run
        e = speed_metrics(t.eager_gens, rt.num_layers)
        e["energy"] = meters["eager_dense"].summary(energy_tokens.get("eager_dense", 0))
        e["identical_to_runtime_dense_share"] = (sum(a.tokens == b.tokens for a, b in zip(t.eager_gens, t.dense_gens))
                                                 / len(t.eager_gens))
        m["eager_dense"] = e
        m["speedup_vs_eager_dense"] = m["decode_tokens_per_s"] / e["decode_tokens_per_s"]
        d["speedup_vs_eager_dense"] = d["decode_tokens_per_s"] / e["decode_tokens_per_s"]
    m["speedup_vs_dense"] = m["decode_tokens_per_s"] / d["decode_tokens_per_s"]
    m["speedup_vs_dense_ci"] = paired_speedup_ci(t.per_prompt, seed=cfg.seed)
    m["match_rate_vs_dense"] = match_rate([g.tokens for g in t.dense_gens], [g.tokens for g in t.mode_gens])
    m["dense"] = d
    m["energy"] = meters["mode"].summary(energy_tokens.get("mode", 0))
    d["energy"] = meters["dense"].summary(energy_tokens.get("dense", 0))
    return m, d


def mode_metrics(job: SpeedJob, t: Timed, m: dict) -> None:
    """What the mode's spec says it carries: where an early-exit mode's time goes (a synchronized
    profiling pass on CUDA), its exits against the oracle, the peer beside it, the cost model,
    prompt lookup's figures, tau, the tree."""
    cfg, rt, spec, decoder = job.cfg, job.rt, job.spec, job.decoder
    split_gens, method = t.mode_gens, decoder.timer().method
    if rt.device.type == "cuda" and any(g.trace for g in t.mode_gens) and not isinstance(decoder, HFGenerateDecoder):
        # The timed pass read no phase boundaries; a synchronized pass bills each phase its GPU time.
        profiler = build_decoder(cfg, rt, profile_phases=True)
        split_gens = [profiler.generate(job.ids(p), job.n_new, job.eos) for p in job.prompts]
        method = profiler.timer().method
    m.update(early_exit_metrics(t.mode_gens, m, split_gens, method))
    if spec.early_exit:  # after the clock: the exits against the oracle
        m.update(oracle_gap(LayerwiseLM(job.model), t.mode_inputs, t.mode_gens,
                            len(t.per_prompt) // max(1, cfg.experiment.repeats), verified=spec.verified_exits))
    if spec.early_exit:
        m["loss"] = loss_at_point(job, t)
    if job.peer is not None:
        m["peer"] = peer_metrics(job.peer, t.peer_gens, t.peer_rows, t.dense_gens, t.mode_gens, rt.num_layers, cfg.seed)
        m[f"speedup_vs_{job.peer.name}"] = m["peer"]["mode_speedup_vs_peer"]  # e.g. speedup_vs_hf_pld
        m[f"speedup_vs_{job.peer.name}_ci"] = m["peer"]["mode_speedup_vs_peer_ci"]
    if isinstance(decoder, HFGenerateDecoder):
        m["transformers_peer"] = {**decoder.describe(), "exit_layer_choice": decoder.choice}
        m["cost_model"] = {"not_modelled": "transformers' generate runs its own loop: its work is not counted "
                                           "step by step, so no cost model prices it"}
    elif cfg.experiment.cost_rounds:
        try:
            m["cost_model"] = cost_model(cfg, rt, decoder, job.dense, t.mode_inputs, t.mode_gens, t.dense_gens,
                                         m["speedup_vs_dense"], m["speedup_vs_dense_ci"])
            m["modelled_speedup_vs_dense"] = m["cost_model"]["modelled_speedup_vs_dense"]
        except (RuntimeError, ValueError, KeyError, IndexError) as err:
            # The timed measurement stands on its own: keep it, and say why it has no model.
            m["cost_model"] = {"failed": f"{type(err).__name__}: {err}"}
            print(f"warning: the cost model failed ({type(err).__name__}: {err}); the measured speed is kept")
    if spec.costs.block_cost:  # Spec-Bench's metrics for a proposal method
        steps = [s for g in t.mode_gens for s in g.trace]
        m["prompt_lookup"] = {"num_tokens": decoder.num_tokens, "num_tokens_setting": cfg.ablation.num_tokens,
                              "ngram_size": cfg.ablation.ngram_size,
                              "steps": len(steps), "match_share": sum(s["matched"] for s in steps) / max(len(steps), 1),
                              "proposed_per_step": sum(s["proposed"] for s in steps) / max(len(steps), 1),
                              "num_tokens_choice": decoder.lookup_choice}
    if cfg.ablation.speculation != "draft":  # which source served the speculative set (specee_pld)
        m["speculation"] = speculation_sources(t.mode_gens, rt.num_layers)
    if decoder.multi_token:  # a step verifies a proposal: Spec-Bench's tau from the accepted counts
        from specee.decoding.tree import mean_accepted_length
        m["mean_accepted_length"] = mean_accepted_length(t.mode_gens)
    else:  # one token per step (dense, autoregressive SpecEE): Spec-Bench's tau is 1 by construction
        m["mean_accepted_length"] = 1.0
    if spec.is_tree(cfg.ablation):  # both mappings' costs for this tree (paper §6)
        from specee.decoding.tree_shape import describe
        m["tree_shape"] = describe(decoder.tree)
        if getattr(decoder, "tree_choice", None):  # ablation.tree_select=auto: what was chosen and why
            m["tree_choice"] = decoder.tree_choice


def loss_at_point(job: SpeedJob, t: Timed) -> dict:
    """The loss of the point this job timed, in the frontier's one definition (after the clock): per
    prompt, the share of the emitted tokens the full stack at the same prefix would not emit; and
    whether the point is certified (``early_exit.operating_point``) or not."""
    rows = [own_context_loss(job.rt, Unit(str(n), ids, ref.tokens), gen.tokens, gen.layers_run)
            for n, (ids, gen, ref) in enumerate(zip(t.mode_inputs, t.mode_gens, t.dense_gens))]
    loss = float(np.mean([r["loss"] for r in rows])) if rows else 0.0
    point = getattr(job.decoder, "operating_point", None)
    out = {"own_context_disagreement": loss, "per_prompt": [r["loss"] for r in rows],
           "sequence_identity": float(np.mean([r["identical"] for r in rows])) if rows else 1.0,
           "definition": "mean over prompts of the share of a prompt's emitted tokens that the full stack, at "
                         "the same prefix, would not emit", "certified": point}
    out["statement"] = (point["statement"] + f"; here {loss:.4f}" if point is not None else
                        f"uncertified point (no early_exit.operating_point): measured loss {loss:.4f} "
                        f"over {len(rows)} prompt(s), no guarantee")
    return out


def baseline_metrics(job: SpeedJob, t: Timed, m: dict, d: dict) -> None:
    """The dense baselines a GPU user would pick: HF generate eager (the paper's; end-to-end
    tokens/s, prefill included — speedup_vs_dense is the harness's own, decode-only quantity), its
    static-cache compiled fast path, and the strongest dense baseline this job timed."""
    rt, hs = job.rt, job.hf_static
    if job.cfg.experiment.compare_hf_generate:
        dense_total = sum(g.prefill_s + g.decode_s for g in t.dense_gens)
        m["hf_generate_ratio"] = dense_total / t.hf_s
        m["hf_generate_identical_share"] = sum(t.hf_match) / len(t.hf_match)
    hf_tps = t.hf_tokens / t.hf_s if job.cfg.experiment.compare_hf_generate and t.hf_s else None
    m["hf_generate_tokens_per_s"] = hf_tps
    m["speedup_vs_hf_generate"] = m["tokens_per_s"] / hf_tps if hf_tps else None
    d["speedup_vs_hf_generate"] = d["tokens_per_s"] / hf_tps if hf_tps else None
    hs_tps = t.hf_static_tokens / t.hf_static_s if hs is not None and t.hf_static_s else None
    if hs is not None:
        m["hf_static_compiled"] = {**hs.describe(), "tokens_per_s": hs_tps,
                                   "identical_share": sum(t.hf_static_match) / max(len(t.hf_static_match), 1)}
    m["hf_static_compiled_tokens_per_s"] = hs_tps
    m["speedup_vs_hf_static_compiled"] = m["tokens_per_s"] / hs_tps if hs_tps else None
    d["speedup_vs_hf_static_compiled"] = d["tokens_per_s"] / hs_tps if hs_tps else None
    # Every figure against the fastest dense baseline this job timed, beside the paper's HF one.
    dense_name = ("dense_graphed" if getattr(rt, "cudagraphs", False) else f"dense_{rt.kind}")
    candidates = {"hf_generate_eager": hf_tps, "hf_static_compiled": hs_tps, dense_name: d["tokens_per_s"]}
    if t.eager_gens:
        candidates["dense_eager"] = m["eager_dense"]["tokens_per_s"]
    m["strongest_dense_baseline"] = strongest_dense(candidates)
    m["speedup_vs_strongest_dense"] = (m["tokens_per_s"] / m["strongest_dense_baseline"]["tokens_per_s"]
                                       if m["strongest_dense_baseline"] else None)


def trust_metrics(job: SpeedJob, t: Timed, m: dict, d: dict) -> None:
    """The bandwidth floor (measured after the timed runs: ms/token as a multiple of it), the
    machine's fingerprint, and why the measurement may be noise."""
    from specee.bench.bandwidth import bound, copy_bandwidth
    cfg, rt, info, hs = job.cfg, job.rt, m["runtime"], job.hf_static
    context = sum(r["prompt_tokens"] + r["dense_tokens"] / 2 for r in t.per_prompt) / len(t.per_prompt)
    m["bandwidth_bound"] = bound(rt, context, copy_bandwidth(rt.device))
    for side in (m, d, *([m["eager_dense"]] if t.eager_gens else [])):
        side["ms_per_token"] = 1e3 / side["decode_tokens_per_s"]
        side["ms_per_token_over_limit"] = side["ms_per_token"] / m["bandwidth_bound"]["limit_ms_per_token"]
    m["machine"] = machine_fingerprint(m, d)
    m["noisy_reasons"] = noisy_reasons(m, job.spec.name, t.load_before, machine_load(device=rt.device),
                                       job.decoder.multi_token)
    if hs is not None and (hs.timed["graphs_compiled"] or hs.timed["cudagraph_captures"]):
        m["noisy_reasons"].append(f"HF static-compiled generate compiled {hs.timed['graphs_compiled']} graph(s) "
                                  f"and recorded {hs.timed['cudagraph_captures']} CUDA graph(s) while timed")
    if info["graphs_compiled_in_timed_runs"]:
        m["noisy_reasons"].append(f"{info['graphs_compiled_in_timed_runs']} graph(s) compiled inside "
                                  "the timed runs (compile time counted as decoding)")
    if info["cudagraphs"] and info["cudagraph_captures_in_timed_runs"]:
        m["noisy_reasons"].append(f"{info['cudagraph_captures_in_timed_runs']} CUDA graph(s) recorded "
                                  "inside the timed runs (recording counted as decoding)")
    if info.get("device_walk_captures_in_timed_runs"):
        m["noisy_reasons"].append(f"{info['device_walk_captures_in_timed_runs']} device-walk CUDA graph(s) recorded "
                                  "inside the timed runs (recording counted as decoding)")
    if info["cudagraphs"] and (info["cudagraph_skips_in_warmup"] or info["cudagraph_skips_in_timed_runs"]):
        m["noisy_reasons"].append("inductor skipped CUDA graphs (counters['inductor']['cudagraph_skips']): this "
                                  f"is plain compiled mode, not {cfg.runtime.compile_mode}")
    m["noisy"] = bool(m["noisy_reasons"])
    m["machine_load_before"] = t.load_before
    if m["noisy"]:
        print("warning: this measurement is marked noisy: " + "; ".join(m["noisy_reasons"]))
    m["prompts"] = len(job.prompts)
    m["truncated_prompts"] = len(job.encode.truncated)  # kept their last max_positions - max_new_tokens tokens
    m["truncated"] = job.encode.record()
    m["turns"] = len(t.per_prompt) // max(1, cfg.experiment.repeats)
    m["repeats"] = cfg.experiment.repeats
    m["interleave"] = cfg.experiment.interleave


def run(cfg) -> dict:
    out = results.output_dir()
    job = build_job(cfg)
    if (na := not_applicable(job, out)) is not None:
        return na
    w = warm(job)
    t = timed_pass(job, w)
    m, d = side_metrics(job, t, runtime_counters(job, w))
    mode_metrics(job, t, m)
    baseline_metrics(job, t, m, d)
    trust_metrics(job, t, m, d)
    path = results.save(out, cfg, m, {"prompts": t.per_prompt, "chat_template": cfg.model.chat_template,
                                      "device": str(job.rt.device)})
    print_summary(cfg.ablation.name, m, d, job.rt.kind if t.eager_gens else None)
    print(f"wrote {path}")
    return m
