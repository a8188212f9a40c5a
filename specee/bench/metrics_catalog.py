"""What each metric of a speed ``results.json`` means, and its unit.

One declaration per key under ``metrics`` (the top level) and per key of a side timed beside the
mode (``metrics.dense``, ``metrics.eager_dense``). ``scripts/gen_reference.py`` renders it into
docs/reference.md, and tests/test_docs.py checks that a real speed run writes no key missing
here: a metric added to experiments/speed.py without a line here fails the suite, so the
documented contract cannot fall behind the code.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    key: str
    unit: str
    meaning: str
    # which results carry it; None: the modes whose spec lists it in ``extra_metrics``
    # (specee/decoding/modes.py), so the registry says once which mode carries which metric
    when: str | None = "every mode"


def modes_carrying(key: str) -> list[str]:
    """The modes whose spec declares ``key`` among its ``extra_metrics``."""
    from specee.decoding import modes
    return [n for n in modes.names() if key in modes.spec(n).extra_metrics]


def present_for(metric: Metric) -> str:
    return metric.when if metric.when is not None else ", ".join(modes_carrying(metric.key))


# Keys directly under ``metrics`` in a speed results.json (experiments/speed.py writes them).
TOP: tuple[Metric, ...] = (
    # -- throughput and latency of the mode under test
    Metric("tokens_per_s", "tokens/s", "end-to-end throughput, prefill included"),
    Metric("decode_tokens_per_s", "tokens/s", "decode throughput (first token excluded); speedups are ratios of it"),
    Metric("ms_per_token", "ms", "decode time per token, 1000 / decode_tokens_per_s"),
    Metric("decode_s", "s", "summed decode time over all prompts"),
    Metric("generated_tokens", "tokens", "tokens generated over all prompts"),
    Metric("prefill_ms_mean", "ms", "mean prefill time per prompt"),
    Metric("latency_ms_per_token", "ms", "per-token decode latency: mean, p50, p90, p99"),
    Metric("num_layers", "layers", "the model's decoder layers L"),
    Metric("avg_layers", "layers", "mean layers run per decoded token (L for dense)"),
    Metric("mean_accepted_length", "tokens/step", "tokens emitted per verification step, bonus included "
                                                 "(Spec-Bench's tau; 1 for one-token-per-step modes)"),
    # -- against dense, timed in the same job
    Metric("dense", "object", "the dense loop timed beside the mode: the side keys below"),
    Metric("speedup_vs_dense", "ratio", "decode tokens/s of the mode over dense's, same prompts, interleaved"),
    Metric("speedup_vs_dense_ci", "[lo, hi]", "95 % bootstrap interval of speedup_vs_dense over prompts"),
    Metric("match_rate_vs_dense", "share 0-1", "share of token positions equal to dense's output"),
    Metric("loss", "object", "early-exit modes: the loss of the point timed (own_context_disagreement: mean over prompts "
           "of the share of emitted tokens the full stack at the same prefix would not emit; per_prompt; "
           "sequence_identity), whether it is certified (the frontier point from early_exit.operating_point, or "
           "null) and a one-line statement"),
    Metric("efficiency", "ratio", "speedup_vs_dense / (num_layers / avg_layers): how much of the layer "
                                  "saving became speed", "early-exit modes"),
    # -- against transformers' generate
    Metric("hf_generate_ratio", "ratio", "this runtime's dense time over transformers' generate, same prompts",
           "experiment.compare_hf_generate"),
    Metric("hf_generate_identical_share", "share 0-1", "prompts whose generate output equals dense's token "
                                                       "for token", "experiment.compare_hf_generate"),
    Metric("hf_generate_tokens_per_s", "tokens/s", "transformers' generate end to end (null when not timed)"),
    Metric("speedup_vs_hf_generate", "ratio", "the paper's speedup: end-to-end tokens/s against generate "
                                              "(null when not timed)"),
    Metric("hf_static_compiled", "object", "transformers' fast path timed in the same job: generate over a "
                                           "static cache with its decode forward compiled (CUDA graphs on a GPU): "
                                           "tokens/s, identical share, compile seconds, graphs compiled while timed",
           "experiment.hf_static_compiled"),
    Metric("hf_static_compiled_tokens_per_s", "tokens/s", "that fast path end to end (null when not timed)"),
    Metric("speedup_vs_hf_static_compiled", "ratio", "end-to-end tokens/s against that fast path (null when "
                                                     "not timed)"),
    Metric("strongest_dense_baseline", "object", "the fastest dense baseline timed in this job by end-to-end "
                                                 "tokens/s (name, tokens_per_s) and every candidate: HF generate "
                                                 "eager and static-compiled, this runtime's dense loop, eager dense"),
    Metric("speedup_vs_strongest_dense", "ratio", "end-to-end tokens/s against strongest_dense_baseline"),
    # -- compiled runtime
    Metric("runtime", "object", "runtime kind, compiler fallback, warm-up and compile seconds, graphs "
                                "compiled and CUDA graphs captured (inductor's, and the device walk's with "
                                "exit_control=device) or skipped, in warm-up and while timed"),
    Metric("eager_dense", "object", "eager dense timed beside a compiled runtime: the side keys below",
           "runtime=compiled"),
    Metric("speedup_vs_eager_dense", "ratio", "decode tokens/s over eager dense's: the runtime's own gain",
           "runtime=compiled"),
    # -- early-exit work, from the step traces
    Metric("predictor_calls_per_token", "calls/token", "predictor evaluations per emitted token", "early-exit modes"),
    Metric("verify_calls_per_token", "calls/token", "full LM-head verifications per emitted token", "early-exit modes"),
    Metric("syncs_per_token", "syncs/token", "host reads of device values per token (each a GPU stall)",
           "early-exit modes"),
    Metric("walk_syncs_per_token", "syncs/token", "host round trips inside the layer walk per token (0 with "
           "runtime.exit_control=device); null for modes that do not record them", "early-exit modes"),
    Metric("exit_rate", "share 0-1", "steps that left the stack before the last layer", "early-exit modes"),
    Metric("fire_precision", "share 0-1", "verifications (fired predictors) that confirmed an exit; null "
                                          "under replay", "early-exit modes"),
    Metric("overhead_share", "share 0-1", "decode time in predictors and verification", "early-exit modes"),
    Metric("draft_share", "share 0-1", "decode time in the draft step", "early-exit modes"),
    Metric("time_split_s", "s", "decode time by phase: layers, predictors, verification, draft, other, "
                                "decode_total", "early-exit modes"),
    Metric("time_split_method", "text", "how the phase split was timed (same pass on a CPU, a synchronized "
                                        "profiling pass on CUDA)", "early-exit modes"),
    Metric("time_split_coverage", "ratio", "sum of the phases over the decode time (near 1 when the split "
                                           "accounts for it all)", "early-exit modes"),
    Metric("verification_steps", "steps", "verification steps run", "tree modes"),
    Metric("predictor_calls_per_step", "calls/step", "predictor evaluations per verification step", "tree modes"),
    Metric("replay_target_avg_layers", "layers", "mean exit layer the replayed distribution asked for",
           "early_exit.replay"),
    # -- exits against the oracle (untimed, after the clock)
    Metric("oracle_gap", "object", "shares of tokens exiting at the oracle layer, within 2 layers, later, "
                                   "never, earlier; histogram; token count", None),
    Metric("avg_layers_over_oracle", "ratio", "mean layers used over the oracle's mean", None),
    Metric("oracle_avg_layers", "layers", "mean earliest layer whose argmax is the full stack's token",
           None),
    Metric("tokens_not_full_stack_prediction", "share 0-1", "emitted tokens that differ from the full "
                                                            "stack's prediction in the same context", None),
    Metric("refuted_fires_per_token", "fires/token", "predictor fires the LM-head verification refuted "
                                                     "(null under replay)", None),
    # -- the cost model
    Metric("cost_model", "object", "counted work x unit costs measured in this job: modelled speedup and "
                                   "band, agreement with the measurement, unmodelled share, the gap to the "
                                   "layer ratio, the same counts priced for Llama-2-7B/13B on an analytic GPU",
           "experiment.cost_rounds > 0"),
    Metric("modelled_speedup_vs_dense", "ratio", "the cost model's speedup (copied from cost_model)",
           "experiment.cost_rounds > 0"),
    # -- tree decoding
    Metric("tree_shape", "object", "the tree's nodes, depth, leaves and both mappings' predictor "
                                   "evaluations per layer and mapping complexity", "tree modes"),
    Metric("tree_choice", "object", "the tree ablation.tree_select=auto chose, and its predicted speedup",
           "ablation.tree_select=auto"),
    # -- peers and prompt lookup
    Metric("peer", "object", "transformers' peer timed in the same job: its speed, tokens per step, match "
                             "rate and the mode's speed against it", None),
    Metric("speedup_vs_hf_pld", "ratio", "the mode against transformers' prompt lookup at the same settings", None),
    Metric("speedup_vs_hf_pld_ci", "[lo, hi]", "95 % paired interval of speedup_vs_hf_pld", None),
    Metric("speedup_vs_hf_plain", "ratio", "the transformers peer against plain generate, its own baseline",
           None),
    Metric("speedup_vs_hf_plain_ci", "[lo, hi]", "95 % paired interval of speedup_vs_hf_plain",
           None),
    Metric("transformers_peer", "object", "the generate() arguments of a transformers mode and, for "
                                          "exit_layer=auto, the choice and its prediction", None),
    Metric("not_applicable", "text", "why transformers cannot run this peer on this model (the only "
                                     "measurement then)", None),
    Metric("prompt_lookup", "object", "proposal length used and set, n-gram size, steps, share of steps "
                                      "with a match, tokens proposed per step, the auto choice", None),
    Metric("speculation", "object", "per source (prompt, draft): share of steps served, exit rate, mean "
                                    "layers; draft calls per token", "ablation.speculation=prompt_lookup"),
    # -- the floor and the machine
    Metric("bandwidth_bound", "object", "bytes one dense step reads over the measured copy bandwidth: "
                                        "limit_ms_per_token, bytes_per_token, copy_gb_per_s"),
    Metric("ms_per_token_over_limit", "ratio", "ms_per_token over the bandwidth floor"),
    Metric("energy", "object", "NVML (GPU) or RAPL (CPU) energy of the mode in an untimed pass: joules, "
                               "joules_per_token, mean_watts, windows; available=false with the reason "
                               "otherwise"),
    Metric("machine", "object", "what a speed ratio depends on: CPU, caches, vector flags, threads, GPUs, "
                                "dense ms/token, LM head over a layer by time"),
    Metric("machine_load_before", "object", "other processes' CPU share (and GPU use) before the run"),
    Metric("noisy", "bool", "true when a reason below says the measurement cannot be trusted"),
    Metric("noisy_reasons", "list of text", "dense off 1 beyond its interval, efficiency > 1, a busy "
                                            "machine, graphs compiled while timed"),
    # -- what was run
    Metric("prompts", "prompts", "prompts in the set"),
    Metric("turns", "turns", "timed turns (prompts x conversation turns)"),
    Metric("repeats", "count", "timed passes over the prompt set (experiment.repeats)"),
    Metric("interleave", "text", "step (dense and mode in turn, step by step) or request"),
    Metric("truncated_prompts", "prompts", "prompts longer than the context that kept their last tokens"),
    Metric("truncated", "object", "which prompts were cut, from how many tokens"),
)

# Keys of a side timed beside the mode: ``metrics.dense`` and ``metrics.eager_dense``.
SIDES: tuple[str, ...] = ("dense", "eager_dense")
SIDE: tuple[Metric, ...] = (
    Metric("tokens_per_s", "tokens/s", "end-to-end throughput, prefill included"),
    Metric("decode_tokens_per_s", "tokens/s", "decode throughput"),
    Metric("ms_per_token", "ms", "decode time per token"),
    Metric("ms_per_token_over_limit", "ratio", "ms_per_token over the bandwidth floor"),
    Metric("decode_s", "s", "summed decode time"),
    Metric("generated_tokens", "tokens", "tokens generated"),
    Metric("prefill_ms_mean", "ms", "mean prefill time per prompt"),
    Metric("latency_ms_per_token", "ms", "per-token decode latency: mean, p50, p90, p99"),
    Metric("num_layers", "layers", "the model's decoder layers"),
    Metric("avg_layers", "layers", "layers per token (num_layers)"),
    Metric("energy", "object", "energy of this side in its untimed window"),
    Metric("speedup_vs_hf_generate", "ratio", "end-to-end tokens/s against generate", "metrics.dense"),
    Metric("speedup_vs_hf_static_compiled", "ratio", "end-to-end tokens/s against generate over a static "
                                                     "cache, compiled", "metrics.dense"),
    Metric("speedup_vs_eager_dense", "ratio", "compiled dense against eager dense", "metrics.dense, runtime=compiled"),
    Metric("identical_to_runtime_dense_share", "share 0-1", "prompts where eager dense's tokens equal "
                                                            "the compiled runtime's", "eager_dense"),
)


def foreign_keys(metrics: dict, mode: str) -> list[str]:
    """Keys of a speed result of ``mode`` that the registry declares for other modes only."""
    from specee.decoding import modes
    own = set(modes.spec(mode).extra_metrics)
    declared = {k for n in modes.names() for k in modes.spec(n).extra_metrics}
    return [k for k in metrics if k in declared and k not in own]


def unknown_keys(metrics: dict) -> list[str]:
    """Keys of a speed result's ``metrics`` (and of its sides) that this catalog does not declare."""
    top, side = {m.key for m in TOP}, {m.key for m in SIDE}
    missing = [k for k in metrics if k not in top]
    for s in SIDES:
        missing += [f"{s}.{k}" for k in (metrics.get(s) or {}) if k not in side]
    return missing


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown() -> str:
    """The catalog as markdown tables (docs/reference.md's metrics section)."""
    lines = ["| key | unit | meaning | present for |", "|---|---|---|---|"]
    lines += [f"| `{m.key}` | {_cell(m.unit)} | {_cell(m.meaning)} | {_cell(present_for(m))} |" for m in TOP]
    lines += ["", f"Keys of each side timed beside the mode ({', '.join(f'`metrics.{s}`' for s in SIDES)}):", "",
              "| key | unit | meaning | present for |", "|---|---|---|---|"]
    lines += [f"| `{m.key}` | {_cell(m.unit)} | {_cell(m.meaning)} | {_cell(present_for(m))} |" for m in SIDE]
    return "\n".join(lines) + "\n"
