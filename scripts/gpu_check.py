"""The project's GPU check: one command, on one NVIDIA GPU with no network, within a hard time
budget, writing one summary under reports/gpu/<date>_<gpu>/ (summary.md + summary.json).

    python scripts/gpu_check.py                 # default budget 7.5 minutes, plan printed first
    python scripts/gpu_check.py --budget-min 6  --out reports/gpu
    python scripts/gpu_check.py --plan          # print the plan and exit
    python scripts/gpu_check.py --dry-run       # every step at minimal size on the CPU (tiny, 3 tokens)

Steps run in order of value: first the float16/bfloat16 tree steps that once hit "misaligned
address" (the fix has not run on a GPU yet), then the Llama-2-7B shape (random weights, fp16,
exits replayed from the paper-like profile): the dense baselines side by side in one job (HF
``generate`` eager and static-compiled, dense eager and graphed), T1+T2 eager, graphed (decisions
read back behind the next layer: runtime.exit_control=lookahead) and device-resident
(runtime.exit_control=device: recorded as skipped, with the reason, on a torch without CUDA-graph
conditional nodes), EAGLE graphed and T1+T2+T3 graphed. Each step is a separate `run.py` job whose
timeout is its cap cut to what is left of the budget: a broken step is recorded with its error and
the next one runs; a step that cannot start with at least MIN_STEP_S left is recorded as skipped.
The steps share one inductor cache folder, so a later step reuses an earlier one's compiled kernels.
Every graphed job warms each cache bucket and the interleaved call pattern before its clock starts;
a CUDA graph recorded while timed fails the step's GPU-only check.

The summary carries the goal table of issue 41 (measured beside each goal) and, per step, what
only a GPU can tell ("GPU-only checks"), each with its verdict. Bit-identity is a CPU-only
guarantee: on a GPU, compiled vs eager and tree vs one-token decoding are reported as match rates.

What the GPU machine needs beyond its image (torch 2.11, transformers 5.17): the project's
pure-Python dependencies, carried as wheels and installed with ``pip install --no-deps``:
hydra-core 1.3.8, omegaconf 2.3.1, antlr4-python3-runtime 4.9.3 (Hydra's parser), and
transformers >= 5.20 (the project's floor; 5.25 ran here before). lm-eval is not needed: no step
runs an accuracy task.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny", "model.device=cuda", "dataset.categories=[writing,qa,math_reasoning,translation]",
        "dataset.max_new_tokens=48"]
REPLAY = "early_exit.replay=specee/artifacts/paper_like_32l_exit_profile"
PAPER_PLACEMENT = "placement.profile_path=specee/artifacts/paper_like_32l_exit_profile"
CUDAGRAPHS = ["runtime=compiled", "runtime.compile_mode=reduce-overhead", "runtime.cache_bucket=256"]
HF_STATIC = "experiment.hf_static_compiled=true"  # transformers' static cache + compiled decode, same job
MIN_STEP_S = 20  # a step that cannot get this long is skipped, not started
RESERVE_S = 5  # kept back from the budget for writing the summary
DRY_RUN = False  # set by --dry-run: the CUDA-graph verdicts cannot apply on the CPU
DRY_RUN_STEP_S = 900  # a step's timeout in a dry run (a CPU compiles tiny's graphs in about a minute)


def big(name: str) -> list[str]:
    return [f"model={name}", "model.init=random", "model.device=cuda", "model.dtype=float16",
            "dataset.categories=[writing,qa]", "dataset.max_new_tokens=48", "experiment.cost_rounds=3"]


def conditional_nodes_missing() -> str | None:
    """Why runtime.exit_control=device cannot run on this machine's GPU (None: it can)."""
    from specee.device_walk import conditional_nodes_problem
    return conditional_nodes_problem("cuda")


