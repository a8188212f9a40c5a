"""Side-by-side speed measurement: the mode under test, the dense loop and HF generate."""
from __future__ import annotations

import statistics

import torch

from specee.decoding.base import Clock, Generation
from specee.decoding.hf_peer import greedy_generate_args


@torch.inference_mode()
def hf_generate(model, prompt_ids: torch.Tensor, max_new_tokens: int, eos_id: int | None):
    clock = Clock(prompt_ids.device)
    t0 = clock()
    out = model.generate(prompt_ids, **greedy_generate_args(prompt_ids, max_new_tokens, eos_id))
    return out[0, prompt_ids.shape[1]:].tolist(), clock() - t0


class HFStaticCompiled:
    """transformers' own fast path, as a GPU user runs it: ``generate`` over a ``StaticCache`` with
    its decode forward compiled (``compile_config``; on CUDA transformers' default, reduce-overhead,
    i.e. CUDA graphs). One cache, sized for the longest request and reset between requests, so its
    tensors keep their addresses (a new cache per call would re-record the CUDA graphs) and its
    shape never changes (no recompilation). Prefill runs eagerly, as transformers does.

    ``backend``: torch.compile's backend ("inductor"; a test may pass "eager" to exercise the wiring
    without code generation). ``compile_s``: seconds spent in the untimed warm-up calls."""

    name = "hf_static_compiled"

    def __init__(self, model, max_cache_len: int, backend: str = "inductor"):
        from transformers import StaticCache
        from transformers.generation.configuration_utils import CompileConfig
        self.model, self.max_cache_len = model, max_cache_len
        cuda = model.device.type == "cuda"
        self.compile_config = CompileConfig(mode="reduce-overhead" if cuda else "default", backend=backend)
        # transformers compiles on its accelerator list only; elsewhere (a CPU test) it has to be asked
        self.compile_config._compile_all_devices = not cuda
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        # transformers >= 5.25 names generate's cache argument ``cache`` (``past_key_values`` deprecated)
        import inspect
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.compile_s = 0.0
        # Compiles and CUDA-graph recordings are counted process-wide; what this side caused is
        # kept here, so a runtime timed beside it is not billed for them (and vice versa).
        self.warmup = dict.fromkeys(self.COUNTERS, 0)
        self.timed = dict.fromkeys(self.COUNTERS, 0)

    COUNTERS = ("graphs_compiled", "cudagraph_skips", "cudagraph_captures")

    def _counters(self) -> dict:
        from specee.runtime.compiled import compiled_graphs, cudagraph_captures, cudagraph_skips
        return {"graphs_compiled": compiled_graphs(), "cudagraph_skips": cudagraph_skips(),
                "cudagraph_captures": cudagraph_captures(self.model.device) or 0}

    def _count(self, into: dict, before: dict) -> None:
        after = self._counters()
        for k in self.COUNTERS:
            into[k] += after[k] - before[k]

    def describe(self) -> dict:
        return {"cache_implementation": "static", "max_cache_len": self.max_cache_len,
                "compile_mode": self.compile_config.mode, "backend": self.compile_config.backend,
                "compile_s": self.compile_s, **{f"{k}_in_warmup": v for k, v in self.warmup.items()},
                **{f"{k}_in_timed_runs": v for k, v in self.timed.items()}}

    def fits(self, prompt_ids, max_new_tokens: int) -> bool:
        return prompt_ids.shape[1] + max_new_tokens <= self.max_cache_len

    def grow(self, need: int) -> None:
        """A longer request (a later conversation turn): a new cache, to be warmed before it is timed."""
        from transformers import StaticCache
        self.max_cache_len = need
        self.cache = StaticCache(config=self.model.config, max_cache_len=need)

    def _args(self, prompt_ids, max_new_tokens: int, eos_id) -> dict:
        if prompt_ids.shape[1] + max_new_tokens > self.max_cache_len:
            from specee.errors import SpeceeError
            raise SpeceeError(f"HF static cache holds {self.max_cache_len} tokens; this request needs "
                              f"{prompt_ids.shape[1] + max_new_tokens}")
        self.cache.reset()
        args = {**greedy_generate_args(prompt_ids, max_new_tokens, eos_id), self._cache_arg: self.cache,
                "compile_config": self.compile_config}
        return args

    @torch.inference_mode()
    def _generate(self, prompt_ids, max_new_tokens: int, eos_id):
        args = self._args(prompt_ids, max_new_tokens, eos_id)
        clock = Clock(prompt_ids.device)
        t0 = clock()
        out = self.model.generate(prompt_ids, **args)
        return out[0, prompt_ids.shape[1]:].tolist(), clock() - t0

    def generate(self, prompt_ids, max_new_tokens: int, eos_id):
        """One timed request: (tokens, seconds), as :func:`hf_generate`."""
        before = self._counters()
        out = self._generate(prompt_ids, max_new_tokens, eos_id)
        self._count(self.timed, before)
        return out

    def warm(self, prompt_ids, max_new_tokens: int, eos_id, rounds: int = 2) -> None:
        """Untimed calls that compile (and on CUDA record) the decode graph before the clock starts;
        a second round replays what the first recorded, as reduce-overhead needs a warm-up call."""
        import time
        before, t0 = self._counters(), time.perf_counter()
        for _ in range(rounds):
            self._generate(prompt_ids, max_new_tokens, eos_id)
        self.compile_s += time.perf_counter() - t0
        self._count(self.warmup, before)


