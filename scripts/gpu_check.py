"""The project's GPU check: one command, on one NVIDIA GPU with no network, inside a hard time
budget that leaves room in a 10-minute command, every figure written to a folder the caller names.

    python scripts/gpu_check.py --out gpu_out            # preflight, plan, then the steps (budget 9 min)
    python scripts/gpu_check.py --preflight              # the preflight alone (seconds)
    python scripts/gpu_check.py --plan                   # the plan alone
    python scripts/gpu_check.py --out gpu_out --steps a,b   # rerun named steps into the same folder
    python scripts/gpu_check.py --out gpu_out --summarize   # rebuild the summary from the step files
    python scripts/gpu_check.py --dry-run --out d        # every step at minimal size on the CPU

``--out DIR`` receives only what is meant to be copied back: ``summary.md``, ``summary.json``,
``preflight.json``, ``check.json`` (the command, budget and plan), one ``steps/<step>.json`` per
step (its status and figures), each finished step's full ``results/<step>.json`` and its
``logs/<step>.log``. Caches (inductor's and Triton's kernels, Hydra's run folders) go to
``--cache-dir`` (default: the user's cache folder), never under DIR. Every step file is written
``pending`` at the start, ``running`` before its step starts and replaced when it ends; the
summary is rebuilt from the step files after each change, so a check killed mid-step leaves the
finished steps' figures and the killed step marked.

Steps (each one ``run.py experiment=speed`` job; the Llama-2-7B shape has random fp16 weights and
exits replayed from the paper-like profile): the most valuable and the ones already run on a GPU
first, those most likely to fail last: dense graphed against itself (the A/A noise of the graphed
runtime, with eager dense beside it), T1+T2 eager (HF ``generate`` eager beside it), T1+T2 graphed, HF's
static-compiled ``generate`` beside eager dense (the only step that compiles it; the eager A/A
noise), EAGLE and T1+T2+T3 graphed, T1+T2 device-resident (skipped, with the reason, on a torch
without CUDA-graph conditional nodes), then the float16/bfloat16 tree steps on ``tiny`` whose
"misaligned address" fix has not run on a GPU. Every step shares one inductor cache, so a later
step reuses an earlier one's kernels.

Each SpecEE figure is stated against the dense loop on the same runtime in the same job (eager vs
eager, graphed vs graphed), beside that runtime's A/A interval and beside the strongest dense
baseline (HF static-compiled included, bridged through eager dense, which every 7B job times).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the check runs from a checkout: the project is not installed there

from specee.errors import SpeceeError, one_line  # noqa: E402
from specee.gpu_check.outputs import default_cache_dir, write_json  # noqa: E402
from specee.gpu_check.preflight import OFFLINE_RECIPE, installed_version, preflight, probe_gpu  # noqa: E402
from specee.gpu_check.runner import Check, run_steps  # noqa: E402
from specee.gpu_check.steps import (DEFAULT_BUDGET_MIN, RESERVE_S, STEP_NAMES, STEPS,  # noqa: E402
                                    conditional_nodes_missing, plan, print_plan)
from specee.gpu_check.summary import write_summary  # noqa: E402


def parse_args(argv):
    ap = argparse.ArgumentParser(description="The GPU check: see docs/gpu.md.")
    ap.add_argument("--out", help="folder for the summary, per-step results and logs (the folder to copy back)")
    ap.add_argument("--cache-dir", help="inductor/Triton caches and Hydra run folders (default: the user cache "
                    "folder; never inside --out)")
    ap.add_argument("--budget-min", type=float, default=DEFAULT_BUDGET_MIN,
                    help=f"hard budget for the steps in minutes (default {DEFAULT_BUDGET_MIN})")
    ap.add_argument("--plan", action="store_true", help="print the plan and exit")
    ap.add_argument("--preflight", action="store_true", help="run the preflight alone and exit")
    ap.add_argument("--summarize", action="store_true", help="rebuild --out's summary from its step files and exit")
    ap.add_argument("--dry-run", action="store_true", help="every step at minimal size on the CPU (tiny, one "
                    "prompt, 3 tokens): the overrides, the layout and this script's own code, without a GPU")
    ap.add_argument("--steps", default="", help="comma-separated step names to run (default: all), e.g. to "
                    "rerun the ones that failed into the same --out")
    return ap.parse_args(argv)

def resolve_paths(args) -> tuple[Path, Path]:
    if not args.out:
        raise SpeceeError("--out DIR is needed: the folder that receives the summary, per-step results and logs "
                          "(the one to copy back), e.g. --out gpu_out")
    out = Path(args.out).resolve()
    cache = Path(args.cache_dir).resolve() if args.cache_dir else default_cache_dir()
    if cache == out or out in cache.parents:
        raise SpeceeError(f"--cache-dir {cache} is inside --out {out}: the caches would be copied back with the "
                          "figures; give a folder outside it")
    if out.exists() and not out.is_dir():
        raise SpeceeError(f"--out {out} is a file; give a folder")
    return out, cache

def main(argv=None, version_of: Callable[[str], str | None] = installed_version,
         gpu: Callable[[], dict] = probe_gpu) -> int:
    args = parse_args(argv)
    try:
        return _main(args, argv, version_of, gpu)
    except SpeceeError as err:
        print(f"specee: error: {one_line(err)}", file=sys.stderr)
        return 2

def _main(args, argv, version_of, gpu) -> int:
    names = [n for n in args.steps.split(",") if n]
    unknown = sorted(set(names) - set(STEP_NAMES))
    if unknown:
        raise SpeceeError(f"unknown step(s) {', '.join(unknown)} in --steps; valid: {', '.join(STEP_NAMES)}")
    steps = [s for s in STEPS if not names or s.name in names]
    budget_s = 60 * args.budget_min
    rows = plan(steps, budget_s - RESERVE_S)
    if args.plan:
        print_plan(rows, budget_s)
        return 0
    if args.summarize:
        out, _ = resolve_paths(args)
        if not (out / "steps").is_dir():
            raise SpeceeError(f"{out} has no steps/ folder: not a GPU check's output")
        write_summary(out)
        print(f"wrote {out / 'summary.md'}")
        return 0
    t0 = time.perf_counter()
    report = preflight(args.dry_run, version_of=version_of, gpu=gpu)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    for f in report["findings"]:
        if not f["blocking"]:
            print(f"note: {f['line']}")
    blocking = [f for f in report["findings"] if f["blocking"]]
    if args.preflight:
        for f in blocking:
            print(f"specee: error: {f['line']}", file=sys.stderr)
        if blocking:
            print(OFFLINE_RECIPE, file=sys.stderr)
        return 2 if blocking else 0
    if blocking:
        if len(blocking) > 1:  # each its own line; the first is the error line
            for f in blocking[1:]:
                print(f"also: {f['line']}", file=sys.stderr)
        raise SpeceeError(blocking[0]["line"])
    out, cache = resolve_paths(args)
    out.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    g = report.get("gpu") or {}
    if g.get("conditional_nodes_missing"):
        rows = plan(steps, budget_s - RESERVE_S, {s.name: g["conditional_nodes_missing"] for s in steps
                                                  if s.skip is conditional_nodes_missing})
    print_plan(rows, budget_s)
    info = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "budget_s": budget_s, "dry_run": args.dry_run,
            "command": "python scripts/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "plan": rows, "gpu": g.get("gpu"), "used_s": 0}
    if (out / "check.json").is_file():  # a rerun of some steps into the same folder: the earlier runs kept
        earlier = json.loads((out / "check.json").read_text())
        info["earlier_runs"] = earlier.pop("earlier_runs", []) + [earlier]
    write_json(out / "check.json", info)
    write_json(out / "preflight.json", report)
    check = Check(out, cache, args.dry_run, budget_s, steps)
    check.t_start = t0  # the budget counts from the preflight on
    check.info = info
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, check.stopped)
    done = run_steps(check)
    info["used_s"] = round(time.perf_counter() - check.t_start, 1)
    write_json(out / "check.json", info)
    write_summary(out)
    print(f"wrote {out / 'summary.md'}")
    # A step skipped for a named reason (this torch lacks a feature, the budget ran out) is a
    # finding, not a failure; a rerun with --steps takes the budget-skipped ones.
    return 0 if all(r["status"] in ("passed", "skipped") for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