# (name, overrides, cap s[, why-skipped check]), most valuable first: the tree steps whose fix
# never ran on a GPU, then what only this hardware can measure at the paper's shape. The caps sum
# past the default budget: the last steps run on what earlier ones leave.
STEPS = [
    ("tiny_eagle_float16", ["experiment=speed", *TINY, "model.dtype=float16", "ablation=eagle"], 45),
    ("tiny_specee_full_bfloat16", ["experiment=speed", *TINY, "model.dtype=bfloat16", "ablation=specee_full"], 45),
    # HF generate eager + static-compiled, dense eager (beside the runtime) and dense graphed: one job
    ("llama2_7b_dense_baselines", ["experiment=speed", *big("llama2_7b"), "ablation=dense", *CUDAGRAPHS, HF_STATIC],
     110),
    ("llama2_7b_t1_t2_eager", ["experiment=speed", *big("llama2_7b"), "ablation=specee_t1_t2", REPLAY,
                               PAPER_PLACEMENT], 60),
    ("llama2_7b_t1_t2_graphed", ["experiment=speed", *big("llama2_7b"), "ablation=specee_t1_t2", REPLAY,
                                 PAPER_PLACEMENT, *CUDAGRAPHS, "runtime.exit_control=lookahead", HF_STATIC], 100),
    ("llama2_7b_t1_t2_device", ["experiment=speed", *big("llama2_7b"), "ablation=specee_t1_t2", REPLAY,
                                PAPER_PLACEMENT, *CUDAGRAPHS, "runtime.exit_control=device", HF_STATIC], 100,
     conditional_nodes_missing),
    ("llama2_7b_eagle_graphed", ["experiment=speed", *big("llama2_7b"), "ablation=eagle", *CUDAGRAPHS], 80),
    ("llama2_7b_t1_t2_t3_graphed", ["experiment=speed", *big("llama2_7b"), "ablation=specee_full", REPLAY,
                                    PAPER_PLACEMENT, *CUDAGRAPHS], 80),
]


def dry_run(overrides: list[str]) -> list[str]:
    """A step's overrides at minimal size on the CPU: the same recipe, mode, runtime, exit control
    and replay, on tiny (32 layers, Llama-2-7B proportions, so the 32-layer exit profile fits),
    one prompt, 3 new tokens, torch.compile's eager backend for transformers' compiled path."""
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "model":
            out.append("model=tiny")
        elif key in ("model.init", "experiment.cost_rounds"):
            continue
        elif key == "model.device":
            out.append("model.device=cpu")
        elif key == "model.dtype" and value != "float32":
            out.append("model.dtype=float32")  # CPU kernels for half types are not what is checked here
        elif key == "dataset.categories":
            out.append("dataset.categories=[writing]")
        elif key == "dataset.max_new_tokens":
            out.append("dataset.max_new_tokens=3")
        else:
            out.append(o)
    return out + ["dataset.count=1", "experiment.cost_rounds=0", "experiment.hf_static_compiled_backend=eager"]


KEYS = ["tokens_per_s", "decode_tokens_per_s", "walk_syncs_per_token", "speedup_vs_hf_generate",
        "speedup_vs_hf_static_compiled", "hf_static_compiled_tokens_per_s", "strongest_dense_baseline",
        "speedup_vs_strongest_dense", "hf_generate_tokens_per_s", "hf_static_compiled", "latency_ms_per_token", "avg_layers", "replay_target_avg_layers", "speedup_vs_dense",
        "match_rate_vs_dense", "hf_generate_ratio", "efficiency", "overhead_share", "draft_share",
        "syncs_per_token", "time_split_method", "time_split_coverage", "energy", "speedup_vs_eager_dense",
        "ms_per_token_over_limit", "bandwidth_bound", "runtime", "noisy_reasons", "mean_accepted_length",
        "machine_load_before"]


def plan(steps, budget_s: float) -> list[dict]:
    """Each step's cap and where it starts if every earlier step uses its whole cap: steps past the
    budget then run only on time that earlier steps leave."""
    rows, at = [], 0.0
    for name, _, cap, *_ in steps:
        fits = at + cap <= budget_s
        rows.append({"step": name, "cap_s": cap, "start_at_worst_s": at, "fits_at_worst": fits})
        at += cap
    return rows


