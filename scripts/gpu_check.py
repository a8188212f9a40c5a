"""The project's GPU check: one command, on one NVIDIA GPU with no network, within a time budget,
writing one summary under reports/gpu/<date>_<gpu>/ (summary.md + summary.json).

    python scripts/gpu_check.py                 # default budget 8 minutes
    python scripts/gpu_check.py --budget-min 6  --out reports/gpu

Each step is a separate `run.py` job with its own timeout: a broken step is recorded with its
error and the next one runs. Needs only the project's own dependencies.
"""
from __future__ import annotations

import argparse
import json
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


def big(name: str) -> list[str]:
    return [f"model={name}", "model.init=random", "model.device=cuda", "model.dtype=float16",
            "dataset.categories=[writing,qa]", "dataset.max_new_tokens=48"]


STEPS = [  # (name, overrides, timeout s): most important first
    *[(f"tiny_{ab}_{dt}", ["experiment=speed", *TINY, f"model.dtype={dt}", f"ablation={ab}"], 90)
      for dt in ("float32", "bfloat16") for ab in ("dense", "specee_t1_t2", "eagle", "specee_full")],
    *[(f"tiny_{ab}_float32_compiled", ["experiment=speed", *TINY, "model.dtype=float32", f"ablation={ab}",
                                        "runtime=compiled"], 150) for ab in ("dense", "specee_t1_t2")],
    ("llama2_7b_random_dense", ["experiment=speed", *big("llama2_7b"), "ablation=dense"], 120),
    # static KV shapes (a bucket) so CUDA graphs can capture the layer step
    ("llama2_7b_random_dense_compiled", ["experiment=speed", *big("llama2_7b"), "ablation=dense", "runtime=compiled",
                                         "runtime.compile_mode=reduce-overhead", "runtime.cache_bucket=256"], 180),
    ("llama2_7b_random_specee_t1_t2_replay", ["experiment=speed", *big("llama2_7b"), "ablation=specee_t1_t2",
                                             REPLAY, PAPER_PLACEMENT], 150),
    ("llama2_13b_random_dense", ["experiment=speed", *big("llama2_13b"), "ablation=dense"], 150),
]
KEYS = ["decode_tokens_per_s", "latency_ms_per_token", "avg_layers", "replay_target_avg_layers", "speedup_vs_dense",
        "match_rate_vs_dense", "hf_generate_ratio", "efficiency", "overhead_share", "draft_share",
        "syncs_per_token", "time_split_method", "time_split_coverage", "energy", "speedup_vs_eager_dense",
        "ms_per_token_over_limit", "bandwidth_bound", "runtime"]


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


def run_step(name, overrides, timeout, out: Path) -> dict:
    run_dir = out / name
    cmd = [sys.executable, str(ROOT / "run.py"), *overrides, f"hydra.run.dir={run_dir}", "force=true"]
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        rc, tail = res.returncode, (res.stderr or res.stdout)[-1500:]
    except subprocess.TimeoutExpired:
        rc, tail = "timeout", f"exceeded {timeout} s"
    row = {"step": name, "overrides": overrides, "rc": rc, "seconds": round(time.perf_counter() - t0, 1)}
    path = run_dir / "results.json"
    if rc == 0 and path.is_file():
        doc = json.loads(path.read_text())
        m = doc["metrics"]
        row["metrics"] = {k: m[k] for k in KEYS if k in m}
        row["dense_energy"] = m.get("dense", {}).get("energy")
        row["synthetic"] = doc.get("synthetic", {})
    else:
        row["error"] = tail
    return row


def fmt(x, nd=3):
    return "–" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def markdown(info: dict, rows: list[dict]) -> str:
    lines = [f"# GPU check — {info.get('gpu', 'no GPU')} ({info['date']})", "",
             f"GPU {info.get('gpu')} ({info.get('memory_gib')} GiB), driver {info.get('driver')}, CUDA "
             f"{info.get('cuda')}, torch {info['torch']}. Command: `python scripts/gpu_check.py`; each row is one "
             "`run.py experiment=speed` job (its results.json beside this file). Rows on `model.init=random` "
             "shapes use random weights and, where stated, replayed exits: they measure cost, not quality.", "",
             "| step | rc | s | tok/s | ms/token p50 | avg layers (target) | speedup vs dense | hf_generate_ratio | "
             "efficiency | overhead | draft | syncs/token | J/token (dense) | × bandwidth floor | vs eager dense |",
             "|---" * 15 + "|"]
    for r in rows:
        m = r.get("metrics", {})
        e, de = m.get("energy") or {}, r.get("dense_energy") or {}
        lat = (m.get("latency_ms_per_token") or {}).get("p50")
        layers = fmt(m.get("avg_layers"), 2) + (f" ({m['replay_target_avg_layers']:.2f})"
                                                if m.get("replay_target_avg_layers") else "")
        joules = (f"{e['joules_per_token']:.3f} ({de.get('joules_per_token', float('nan')):.3f})"
                  if e.get("available") and e.get("joules_per_token") else "–")
        lines.append(f"| {r['step']} | {r['rc']} | {r['seconds']} | {fmt(m.get('decode_tokens_per_s'), 1)} | "
                     f"{fmt(lat, 2)} | {layers} | {fmt(m.get('speedup_vs_dense'))} | {fmt(m.get('hf_generate_ratio'))} | "
                     f"{fmt(m.get('efficiency'))} | {fmt(m.get('overhead_share'))} | {fmt(m.get('draft_share'))} | "
                     f"{fmt(m.get('syncs_per_token'), 1)} | {joules} | {fmt(m.get('ms_per_token_over_limit'), 2)} | "
                     f"{fmt(m.get('speedup_vs_eager_dense'))} |")
    errors = [r for r in rows if "error" in r]
    if errors:
        lines += ["", "## Failed or skipped steps", ""]
        lines += [f"- `{r['step']}` ({r['rc']}): `{r['error'].strip().splitlines()[-1] if r['error'].strip() else ''}`"
                  for r in errors]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-min", type=float, default=8.0)
    ap.add_argument("--out", default=str(ROOT / "reports" / "gpu"))
    args = ap.parse_args()
    info = device_info()
    info["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    tag = f"{info['date']}_{str(info.get('gpu', 'nogpu')).replace(' ', '_')}"
    out = Path(args.out) / tag
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + 60 * args.budget_min
    rows = []
    for name, overrides, timeout in STEPS:
        left = deadline - time.perf_counter()
        if left < 20:
            rows.append({"step": name, "rc": "skipped", "seconds": 0, "error": "time budget spent"})
            continue
        rows.append(run_step(name, overrides, min(timeout, left), out))
        print(f"{name}: rc {rows[-1]['rc']} in {rows[-1]['seconds']} s", flush=True)
        (out / "summary.json").write_text(json.dumps({"device": info, "steps": rows}, indent=1))
        (out / "summary.md").write_text(markdown(info, rows))
    print(f"wrote {out / 'summary.md'}")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
