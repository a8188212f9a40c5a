"""The GPU check's summary (summary.json and summary.md), rebuilt from the step files alone."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from specee.gpu_check.goals import goals
from specee.gpu_check.outputs import read_steps, write_json, write_text


def write_summary(out: Path) -> dict:
    """summary.json and summary.md, rebuilt from the step files (and the check's own facts)."""
    info = json.loads((out / "check.json").read_text()) if (out / "check.json").is_file() else {}
    pre = json.loads((out / "preflight.json").read_text()) if (out / "preflight.json").is_file() else {}
    rows = read_steps(out)
    doc = {"check": info, "preflight": pre, "steps": rows, "goals": goals(rows),
           "written_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    write_json(out / "summary.json", doc)
    write_text(out / "summary.md", markdown(doc))
    return doc

def fmt(x, nd=3):
    if isinstance(x, (list, tuple)) and len(x) == 2 and all(isinstance(v, (int, float)) or v is None for v in x):
        return f"[{fmt(x[0], nd)}, {fmt(x[1], nd)}]"
    return "–" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)

STATUS_NOTE = {"running": "running when this summary was written: killed if the check is over",
               "pending": "not started", "killed": "killed by a stop from outside"}

def markdown(doc: dict) -> str:
    info, pre, rows = doc["check"], doc["preflight"], doc["steps"]
    gpu = pre.get("gpu") or {}
    dry = info.get("dry_run")
    title = "dry run on the CPU (minimal sizes: checks the steps, measures nothing)" if dry else gpu.get("gpu", "?")
    v = pre.get("versions") or {}
    machine = (f"GPU {gpu.get('gpu')} ({gpu.get('memory_gib')} GiB, {gpu.get('free_gib')} free), driver "
               f"{gpu.get('driver')}, CUDA {gpu.get('cuda_version')}" if gpu.get("cuda") else "No GPU")
    lines = [f"# GPU check — {title} ({info.get('date', '?')})", "",
             f"{machine}; "
             + ", ".join(f"{k} {v.get(k)}" for k in ("torch", "transformers", "hydra-core", "omegaconf",
                                                     "nvidia-ml-py")) + ".",
             f"Command: `{info.get('command', '?')}`. Budget {fmt(info.get('budget_s'), 0)} s, "
             f"{fmt(info.get('used_s'), 0)} s used"
             + "".join(f"; earlier in this folder: `{e.get('command')}` ({fmt(e.get('used_s'), 0)} s)"
                       for e in info.get("earlier_runs", [])) + ". Each row is one `run.py experiment=speed` job (its "
             "results.json under results/, its log under logs/). The 7B rows use random weights and replayed "
             "exits: they measure cost, not quality.", ""]
    findings = pre.get("findings") or []
    if findings:
        lines += ["## Preflight", ""] + [f"- {'**refused**: ' if f['blocking'] else ''}{f['line']}" for f in findings]
        lines.append("")
    lines += ["## Goals (issue 41)", "",
              "Each SpecEE gain is against dense on the same runtime in the same job (paired, decode tokens/s), "
              "beside its 95 % interval and that runtime's A/A interval (dense against itself); the rows against "
              "the strongest dense baseline use end-to-end tokens/s, bridged between jobs through eager dense, "
              "which every 7B job times.", "",
              "| figure | measured | 95 % CI | A/A CI (same runtime) | goal | verdict | from |",
              "|---|---|---|---|---|---|---|"]
    for g in doc["goals"]:
        lines.append(f"| {g['figure']} | {fmt(g['measured'])} | {fmt(g.get('ci'))} | {fmt(g.get('aa'))} | {g['goal']} "
                     f"| {g['verdict']} | {g['from'] or '–'} |")
    lines += ["", "## Steps", "",
              "Captures: CUDA graphs recorded in warm-up + while timed, by inductor (runtime), the device walk "
              "and HF static-compiled generate; any recorded while timed fails the step.", "",
              "| step | status | s (cap) | runtime | tok/s e2e | vs same-runtime dense [95 % CI] | "
              "vs strongest dense in job | avg layers (target) | syncs/token | captures runtime / walk / HF static "
              "| graphs compiled timed | J/token (dense) |", "|---" * 12 + "|"]
    for r in rows:
        m, f = r.get("metrics") or {}, r.get("figures") or {}
        cap = f.get("captures") or {}
        e, de = m.get("energy") or {}, (r.get("dense") or {}).get("energy") or {}
        layers = fmt(m.get("avg_layers"), 2) + (f" ({m['replay_target_avg_layers']:.2f})"
                                                if m.get("replay_target_avg_layers") else "")
        joules = (f"{e['joules_per_token']:.3f} ({fmt(de.get('joules_per_token'))})"
                  if e.get("available") and e.get("joules_per_token") else "–")
        caps = " / ".join("–" if pair == [None, None] else "+".join(fmt(x) for x in pair)
                          for pair in (cap.get(k, [None, None]) for k in ("runtime", "device_walk", "hf_static")))
        sb = (f"{fmt(m.get('speedup_vs_strongest_dense'))} ({f.get('strongest_dense')})"
              if f.get("strongest_dense") else "–")
        status = r["status"] + (f" ({STATUS_NOTE[r['status']]})" if r["status"] in STATUS_NOTE else "")
        lines.append(f"| {r['step']} | {status} | {r.get('seconds', '–')} ({r.get('timeout_s', '–')}) | "
                     f"{r.get('runtime', '–')} | {fmt(m.get('tokens_per_s'), 1)} | {fmt(m.get('speedup_vs_dense'))} "
                     f"{fmt(m.get('speedup_vs_dense_ci'))} | {sb} | {layers} | {fmt(m.get('syncs_per_token'), 1)} | "
                     f"{caps if m else '–'} | {fmt(cap.get('graphs_compiled_timed'))} | {joules} |")
    baselines = [(r["step"], (r.get("metrics") or {}).get("strongest_dense_baseline")) for r in rows]
    baselines = [(n, b) for n, b in baselines if b]
    if baselines:
        lines += ["", "## Dense baselines timed in each job (end-to-end tokens/s)", ""]
        lines += [f"- `{n}`: strongest {b['name']} {b['tokens_per_s']:.1f}; "
                  + ", ".join(f"{k} {v:.1f}" for k, v in b["candidates"].items()) for n, b in baselines]
    checked = [r for r in rows if r.get("gpu_only_checks")]
    if checked:
        lines += ["", "## GPU-only checks", "",
                  "`fail` fails the step; `report` is a figure to read (on a GPU, compiled vs eager and tree vs "
                  "one-token decoding are match rates, not failures).", ""]
        for r in checked:
            for c in r["gpu_only_checks"]:
                lines.append(f"- `{r['step']}` — {c['check']}: **{c['verdict']}** ({fmt(c['value'])})")
    noisy = [r for r in rows if (r.get("metrics") or {}).get("noisy_reasons")]
    if noisy:
        lines += ["", "## Marked noisy", ""]
        lines += [f"- `{r['step']}`: {'; '.join(r['metrics']['noisy_reasons'])}" for r in noisy]
    skipped = [r for r in rows if r["status"] == "skipped"]
    if skipped:
        lines += ["", "## Skipped", ""] + [f"- `{r['step']}`: {r['why']}" for r in skipped]
    bad = [r for r in rows if r["status"] in ("failed", "timeout", "killed", "running", "unreadable")]
    if bad:
        lines += ["", "## Failed, timed out or killed", "",
                  f"Rerun: `python scripts/gpu_check.py --out DIR --steps {','.join(r['step'] for r in bad)}`", ""]
        for r in bad:
            lines += [f"### `{r['step']}`: {r['status']} (rc {r.get('rc', '–')}, {r.get('seconds', '–')} s; "
                      f"{r.get('log', '')})", "", "```",
                      (r.get("error") or "no result yet: see its log").rstrip(), "```", ""]
    return "\n".join(lines).rstrip() + "\n"