def print_plan(rows: list[dict], budget_s: float) -> None:
    print(f"GPU check plan: hard budget {budget_s:.0f} s ({RESERVE_S} s kept for the summary), steps in order:")
    for r in rows:
        note = "" if r["fits_at_worst"] else "  (runs only on time earlier steps leave)"
        print(f"  {r['step']:40s} cap {r['cap_s']:4d} s, starts by {r['start_at_worst_s']:5.0f} s{note}")
    print(flush=True)


def device_info() -> dict:
    import torch
    info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
        try:
            import pynvml
            pynvml.nvmlInit()
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as err:  # noqa: BLE001 - the summary says why
            info["driver"] = f"unavailable ({err})"
    return info


def gpu_only_checks(name: str, overrides: list[str], m: dict) -> list[dict]:
    """What a CPU cannot show, read from one step's metrics, each with a verdict: ``fail`` fails the
    step; ``report`` is a figure to read, not a pass/fail (GPU numerics are not bit-exact)."""
    rt = m.get("runtime") or {}
    checks = []
    if "runtime.compile_mode=reduce-overhead" in overrides and DRY_RUN:
        checks.append({"check": "CUDA graphs captured, none recorded while timed", "verdict": "report",
                       "value": "not checked: a dry run on the CPU has no CUDA graphs"})
    elif "runtime.compile_mode=reduce-overhead" in overrides:
        skips = (rt.get("cudagraph_skips_in_warmup") or 0) + (rt.get("cudagraph_skips_in_timed_runs") or 0)
        captures = rt.get("cudagraph_captures_in_warmup")
        ok = skips == 0 and bool(captures)
        checks.append({"check": "CUDA graphs captured, none skipped", "verdict": "pass" if ok else "fail",
                       "value": f"captures {captures} (warm-up), {rt.get('cudagraph_captures_in_timed_runs')} "
                                f"(timed); skips {skips}; compiled calls timed {rt.get('compiled_calls_in_timed_runs')}"})
        timed = rt.get("cudagraph_captures_in_timed_runs")
        checks.append({"check": "no CUDA graph recorded while timed (every bucket warmed first)",
                       "verdict": "pass" if timed == 0 else "fail", "value": timed})
        if rt.get("fallback"):
            checks.append({"check": "compiled runtime did not fall back", "verdict": "fail", "value": rt["fallback"]})
    if rt.get("kind") == "compiled":
        timed = rt.get("graphs_compiled_in_timed_runs")
        checks.append({"check": "nothing compiled while timed", "verdict": "pass" if timed == 0 else "fail",
                       "value": f"{timed} graph(s) timed, {rt.get('graphs_compiled_in_warmup')} in warm-up, "
                                f"{rt.get('graphs_compiled_between_turns', 0)} between turns"})
        eager = (m.get("eager_dense") or {}).get("identical_to_runtime_dense_share")
        checks.append({"check": "compiled vs eager dense identical (share of prompts)", "verdict": "report",
                       "value": eager})
    hs = m.get("hf_static_compiled")
    if hs:
        n = (hs.get("graphs_compiled_in_timed_runs") or 0) + (hs.get("cudagraph_captures_in_timed_runs") or 0)
        checks.append({"check": "HF static-compiled: nothing compiled or recorded while timed",
                       "verdict": "pass" if n == 0 else "fail",
                       "value": f"{hs.get('graphs_compiled_in_warmup')} graph(s), {hs.get('cudagraph_captures_in_warmup')} "
                                f"CUDA graph(s) in warm-up ({hs.get('compile_s', 0):.0f} s); {n} while timed; "
                                f"tokens identical to dense: {hs.get('identical_share')}"})
    if m.get("match_rate_vs_dense") is not None and "ablation=dense" not in overrides:
        checks.append({"check": "match rate vs dense", "verdict": "report", "value": m.get("match_rate_vs_dense")})
    if m.get("syncs_per_token") is not None:
        checks.append({"check": "host syncs per token (all counted, H2D copies included)", "verdict": "report",
                       "value": m["syncs_per_token"]})
    e = m.get("energy") or {}
    if e.get("available"):
        n = e.get("min_counter_updates_per_window")
        checks.append({"check": "energy: ≥10 counter updates per window", "verdict": "report" if n is None else
                       ("pass" if n >= 10 else "report"),
                       "value": f"{e.get('windows')} window(s), {e.get('counter_updates')} updates, min {n}/window"})
    else:
        checks.append({"check": "energy measured", "verdict": "report", "value": e.get("reason")})
    load = m.get("machine_load_before") or {}
    if "gpu_utilization_pct" in load:
        checks.append({"check": "GPU in use idle before timing (this GPU, by UUID)", "verdict": "report",
                       "value": load["gpu_utilization_pct"]})
    return checks


