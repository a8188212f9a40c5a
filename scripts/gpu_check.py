"""The project's GPU check: one command, on one NVIDIA GPU with no network, within a hard time
budget, writing one summary under reports/gpu/<date>_<gpu>/ (summary.md + summary.json).

    python scripts/gpu_check.py                 # default budget 7.5 minutes, plan printed first
    python scripts/gpu_check.py --budget-min 6  --out reports/gpu
    python scripts/gpu_check.py --plan          # print the plan and exit

Steps run in order of value: the real 7B/13B shapes (random weights) first, the CUDA-graph step
among them, then the committed tiny. Each step is a separate `run.py` job whose timeout is its cap
cut to what is left of the budget: a broken step is recorded with its error and the next one
runs; a step that cannot start with at least MIN_STEP_S left is recorded as skipped. The steps
share one inductor cache folder, so a later step reuses an earlier one's compiled kernels rather
than compiling them again. Needs only the project's own dependencies.

What only a GPU can tell is listed per step in the summary ("GPU-only checks"), each with its
verdict: CUDA graphs captured and not skipped, nothing compiled or captured while timed, syncs
per token, energy windows and their counter updates. Bit-identity is a CPU-only guarantee: on a
GPU, compiled vs eager and tree vs one-token decoding are reported as match rates, not failed.
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
MIN_STEP_S = 20  # a step that cannot get this long is skipped, not started
RESERVE_S = 5  # kept back from the budget for writing the summary


def big(name: str) -> list[str]:
    return [f"model={name}", "model.init=random", "model.device=cuda", "model.dtype=float16",
            "dataset.categories=[writing,qa]", "dataset.max_new_tokens=48"]


# (name, overrides, cap s), most valuable first: what only this hardware can measure (the paper's
# shapes, CUDA graphs) before what a CPU run already covers (tiny). Caps of the first four sum to
# the default budget's bulk; the tiny steps run on what earlier steps leave.
STEPS = [
    ("llama2_7b_random_dense", ["experiment=speed", *big("llama2_7b"), "ablation=dense"], 90),
    # static KV shapes (a bucket) so CUDA graphs can capture the layer step
    ("llama2_7b_random_dense_cudagraphs", ["experiment=speed", *big("llama2_7b"), "ablation=dense", *CUDAGRAPHS], 150),
    ("llama2_7b_random_specee_t1_t2_replay", ["experiment=speed", *big("llama2_7b"), "ablation=specee_t1_t2",
                                              REPLAY, PAPER_PLACEMENT], 90),
    ("llama2_13b_random_dense", ["experiment=speed", *big("llama2_13b"), "ablation=dense"], 90),
    # predictor + layer graphs together: the predictor's output outlives the next layer graph
    ("tiny_specee_t1_t2_float32_cudagraphs", ["experiment=speed", *TINY, "model.dtype=float32",
                                              "ablation=specee_t1_t2", *CUDAGRAPHS], 120),
    ("tiny_specee_t1_t2_float32", ["experiment=speed", *TINY, "model.dtype=float32", "ablation=specee_t1_t2"], 60),
    ("tiny_eagle_float16", ["experiment=speed", *TINY, "model.dtype=float16", "ablation=eagle"], 60),
    ("tiny_specee_full_bfloat16", ["experiment=speed", *TINY, "model.dtype=bfloat16", "ablation=specee_full"], 60),
    ("tiny_dense_float32_compiled", ["experiment=speed", *TINY, "model.dtype=float32", "ablation=dense",
                                     "runtime=compiled"], 90),
]
KEYS = ["decode_tokens_per_s", "latency_ms_per_token", "avg_layers", "replay_target_avg_layers", "speedup_vs_dense",
        "match_rate_vs_dense", "hf_generate_ratio", "efficiency", "overhead_share", "draft_share",
        "syncs_per_token", "time_split_method", "time_split_coverage", "energy", "speedup_vs_eager_dense",
        "ms_per_token_over_limit", "bandwidth_bound", "runtime", "noisy_reasons", "mean_accepted_length",
        "machine_load_before"]


def plan(steps, budget_s: float) -> list[dict]:
    """Each step's cap and where it starts if every earlier step uses its whole cap: steps past the
    budget then run only on time that earlier steps leave."""
    rows, at = [], 0.0
    for name, _, cap in steps:
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
    if "runtime.compile_mode=reduce-overhead" in overrides:
        skips = (rt.get("cudagraph_skips_in_warmup") or 0) + (rt.get("cudagraph_skips_in_timed_runs") or 0)
        captures = rt.get("cudagraph_captures_in_warmup")
        ok = skips == 0 and bool(captures)
        checks.append({"check": "CUDA graphs captured, none skipped", "verdict": "pass" if ok else "fail",
                       "value": f"captures {captures} (warm-up), {rt.get('cudagraph_captures_in_timed_runs')} "
                                f"(timed); skips {skips}; compiled calls timed {rt.get('compiled_calls_in_timed_runs')}"})
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
    lines = [f"# GPU check — {info.get('gpu', 'no GPU')} ({info['date']})", "",
             f"GPU {info.get('gpu')} ({info.get('memory_gib')} GiB), driver {info.get('driver')}, CUDA "
             f"{info.get('cuda')}, torch {info['torch']}. Command: `python scripts/gpu_check.py`; each row is one "
             "`run.py experiment=speed` job (its results.json beside this file). Rows on `model.init=random` "
             "shapes use random weights and, where stated, replayed exits: they measure cost, not quality.", "",
             f"Budget: {fmt(budget, 0)} s hard, {fmt(info.get('used_s'), 0)} s used; steps in order of value "
             "(real shapes first).", "",
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
        lines.append(f"| {r['step']} | {r['rc']} | {r['seconds']} ({r.get('timeout_s', '–')}) | "
                     f"{fmt(m.get('decode_tokens_per_s'), 1)} | "
                     f"{fmt(lat, 2)} | {layers} | {fmt(m.get('speedup_vs_dense'))} | {fmt(m.get('hf_generate_ratio'))} | "
                     f"{fmt(m.get('efficiency'))} | {fmt(m.get('overhead_share'))} | {fmt(m.get('draft_share'))} | "
                     f"{fmt(m.get('syncs_per_token'), 1)} | {joules} | {windows} | "
                     f"{fmt(rt.get('graphs_compiled_in_timed_runs'))} | {graphs} | "
                     f"{fmt(m.get('ms_per_token_over_limit'), 2)} | {fmt(m.get('speedup_vs_eager_dense'))} |")
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
    ap.add_argument("--steps", default="", help="comma-separated step names to run (default: all), e.g. to "
                    "rerun the ones that failed")
    args = ap.parse_args()
    names = [n for n in args.steps.split(",") if n]
    unknown = sorted(set(names) - {name for name, _, _ in STEPS})
    if unknown:
        ap.error(f"unknown step(s) {unknown}; valid: {[name for name, _, _ in STEPS]}")
    steps = [s for s in STEPS if not names or s[0] in names]
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
    tag = f"{info['date']}_{str(info.get('gpu', 'nogpu')).replace(' ', '_')}"
    out = Path(args.out) / tag
    out.mkdir(parents=True, exist_ok=True)
    # One inductor/triton cache for every step: later processes reuse compiled kernels.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(out / "inductor_cache")}
    rows = []
    for name, overrides, cap in steps:
        left = deadline - time.perf_counter()
        if left < MIN_STEP_S:
            rows.append({"step": name, "rc": "skipped", "seconds": 0, "timeout_s": 0,
                         "error": f"time budget spent ({left:.0f} s left of {budget_s:.0f} s)"})
        else:
            rows.append(run_step(name, overrides, min(cap, left), out, env))
        print(f"{name}: rc {rows[-1]['rc']} in {rows[-1]['seconds']} s "
              f"({time.perf_counter() - t_start:.0f} s of {budget_s:.0f} s used)", flush=True)
        info["used_s"] = round(time.perf_counter() - t_start, 1)
        (out / "summary.json").write_text(json.dumps({"device": info, "plan": steps_plan, "steps": rows}, indent=1))
        (out / "summary.md").write_text(markdown(info, rows))
    print(f"wrote {out / 'summary.md'}")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