def strongest_dense(candidates: dict) -> dict | None:
    """The fastest dense baseline timed in this job, by end-to-end tokens/s (prefill included: the
    only figure transformers' ``generate`` yields), with every candidate it was chosen from."""
    timed = {k: v for k, v in candidates.items() if v}
    if not timed:
        return None
    name = max(timed, key=timed.get)
    return {"name": name, "tokens_per_s": timed[name], "candidates": timed}


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def match_rate(ref: list[list[int]], out: list[list[int]]) -> float:
    """Share of positions where the two outputs agree (lengths differing count as mismatches)."""
    same = total = 0
    for a, b in zip(ref, out):
        same += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
    return same / total if total else float("nan")


def speed_metrics(gens: list[Generation], num_layers: int) -> dict:
    decode_tokens = sum(len(g.tokens) - 1 for g in gens)
    decode_s = sum(g.decode_s for g in gens)
    total_s = sum(g.prefill_s + g.decode_s for g in gens)
    lat = [t * 1e3 for g in gens for t in g.token_s[1:]]
    layers = [l for g in gens for l in g.layers_run[1:]]
    return {
        "generated_tokens": sum(len(g.tokens) for g in gens),
        "tokens_per_s": sum(len(g.tokens) for g in gens) / total_s,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else float("nan"),
        "prefill_ms_mean": 1e3 * statistics.fmean(g.prefill_s for g in gens),
        "latency_ms_per_token": {"mean": statistics.fmean(lat) if lat else float("nan"),
                                 "p50": percentile(lat, 50), "p90": percentile(lat, 90),
                                 "p99": percentile(lat, 99)},
        "num_layers": num_layers,
        "avg_layers": statistics.fmean(layers) if layers else float(num_layers),
        "decode_s": decode_s,
    }