def figures(m: dict) -> dict:
    """The few ratios the goal table reads, from one step's full metrics."""
    hf = m.get("hf_generate_tokens_per_s")
    eager = (m.get("eager_dense") or {}).get("tokens_per_s")
    if eager is None and (m.get("runtime") or {}).get("kind") == "eager":
        eager = (m.get("dense") or {}).get("tokens_per_s")
    sb = m.get("strongest_dense_baseline") or {}
    return {"speedup_vs_dense": m.get("speedup_vs_dense"), "speedup_vs_hf_generate": m.get("speedup_vs_hf_generate"),
            "speedup_vs_hf_static_compiled": m.get("speedup_vs_hf_static_compiled"),
            "speedup_vs_strongest_dense": m.get("speedup_vs_strongest_dense"), "strongest_dense": sb.get("name"),
            "dense_eager_vs_hf_generate": eager / hf if eager and hf else None,
            "walk_syncs_per_token": m.get("walk_syncs_per_token")}


# Issue 41's goal table: (figure, goal, test of the measured value, the steps it reads, how).
def _first(by, key, steps):
    for name in steps:
        v = (by.get(name) or {}).get(key)
        if v is not None:
            return v, name
    return None, None


def _best(by, key, steps):
    vals = [((by.get(n) or {}).get(key), n) for n in steps]
    vals = [v for v in vals if v[0] is not None]
    return max(vals) if vals else (None, None)


def _ratio(by, key, steps):
    x, y = ((by.get(n) or {}).get(key) for n in steps)
    return (x / y, f"{steps[0]} / {steps[1]}, each against its own graphed dense") if x and y else (None, None)


T12 = ("llama2_7b_t1_t2_eager", "llama2_7b_t1_t2_graphed", "llama2_7b_t1_t2_device")
GOALS = [
    ("eager dense vs HF generate eager", "≥ 1.0×", lambda v: v >= 1.0,
     _first, "dense_eager_vs_hf_generate", ("llama2_7b_t1_t2_eager", "llama2_7b_dense_baselines")),
    ("T1+T2 graphed vs dense graphed", "≥ 1.20× (layer ratio 1.30×)", lambda v: v >= 1.20,
     _first, "speedup_vs_dense", ("llama2_7b_t1_t2_graphed",)),
    ("T1+T2 device-resident vs dense graphed", "≥ 1.25×", lambda v: v >= 1.25,
     _first, "speedup_vs_dense", ("llama2_7b_t1_t2_device",)),
    ("best T1+T2 vs HF generate eager (the paper's metric)", "≥ 1.27×", lambda v: v >= 1.27,
     _best, "speedup_vs_hf_generate", T12),
    ("best T1+T2 vs HF static-compiled generate", "> 1.0×, stated either way", lambda v: v > 1.0,
     _best, "speedup_vs_hf_static_compiled", T12),
    ("best T1+T2 vs the strongest dense baseline of its job", "> 1.0×", lambda v: v > 1.0,
     _best, "speedup_vs_strongest_dense", T12),
    ("T1+T2+T3 graphed vs EAGLE graphed", "≥ 1.0× (paper: 1.05×)", lambda v: v >= 1.0,
     _ratio, "speedup_vs_dense", ("llama2_7b_t1_t2_t3_graphed", "llama2_7b_eagle_graphed")),
    ("host round trips per token in the walk, device-resident", "0", lambda v: v == 0,
     _first, "walk_syncs_per_token", ("llama2_7b_t1_t2_device",)),
]


def goals(rows: list[dict]) -> list[dict]:
    """Each goal with its measured value, the step it came from, and met / missed / not measured (why)."""
    by = {r["step"]: r.get("figures") or {} for r in rows}
    why = {r["step"]: (r.get("skipped_why") or r.get("error") or "").strip() for r in rows}
    out = []
    for figure, goal, ok, read, key, steps in GOALS:
        value, source = read(by, key, steps)
        row = {"figure": figure, "goal": goal, "measured": value, "from": source}
        if value is None:
            reasons = [f"{n}: {why[n].splitlines()[-1]}" for n in steps if why.get(n)]
            row["verdict"] = "not measured" + (f" ({'; '.join(reasons)})" if reasons else
                                               f" (steps {', '.join(steps)} did not run)")
        else:
            row["verdict"] = "met" if ok(value) else "missed"
        out.append(row)
    return out


def run_step(name, overrides, timeout, out: Path, env: dict) -> dict:
    run_dir = out / name
    cmd = [sys.executable, str(ROOT / "run.py"), *overrides, f"hydra.run.dir={run_dir}", "force=true"]
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        rc, tail = res.returncode, (res.stderr or res.stdout)[-1500:]
    except subprocess.TimeoutExpired:
        rc, tail = "timeout", f"exceeded {timeout:.0f} s"
    row = {"step": name, "overrides": overrides, "rc": rc, "timeout_s": round(timeout), "seconds":
           round(time.perf_counter() - t0, 1)}
    path = run_dir / "results.json"
    if rc == 0 and path.is_file():
        doc = json.loads(path.read_text())
        m = doc["metrics"]
        row["metrics"] = {k: m[k] for k in KEYS if k in m}
        row["figures"] = figures(m)
        row["dense_energy"] = m.get("dense", {}).get("energy")
        row["synthetic"] = doc.get("synthetic", {})
        row["gpu_only_checks"] = gpu_only_checks(name, overrides, m)
        if any(c["verdict"] == "fail" for c in row["gpu_only_checks"]):
            row["rc"] = "check failed"
    else:
        row["error"] = tail
    return row