def paired_speedup_ci(rows: list[dict], n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> list[float]:
    """Bootstrap interval over prompts of the decode-throughput ratio mode/dense.

    ``rows``: per-prompt (and per-repeat) records with the mode's and dense's decoded tokens and
    seconds, measured side by side. Prompts are resampled with replacement (all of a prompt's
    repeats and turns travel together) and the ratio of summed throughputs recomputed."""
    import random
    by_prompt: dict = {}
    for r in rows:
        acc = by_prompt.setdefault(r["id"], [0.0, 0.0, 0.0, 0.0])
        acc[0] += r["tokens"] - 1
        acc[1] += r["decode_s"]
        acc[2] += r["dense_tokens"] - 1
        acc[3] += r["dense_decode_s"]
    groups = list(by_prompt.values())
    if not groups:
        return [float("nan"), float("nan")]
    rng = random.Random(seed)
    ratios = []
    for _ in range(n_boot):
        pick = [groups[rng.randrange(len(groups))] for _ in groups]
        t, s, dt, ds = (sum(g[i] for g in pick) for i in range(4))
        if s > 0 and ds > 0 and dt > 0:
            ratios.append((t / s) / (dt / ds))
    if not ratios:
        return [float("nan"), float("nan")]
    ratios.sort()
    lo = ratios[int((1 - level) / 2 * (len(ratios) - 1))]
    hi = ratios[int((1 + level) / 2 * (len(ratios) - 1))]
    return [lo, hi]


def noisy_reasons(m: dict, mode: str, load_before: dict, load_after: dict, multi_token: bool = False) -> list[str]:
    """Why a speed result cannot be trusted as a measurement (empty: nothing found).
    ``multi_token``: the mode emits several tokens per step (tree decoding), where an efficiency
    above 1 is what speculation buys, not a measurement error."""
    reasons = []
    lo, hi = m.get("speedup_vs_dense_ci", [float("nan")] * 2)
    from specee.decoding import modes
    if modes.spec(mode).reference and not lo <= 1.0 <= hi:
        reasons.append(f"dense against itself gave {m['speedup_vs_dense']:.3f} with 95% interval "
                       f"[{lo:.3f}, {hi:.3f}], which excludes 1")
    if not multi_token and (m.get("efficiency") or 0) > 1.0:
        reasons.append(f"efficiency {m['efficiency']:.3f} > 1: faster than skipping layers allows")
    for when, load in (("before", load_before), ("after", load_after)):
        if load.get("busy"):
            reasons.append(f"machine busy {when} the run (other processes' CPU share "
                           f"{load.get('other_cpu_share')}, load average {load.get('loadavg_1min')}"
                           + (f", GPU utilisation {load['gpu_utilization_pct']}%" if load.get("gpu_utilization_pct") else "")
                           + ")")
    return reasons


def time_sides(sides: dict, ids, max_new_tokens: int, eos_id, interleave: str, slot: int, seed: int) -> dict:
    """One request through every side, paired. Decoders with steps advance in lockstep when
    ``interleave`` is step (:func:`generate_lockstep`); a side that runs a whole request at once
    (transformers' generate) runs before them on even slots and after them on odd ones, so no side
    always follows another. With ``interleave`` request every side runs whole, in an order that
    reverses every slot."""
    from specee.decoding.base import generate_lockstep
    stepped = [k for k, d in sides.items() if hasattr(d, "step")]
    whole = [k for k in sides if k not in stepped]
    if interleave != "step" or len(stepped) < 2:
        names = list(sides) if slot % 2 == 0 else list(sides)[::-1]
        return {k: sides[k].generate(ids, max_new_tokens, eos_id) for k in names}
    out = {}
    if slot % 2 == 0:
        out.update({k: sides[k].generate(ids, max_new_tokens, eos_id) for k in whole})
    out.update(zip(stepped, generate_lockstep([sides[k] for k in stepped], ids, max_new_tokens, eos_id,
                                              flip=slot % 2 == 1, seed=seed + slot)))
    if slot % 2 == 1:
        out.update({k: sides[k].generate(ids, max_new_tokens, eos_id) for k in whole[::-1]})
    return out


def peer_metrics(peer, peer_gens, peer_rows: list[dict], dense_gens, mode_gens, num_layers: int, seed: int) -> dict:
    """The transformers peer timed in the same job: its own speed and tau, its tokens against dense
    and against the mode, and the mode's speed against it with a paired interval over prompts."""
    from specee.decoding.tree import mean_accepted_length
    p = speed_metrics(peer_gens, num_layers)
    d = speed_metrics(dense_gens, num_layers)
    m = speed_metrics(mode_gens, num_layers)
    tau_peer = mean_accepted_length(peer_gens)
    tau_mode = mean_accepted_length(mode_gens) if any("accepted" in t for g in mode_gens for t in g.trace) else None
    return {**peer.describe(), "name": peer.name,
            "decode_tokens_per_s": p["decode_tokens_per_s"], "ms_per_token": 1e3 / p["decode_tokens_per_s"],
            "speedup_vs_dense": p["decode_tokens_per_s"] / d["decode_tokens_per_s"],
            "mode_speedup_vs_peer": m["decode_tokens_per_s"] / p["decode_tokens_per_s"],
            "mode_speedup_vs_peer_ci": paired_speedup_ci(peer_rows, seed=seed),
            "mean_accepted_length": tau_peer,
            "mode_over_peer_accepted_length": (tau_mode / tau_peer) if tau_mode and tau_peer else None,
            "match_rate_vs_dense": match_rate([g.tokens for g in dense_gens], [g.tokens for g in peer_gens]),
            "identical_to_mode_share": sum(r["peer_identical"] for r in peer_rows) / max(len(peer_rows), 1)}


def speculation_sources(gens, num_layers: int) -> dict:
    """SpecEE with prompt-lookup speculation: how often each source (the prompt, the draft) gave
    the speculative set, and how often a step it served left the stack early."""
    trace = [t for g in gens for t in g.trace]
    out = {"steps": len(trace)}
    for source in ("prompt", "draft"):
        steps = [t for t in trace if t.get("spec_source") == source]
        out[source] = {"share": len(steps) / max(len(trace), 1),
                       "exit_rate": sum(t["exit_layer"] < num_layers - 1 for t in steps) / len(steps) if steps else None,
                       "avg_layers": sum(t["exit_layer"] + 1 for t in steps) / len(steps) if steps else None}
    out["draft_calls_per_token"] = sum(t.get("draft_calls", 1) for t in trace) / max(len(trace), 1)
    return out


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


def print_summary(name: str, m: dict, d: dict, runtime_kind: str | None = None) -> None:
    """A speed result in a few lines: throughput, layers, speedups, the cost model and the
    bandwidth floor. ``runtime_kind``: set when eager dense ran beside a compiled runtime."""
    print(f"{name}: {m['tokens_per_s']:.1f} tok/s, avg_layers {m['avg_layers']:.2f}/"
          f"{m['num_layers']}, speedup_vs_dense {m['speedup_vs_dense']:.3f} "
          f"[{m['speedup_vs_dense_ci'][0]:.3f}, {m['speedup_vs_dense_ci'][1]:.3f}], "
          f"match {m['match_rate_vs_dense']:.3f}"
          + (f", hf_generate_ratio {m['hf_generate_ratio']:.3f}" if "hf_generate_ratio" in m else "")
          + (f", speedup_vs_hf_generate {m['speedup_vs_hf_generate']:.3f}" if m["speedup_vs_hf_generate"] else "")
          + (f", speedup_vs_eager_dense {m['speedup_vs_eager_dense']:.3f} (runtime {runtime_kind}; "
             f"{m['runtime']['compile_s']:.1f} s compiling, {m['runtime']['graphs_compiled_in_timed_runs']} "
             "graphs compiled while timed)" if runtime_kind else ""))
    if m.get("strongest_dense_baseline"):
        sb = m["strongest_dense_baseline"]
        print(f"strongest dense baseline timed here: {sb['name']} {sb['tokens_per_s']:.1f} tok/s (of "
              + ", ".join(f"{k} {v:.1f}" for k, v in sb["candidates"].items())
              + f"); this mode against it {m['speedup_vs_strongest_dense']:.3f}"
              + (f", against HF static-compiled {m['speedup_vs_hf_static_compiled']:.3f}"
                 if m.get("speedup_vs_hf_static_compiled") else ""))
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