def fmt(x, nd=3):
    return "–" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def markdown(info: dict, rows: list[dict]) -> str:
    budget = info.get("budget_s")
    title = "dry run on the CPU (minimal sizes: checks the steps, measures nothing)" if info.get("dry_run") else \
        info.get("gpu", "no GPU")
    lines = [f"# GPU check — {title} ({info['date']})", "",
             f"GPU {info.get('gpu')} ({info.get('memory_gib')} GiB), driver {info.get('driver')}, CUDA "
             f"{info.get('cuda')}, torch {info['torch']}. Command: `python scripts/gpu_check.py`; each row is one "
             "`run.py experiment=speed` job (its results.json beside this file). Rows on `model.init=random` "
             "shapes use random weights and, where stated, replayed exits: they measure cost, not quality.", "",
             f"Budget: {fmt(budget, 0)} s hard, {fmt(info.get('used_s'), 0)} s used; steps in order of value "
             "(the unconfirmed tree fixes, then the 7B shape).", "",
             "| step | rc | s (cap) | tok/s | ms/token p50 | avg layers (target) | speedup vs dense | hf_generate_ratio | "
             "efficiency | overhead | draft | syncs/token | J/token (dense) | energy windows (updates) | "
             "graphs timed | CUDA graphs (skips) | × bandwidth floor | vs eager dense |",
             "|---" * 18 + "|"]
    for r in rows:
        m = r.get("metrics", {})
        e, de = m.get("energy") or {}, r.get("dense_energy") or {}
        rt = m.get("runtime") or {}
        lat = (m.get("latency_ms_per_token") or {}).get("p50")
        layers = fmt(m.get("avg_layers"), 2) + (f" ({m['replay_target_avg_layers']:.2f})"
                                                if m.get("replay_target_avg_layers") else "")
        joules = (f"{e['joules_per_token']:.3f} ({de.get('joules_per_token') or float('nan'):.3f})"
                  if e.get("available") and e.get("joules_per_token") else "–")
        windows = f"{e.get('windows')} ({e.get('counter_updates')})" if e.get("available") else "–"
        graphs = (f"{rt.get('cudagraph_captures_in_warmup')}+{rt.get('cudagraph_captures_in_timed_runs')} "
                  f"({(rt.get('cudagraph_skips_in_warmup') or 0) + (rt.get('cudagraph_skips_in_timed_runs') or 0)})"
                  if rt.get("cudagraphs") else "–")
        lines.append(f"| {r['step']} | {r['rc']} | {r.get('seconds', '–')} ({r.get('timeout_s', '–')}) | "
                     f"{fmt(m.get('decode_tokens_per_s'), 1)} | "
                     f"{fmt(lat, 2)} | {layers} | {fmt(m.get('speedup_vs_dense'))} | {fmt(m.get('hf_generate_ratio'))} | "
                     f"{fmt(m.get('efficiency'))} | {fmt(m.get('overhead_share'))} | {fmt(m.get('draft_share'))} | "
                     f"{fmt(m.get('syncs_per_token'), 1)} | {joules} | {windows} | "
                     f"{fmt(rt.get('graphs_compiled_in_timed_runs'))} | {graphs} | "
                     f"{fmt(m.get('ms_per_token_over_limit'), 2)} | {fmt(m.get('speedup_vs_eager_dense'))} |")
    lines += ["", "## Goals (issue 41)", "",
              "Llama-2-7B shape, fp16, batch 1, exits replayed from the paper-like profile; ratios of end-to-end "
              "tokens/s against HF generate, decode tokens/s against dense (paired, same job).", "",
              "| figure | measured | goal | verdict | from |", "|---|---|---|---|---|"]
    for g in goals(rows):
        lines.append(f"| {g['figure']} | {fmt(g['measured'])} | {g['goal']} | {g['verdict']} | {g['from'] or '–'} |")
    baselines = [(r["step"], (r.get("metrics") or {}).get("strongest_dense_baseline")) for r in rows]
    baselines = [(n, b) for n, b in baselines if b]
    if baselines:
        lines += ["", "## Dense baselines timed in each job (end-to-end tokens/s)", ""]
        lines += [f"- `{n}`: strongest {b['name']} {b['tokens_per_s']:.1f}; "
                  + ", ".join(f"{k} {v:.1f}" for k, v in b["candidates"].items()) for n, b in baselines]
    checked = [r for r in rows if r.get("gpu_only_checks")]
    if checked:
        lines += ["", "## GPU-only checks", "",
                  "What the CPU suite cannot pin. `fail` fails the step; `report` is a figure to read (on a GPU, "
                  "compiled vs eager and tree vs one-token decoding are not bit-identical: match rates, not "
                  "failures).", ""]
        for r in checked:
            for c in r["gpu_only_checks"]:
                lines.append(f"- `{r['step']}` — {c['check']}: **{c['verdict']}** ({fmt(c['value'])})")
    noisy = [r for r in rows if (r.get("metrics") or {}).get("noisy_reasons")]
    if noisy:
        lines += ["", "## Marked noisy", ""]
        lines += [f"- `{r['step']}`: {'; '.join(r['metrics']['noisy_reasons'])}" for r in noisy]
    skipped = [r for r in rows if r.get("skipped_why")]
    if skipped:
        lines += ["", "## Skipped on this machine", ""]
        lines += [f"- `{r['step']}`: {r['skipped_why']}" for r in skipped]
    errors = [r for r in rows if "error" in r]
    if errors:
        lines += ["", "## Failed or skipped steps", ""]
        lines += [f"- `{r['step']}` ({r['rc']}): `{r['error'].strip().splitlines()[-1] if r['error'].strip() else ''}`"
                  for r in errors]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-min", type=float, default=7.5)
    ap.add_argument("--out", default=str(ROOT / "reports" / "gpu"))
    ap.add_argument("--plan", action="store_true", help="print the plan and exit")
    ap.add_argument("--dry-run", action="store_true", help="every step at minimal size on the CPU (tiny, one "
                    "prompt, 3 tokens): the overrides, the recipes and this script's own code, without a GPU")
    ap.add_argument("--steps", default="", help="comma-separated step names to run (default: all), e.g. to "
                    "rerun the ones that failed")
    args = ap.parse_args()
    names = [n for n in args.steps.split(",") if n]
    unknown = sorted(set(names) - {step[0] for step in STEPS})
    if unknown:
        ap.error(f"unknown step(s) {unknown}; valid: {[step[0] for step in STEPS]}")
    steps = [s for s in STEPS if not names or s[0] in names]
    global DRY_RUN
    DRY_RUN = args.dry_run
    t_start = time.perf_counter()
    budget_s = 60 * args.budget_min
    deadline = t_start + budget_s - RESERVE_S
    steps_plan = plan(steps, budget_s - RESERVE_S)
    print_plan(steps_plan, budget_s)
    if args.plan:
        return 0
    info = device_info()
    info["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    info["budget_s"] = budget_s
    info["dry_run"] = args.dry_run
    tag = f"{info['date']}_{'dry_run_cpu' if args.dry_run else str(info.get('gpu', 'nogpu')).replace(' ', '_')}"
    out = Path(args.out) / tag
    out.mkdir(parents=True, exist_ok=True)
    # One inductor/triton cache for every step: later processes reuse compiled kernels.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(out / "inductor_cache")}
    rows = []
    for name, overrides, cap, *skip in steps:
        left = deadline - time.perf_counter()
        # Skip checks ask about the GPU; a dry run still calls them (their code is checked) and runs
        # the step on the CPU, where it needs no GPU feature.
        why = skip[0]() if skip else None
        if args.dry_run:
            overrides = dry_run(overrides)
        if why and not args.dry_run:
            rows.append({"step": name, "overrides": overrides, "rc": "skipped", "seconds": 0, "timeout_s": 0,
                         "skipped_why": why})
        elif left < MIN_STEP_S and not args.dry_run:  # a dry run checks every step, on no budget
            rows.append({"step": name, "rc": "skipped", "seconds": 0, "timeout_s": 0,
                         "error": f"time budget spent ({left:.0f} s left of {budget_s:.0f} s)"})
        else:
            rows.append(run_step(name, overrides, DRY_RUN_STEP_S if args.dry_run else min(cap, left), out, env))
            if why:
                rows[-1]["on_a_gpu_here"] = f"would be skipped: {why}"
        print(f"{name}: rc {rows[-1]['rc']} in {rows[-1]['seconds']} s "
              f"({time.perf_counter() - t_start:.0f} s of {budget_s:.0f} s used)", flush=True)
        info["used_s"] = round(time.perf_counter() - t_start, 1)
        (out / "summary.json").write_text(json.dumps({"device": info, "plan": steps_plan, "steps": rows,
                                                     "goals": goals(rows)}, indent=1))
        (out / "summary.md").write_text(markdown(info, rows))
    print(f"wrote {out / 'summary.md'}")
    # A step skipped for a named reason (this torch lacks a feature) is a finding, not a failure.
    return 0 if all(r["rc"] == 0 or r.get("skipped_why") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
