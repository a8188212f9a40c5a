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
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the check runs from a checkout: the project is not installed there

from specee.errors import SpeceeError, one_line  # noqa: E402

# -- budget --------------------------------------------------------------------------------------
# A short GPU session may cap one command at 10 minutes: the default budget keeps 60 s of it for
# installing the carried wheels, Python's start, the preflight, ending a step at the deadline and
# the last summary (the check stops its steps at the budget, whatever they expected).
DEFAULT_BUDGET_MIN = 9.0
MIN_STEP_S = 20  # a step that cannot get this long is skipped, not started
RESERVE_S = 5  # kept back from the budget for the last summary
DRY_RUN_STEP_S = 900  # a step's timeout in a dry run (a 2-core CPU compiles tiny's graphs in minutes)
NEED_FREE_GIB = 24  # Llama-2-7B in fp16 (12.6 GiB), its KV caches, CUDA-graph pools, HF's static cache
# A/A noise must be narrower than the effect sought: the smallest gain in the goal table is 1.20x
# (graphed), so the dense-vs-dense interval has to lie within 1 +- half of it.
AA_HALF_WIDTH = 0.10

TINY = ["model=tiny", "model.device=cuda", "dataset.categories=[writing,qa]", "dataset.count=1",
        "dataset.max_new_tokens=32"]
REPLAY = ["early_exit.replay=specee/artifacts/paper_like_32l_exit_profile",
          "placement.profile_path=specee/artifacts/paper_like_32l_exit_profile"]
CUDAGRAPHS = ["runtime=compiled", "runtime.compile_mode=reduce-overhead", "runtime.cache_bucket=256"]
HF_STATIC = "experiment.hf_static_compiled=true"  # transformers' static cache + compiled decode, same job


def big(name: str, categories: str = "writing,qa,math_reasoning,translation", count: int = 1,
        tokens: int = 48) -> list[str]:
    return [f"model={name}", "model.init=random", "model.device=cuda", "model.dtype=float16",
            f"dataset.categories=[{categories}]", f"dataset.count={count}", f"dataset.max_new_tokens={tokens}",
            "experiment.cost_rounds=0"]


# SpecEE steps time 4 prompts, each paired with dense on its own runtime. The graphed A/A step
# times 6 (a paired interval over 2 prompts was 0.55-1.25 on the H200) without HF generate (the
# T1+T2 eager step times it), so its time goes to dense against itself.
SPECEE_7B = big("llama2_7b")
AA_GRAPHED_7B = [*big("llama2_7b", "writing,qa,math_reasoning", count=2), "experiment.compare_hf_generate=false"]
# HF's static-compiled generate beside eager dense (the eager A/A): its compile dominates the step
AA_EAGER_7B = [*big("llama2_7b", tokens=32), "experiment.compare_hf_generate=false"]


def conditional_nodes_missing() -> str | None:
    """Why runtime.exit_control=device cannot run on this machine's GPU (None: it can)."""
    from specee.runtime.device_walk import conditional_nodes_problem
    return conditional_nodes_problem("cuda")


class Step(NamedTuple):
    name: str
    overrides: list
    cap_s: int  # its timeout: about 1.5x its expected duration
    skip: Callable[[], str | None] | None  # on a GPU: why this machine cannot run it (None: it can)
    expected_s: int  # on an H200, warm inductor cache for the later graphed steps
    basis: str  # where expected_s comes from
    runtime: str  # eager | graphed | device: the dense it is compared with runs the same way
    aa: bool = False  # dense against itself: the runtime's A/A noise


# Measured on one H200 (reports/gpu/2026-12-04_NVIDIA_H200, 48 new tokens): 7B eager dense 52 s,
# 7B T1+T2 eager 49 s, 7B graphed dense 59 s, tiny T1+T2 eager 47.7 s (4 prompts), tiny T1+T2
# graphed 65 s, tiny fp16 EAGLE failing at 25 s. Steps never run there are estimated from those.
STEPS = [
    Step("llama2_7b_dense_graphed_aa", ["experiment=speed", *AA_GRAPHED_7B, "ablation=dense", *CUDAGRAPHS], 130,
         None, 85, "measured 59 s at 2 prompts; 6 prompts and the lockstep warm-up added", "graphed", aa=True),
    Step("llama2_7b_t1_t2_eager", ["experiment=speed", *SPECEE_7B, "ablation=specee_t1_t2", *REPLAY], 100, None,
         65, "measured 49 s at 2 prompts", "eager"),
    Step("llama2_7b_t1_t2_graphed", ["experiment=speed", *SPECEE_7B, "ablation=specee_t1_t2", *REPLAY, *CUDAGRAPHS,
                                     "runtime.exit_control=lookahead"], 115, None,
         75, "estimate: graphed dense 59 s + predictors", "graphed"),
    # The only step that compiles HF's static baseline (never run on a GPU yet): eager runtime, so
    # nothing else compiles here, and dense against itself gives the eager A/A noise.
    Step("llama2_7b_hf_static_eager_aa", ["experiment=speed", *AA_EAGER_7B, "ablation=dense", HF_STATIC], 180, None,
         120, "estimate: eager dense 52 s + one 7B decode-graph compile", "eager", aa=True),
    Step("llama2_7b_eagle_graphed", ["experiment=speed", *SPECEE_7B, "ablation=eagle", *CUDAGRAPHS], 100, None,
         65, "estimate: never run on a GPU (tree + CUDA graphs)", "graphed"),
    Step("llama2_7b_t1_t2_t3_graphed", ["experiment=speed", *SPECEE_7B, "ablation=specee_full", *REPLAY,
                                        *CUDAGRAPHS], 100, None,
         65, "estimate: never run on a GPU (tree + CUDA graphs)", "graphed"),
    Step("llama2_7b_t1_t2_device", ["experiment=speed", *SPECEE_7B, "ablation=specee_t1_t2", *REPLAY, *CUDAGRAPHS,
                                    "runtime.exit_control=device"], 115, conditional_nodes_missing,
         75, "estimate: its capture has never run on a GPU", "device"),
    Step("tiny_eagle_float16", ["experiment=speed", *TINY, "model.dtype=float16", "ablation=eagle"], 60, None,
         30, "estimate: tiny T1+T2 took 47.7 s at 4 prompts x 48 tokens; this one failed at 25 s", "eager"),
    Step("tiny_specee_full_bfloat16", ["experiment=speed", *TINY, "model.dtype=bfloat16", "ablation=specee_full"],
         60, None, 30, "estimate: as tiny_eagle_float16; failed at 27 s", "eager"),
]
STEP_NAMES = [s.name for s in STEPS]


def dry_run(overrides: list[str]) -> list[str]:
    """A step's overrides at minimal size on the CPU: the same recipe, mode, runtime, exit control
    and replay, on tiny (32 layers, Llama-2-7B proportions, so the 32-layer exit profile fits),
    one prompt, 3 new tokens, torch.compile's eager backend for transformers' compiled path."""
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "model":
            out.append("model=tiny")
        elif key in ("model.init", "experiment.cost_rounds", "dataset.count"):
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


# -- preflight -----------------------------------------------------------------------------------
# What the steps import, with the project's own requirement for each (pyproject.toml). lm-eval,
# pandas and the plotting stack are not needed: no step runs an accuracy task or draws a figure.
NEEDED = ("torch", "transformers", "tokenizers", "safetensors", "hydra-core", "omegaconf", "nvidia-ml-py", "tqdm")
# hydra-core 1.3 parses overrides with this exact runtime (its own pin, not the project's)
EXTRA = {"antlr4-python3-runtime": "==4.9.*"}
# Never reinstalled on the GPU machine: its CUDA build is the image's, and a wheel is gigabytes.
KEEP_IMAGES = {"torch"}


def project_requirements(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """name -> version specifier, for the packages the steps need, read from pyproject.toml."""
    import tomllib
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    reqs = {}
    for d in deps:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(.*)", d)
        reqs[m.group(1).lower()] = m.group(2).replace(" ", "")
    out = {n: reqs.get(n, "") for n in NEEDED}
    out.update(EXTRA)
    return out


def installed_version(dist: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def satisfies(version: str, spec: str) -> bool:
    if not spec:
        return True
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
        return Version(version) in SpecifierSet(spec)
    except ImportError:  # packaging comes with transformers; without it, compare the leading numbers
        def nums(v):
            return tuple(int(x) for x in re.findall(r"\d+", v)[:3])
        return all(nums(version) >= nums(s[2:]) for s in spec.split(",") if s.startswith(">="))


def fix_for(dist: str, spec: str, missing: bool = False) -> str:
    if dist in KEEP_IMAGES and missing:
        return f"a machine whose image has a CUDA build of {dist} (docs/gpu.md: install on a GPU)"
    if dist in KEEP_IMAGES:
        return (f"keep the image's CUDA build (a torch wheel is gigabytes and pulls CUDA); {dist}{spec} is the "
                "project's pin, an older one only loses what the plan says")
    return f"pip install --no-index --no-deps --find-links WHEELS '{dist}{spec}' (wheels carried in: docs/gpu.md)"


def probe_gpu() -> dict:
    """This machine's GPU as the steps will see it (``cuda``: False where there is none)."""
    import torch
    if not torch.cuda.is_available():
        return {"cuda": False}
    free, total = torch.cuda.mem_get_info(0)
    p = torch.cuda.get_device_properties(0)
    info = {"cuda": True, "gpu": p.name, "memory_gib": round(total / 2**30, 1), "free_gib": round(free / 2**30, 1),
            "cuda_version": torch.version.cuda, "conditional_nodes_missing": conditional_nodes_missing()}
    try:
        import pynvml
        pynvml.nvmlInit()
        info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        info["gpu_utilization_pct"] = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
    except Exception as err:  # noqa: BLE001 - a finding, said in the preflight
        info["nvml_error"] = f"{type(err).__name__}: {err}"
    return info


IMPORTS = {"transformers": "transformers", "hydra": "hydra-core", "omegaconf": "omegaconf", "pynvml": "nvidia-ml-py"}


def preflight(dry_run_: bool, version_of: Callable[[str], str | None] = installed_version,
              gpu: Callable[[], dict] = probe_gpu, requirements: dict | None = None,
              import_module: Callable = __import__) -> dict:
    """Versions against the project's floors, the GPU's free memory and conditional-node support.
    Each finding is one line with its fix; ``blocking`` ones stop the check before any step."""
    findings, versions = [], {}
    if sys.version_info < (3, 11):
        py = ".".join(map(str, sys.version_info[:3]))
        findings.append({"what": "python", "blocking": True,
                         "line": f"Python {py} is below the project's requires-python >=3.11 (pyproject.toml); fix: "
                                 "run the check with a Python >= 3.11 that has the image's torch"})
        return {"versions": {"python": py}, "requirements": {}, "findings": findings}
    reqs = requirements or project_requirements()
    for dist, spec in reqs.items():
        v = version_of(dist)
        versions[dist] = v
        if v is None:
            findings.append({"what": dist, "blocking": True,
                             "line": f"{dist} is not installed (the project needs {dist}{spec}); "
                                     f"fix: {fix_for(dist, spec, True)}"})
        elif not satisfies(v, spec):
            blocking = dist not in KEEP_IMAGES
            findings.append({"what": dist, "blocking": blocking,
                             "line": f"{dist} {v} is outside the project's requirement {dist}{spec} (pyproject.toml)"
                                     f"; fix: {fix_for(dist, spec)}"})
    report = {"versions": versions, "requirements": reqs, "findings": findings}
    if any(f["blocking"] for f in findings):
        return report  # the GPU is not probed with a broken stack: the first fix comes first
    # Right versions can still fail to import together (a newer transformers over the image's
    # huggingface_hub or tokenizers): every step would die at its first line.
    for module, dist in IMPORTS.items():
        try:
            import_module(module)
        except Exception as err:  # noqa: BLE001 - said as a finding, with its fix
            findings.append({"what": dist, "blocking": True,
                             "line": f"import {module} fails ({type(err).__name__}: {one_line(err)[:300]}); fix: "
                                     "carry the wheel of the package it names and pip install --no-index --no-deps "
                                     "it (docs/gpu.md)"})
    if any(f["blocking"] for f in findings):
        return report
    if dry_run_:
        report["gpu"] = {"cuda": False, "note": "dry run: every step on the CPU"}
        return report
    g = report["gpu"] = gpu()
    if not g.get("cuda"):
        findings.append({"what": "gpu", "blocking": True,
                         "line": "no CUDA GPU is visible to torch; fix: run it on the GPU machine, or with "
                                 "--dry-run on a CPU"})
        return report
    if g["free_gib"] < NEED_FREE_GIB:
        findings.append({"what": "gpu memory", "blocking": True,
                         "line": f"{g['free_gib']} GiB free of {g['memory_gib']} GiB on {g['gpu']}; the 7B steps need "
                                 f"{NEED_FREE_GIB} GiB; fix: end the processes nvidia-smi lists on it"})
    if g.get("conditional_nodes_missing"):
        findings.append({"what": "conditional nodes", "blocking": False,
                         "line": f"{g['conditional_nodes_missing']}: llama2_7b_t1_t2_device is skipped; fix: torch "
                                 ">= 2.13 built with CUDA >= 12.4 (the image's torch is kept: not installed here)"})
    if g.get("nvml_error"):
        findings.append({"what": "nvml", "blocking": False,
                         "line": f"NVML does not answer ({g['nvml_error']}): energy figures will be blank; fix: a "
                                 "driver with NVML (nvidia-smi runs), nvidia-ml-py installed"})
    elif (g.get("gpu_utilization_pct") or 0) > 5:
        findings.append({"what": "gpu busy", "blocking": False,
                         "line": f"the GPU is {g['gpu_utilization_pct']} % busy before the check: timings will be "
                                 "noise; fix: end the other processes on it"})
    return report


OFFLINE_RECIPE = """\
On a machine with network (same Python version as the GPU machine), next to the checkout:
    pip download --no-deps -d wheels 'transformers>=5.20,<6' 'hydra-core>=1.3.2,<1.4' 'omegaconf>=2.3,<2.5' \\
        'nvidia-ml-py>=12' && pip wheel --no-deps -w wheels antlr4-python3-runtime==4.9.3
On the GPU machine (no network; torch is the image's, never reinstalled; the project is not
installed: the check runs from the checkout):
    pip install --no-index --no-deps wheels/*.whl && python scripts/gpu_check.py --out gpu_out"""


# -- figures -------------------------------------------------------------------------------------
KEYS = ["tokens_per_s", "decode_tokens_per_s", "walk_syncs_per_token", "speedup_vs_hf_generate",
        "speedup_vs_hf_static_compiled", "hf_static_compiled_tokens_per_s", "strongest_dense_baseline",
        "speedup_vs_strongest_dense", "hf_generate_tokens_per_s", "hf_static_compiled", "latency_ms_per_token",
        "avg_layers", "replay_target_avg_layers", "speedup_vs_dense", "speedup_vs_dense_ci",
        "match_rate_vs_dense", "hf_generate_ratio", "efficiency", "overhead_share", "draft_share",
        "syncs_per_token", "time_split_method", "time_split_coverage", "energy", "speedup_vs_eager_dense",
        "ms_per_token_over_limit", "bandwidth_bound", "runtime", "noisy_reasons", "mean_accepted_length",
        "machine_load_before", "prompts"]


def captures(m: dict) -> dict:
    """Every CUDA graph a step recorded, warm-up and timed apart: inductor's (the compiled
    runtime), the device walk's (exit_control=device) and HF static-compiled generate's."""
    rt, hs = m.get("runtime") or {}, m.get("hf_static_compiled") or {}
    return {"runtime": [rt.get("cudagraph_captures_in_warmup"), rt.get("cudagraph_captures_in_timed_runs")],
            "device_walk": [rt.get("device_walk_captures_in_warmup"), rt.get("device_walk_captures_in_timed_runs")],
            "hf_static": [hs.get("cudagraph_captures_in_warmup"), hs.get("cudagraph_captures_in_timed_runs")],
            "graphs_compiled_timed": rt.get("graphs_compiled_in_timed_runs")}


def figures(m: dict) -> dict:
    """The figures the goal table reads, from one step's full metrics. ``vs_eager_dense_e2e``: this
    side's end-to-end tokens/s over eager dense timed in the same job (the bridge between jobs)."""
    d = m.get("dense") or {}
    hf = m.get("hf_generate_tokens_per_s")
    graphed = (m.get("runtime") or {}).get("kind") == "compiled"
    eager_tps = (m.get("eager_dense") or {}).get("tokens_per_s") if graphed else d.get("tokens_per_s")
    eager_decode = (m.get("eager_dense") or {}).get("decode_tokens_per_s") if graphed else d.get("decode_tokens_per_s")
    sb = m.get("strongest_dense_baseline") or {}
    cands = dict(sb.get("candidates") or {})
    if m.get("hf_static_compiled_tokens_per_s"):
        cands["hf_static_compiled"] = m["hf_static_compiled_tokens_per_s"]
    return {"speedup_vs_dense": m.get("speedup_vs_dense"), "speedup_vs_dense_ci": m.get("speedup_vs_dense_ci"),
            "speedup_vs_hf_generate": m.get("speedup_vs_hf_generate"),
            "speedup_vs_strongest_dense": m.get("speedup_vs_strongest_dense"), "strongest_dense": sb.get("name"),
            "dense_eager_vs_hf_generate": eager_tps / hf if eager_tps and hf else None,
            "vs_eager_dense_e2e": m["tokens_per_s"] / eager_tps if eager_tps and m.get("tokens_per_s") else None,
            "baselines_vs_eager_dense_e2e": {k: v / eager_tps for k, v in cands.items() if v and eager_tps},
            "eager_dense_decode_tokens_per_s": eager_decode,
            "walk_syncs_per_token": m.get("walk_syncs_per_token"), "captures": captures(m)}


def gpu_only_checks(overrides: list[str], m: dict, dry: bool) -> list[dict]:
    """What a CPU cannot show, read from one step's metrics, each with a verdict: ``fail`` fails the
    step; ``report`` is a figure to read, not a pass/fail (GPU numerics are not bit-exact)."""
    rt = m.get("runtime") or {}
    checks = []
    graphed = "runtime.compile_mode=reduce-overhead" in overrides
    if graphed and dry:
        checks.append({"check": "CUDA graphs captured, none recorded while timed", "verdict": "report",
                       "value": "not checked: a dry run on the CPU has no CUDA graphs"})
    elif graphed:
        skips = (rt.get("cudagraph_skips_in_warmup") or 0) + (rt.get("cudagraph_skips_in_timed_runs") or 0)
        captured = rt.get("cudagraph_captures_in_warmup")
        checks.append({"check": "CUDA graphs captured, none skipped", "verdict": "pass" if skips == 0 and captured
                       else "fail", "value": f"captures {captured} (warm-up), {rt.get('cudagraph_captures_in_timed_runs')} "
                                             f"(timed); skips {skips}"})
        timed = rt.get("cudagraph_captures_in_timed_runs")
        checks.append({"check": "no CUDA graph recorded while timed (every bucket warmed first)",
                       "verdict": "pass" if timed == 0 else "fail", "value": timed})
        if rt.get("fallback"):
            checks.append({"check": "compiled runtime did not fall back", "verdict": "fail", "value": rt["fallback"]})
    if "runtime.exit_control=device" in overrides and not dry:
        warm, timed = rt.get("device_walk_captures_in_warmup"), rt.get("device_walk_captures_in_timed_runs")
        checks.append({"check": "device walk captured in warm-up, none recorded while timed",
                       "verdict": "pass" if warm and timed == 0 else "fail",
                       "value": f"{warm} in warm-up, {timed} while timed"})
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
        checks.append({"check": "energy: >= 10 counter updates per window",
                       "verdict": "pass" if n is not None and n >= 10 else "report",
                       "value": f"{e.get('windows')} window(s), {e.get('counter_updates')} updates, min {n}/window"})
    else:
        checks.append({"check": "energy measured", "verdict": "report", "value": e.get("reason")})
    return checks


# -- the goal table ------------------------------------------------------------------------------
def _fig(by: dict, step: str, key: str):
    return (by.get(step) or {}).get(key)


def _aa(by: dict, runtime: str):
    """(point, [lo, hi], step) of the A/A step on this runtime, or Nones."""
    for s in STEPS:
        if s.aa and s.runtime == runtime and by.get(s.name):
            return by[s.name].get("speedup_vs_dense"), by[s.name].get("speedup_vs_dense_ci"), s.name
    return None, None, None


def _strongest_bridged(by: dict):
    """The fastest dense baseline over every job, in units of eager dense timed in its own job."""
    best = (None, None)
    for name, f in by.items():
        for k, v in (f.get("baselines_vs_eager_dense_e2e") or {}).items():
            if best[0] is None or v > best[0]:
                best = (v, f"{k} ({name})")
    return best


T12 = ("llama2_7b_t1_t2_eager", "llama2_7b_t1_t2_graphed", "llama2_7b_t1_t2_device")


def goal_rows(by: dict) -> list[dict]:
    """Issue 41's goals, each SpecEE gain against the same runtime's dense (paired, same job)
    beside that runtime's A/A interval; the strongest-baseline rows bridged through eager dense."""
    rows = []

    def add(figure, goal, ok, value, source, runtime=None, ci=None):
        row = {"figure": figure, "goal": goal, "measured": value, "from": source, "ci": ci}
        if runtime:
            _, aa_ci, _ = _aa(by, runtime)
            row["aa"] = aa_ci
        row["_ok"] = ok
        rows.append(row)

    first = next(((by[s].get("dense_eager_vs_hf_generate"), s) for s in ("llama2_7b_t1_t2_eager",
                  "llama2_7b_dense_graphed_aa", "llama2_7b_hf_static_eager_aa")
                  if _fig(by, s, "dense_eager_vs_hf_generate") is not None), (None, None))
    add("dense eager vs HF generate eager (eager vs eager, same job)", "≥ 1.0×", lambda v: v >= 1.0, *first)
    for step, runtime, goal, ok in (("llama2_7b_t1_t2_eager", "eager", "stated (no goal)", None),
                                    ("llama2_7b_t1_t2_graphed", "graphed", "≥ 1.20× (layer ratio 1.30×)",
                                     lambda v: v >= 1.20),
                                    ("llama2_7b_t1_t2_device", "graphed", "≥ 1.25×", lambda v: v >= 1.25)):
        label = {"eager": "eager vs dense eager", "graphed": "graphed vs dense graphed",
                 "device": "device-resident vs dense graphed"}
        kind = "device" if step.endswith("device") else runtime
        add(f"T1+T2 {label[kind]} (same runtime, paired)", goal, ok, _fig(by, step, "speedup_vs_dense"),
            step if _fig(by, step, "speedup_vs_dense") is not None else None, runtime,
            _fig(by, step, "speedup_vs_dense_ci"))
    v = _fig(by, "llama2_7b_t1_t2_eager", "speedup_vs_hf_generate")
    add("T1+T2 eager vs HF generate eager (the paper's metric, eager vs eager)", "≥ 1.27×", lambda x: x >= 1.27, v,
        "llama2_7b_t1_t2_eager" if v is not None else None)
    strongest, sname = _strongest_bridged(by)
    t12 = [(by[s]["vs_eager_dense_e2e"], s) for s in T12 if _fig(by, s, "vs_eager_dense_e2e")]
    if strongest and t12:
        best, bname = max(t12)
        add("best T1+T2 vs the strongest dense baseline of any runtime", "> 1.0×", lambda x: x > 1.0,
            best / strongest, f"{bname} / {sname}, bridged through eager dense in each job")
    else:
        add("best T1+T2 vs the strongest dense baseline of any runtime", "> 1.0×", lambda x: x > 1.0, None, None)
    hs = _fig(by, "llama2_7b_hf_static_eager_aa", "baselines_vs_eager_dense_e2e") or {}
    if hs.get("hf_static_compiled") and t12:
        best, bname = max(t12)
        add("best T1+T2 vs HF static-compiled generate", "> 1.0×, stated either way", lambda x: x > 1.0,
            best / hs["hf_static_compiled"], f"{bname} / hf_static_compiled, bridged through eager dense")
    else:
        add("best T1+T2 vs HF static-compiled generate", "> 1.0×, stated either way", lambda x: x > 1.0, None, None)
    x, y = _fig(by, "llama2_7b_t1_t2_t3_graphed", "speedup_vs_dense"), _fig(by, "llama2_7b_eagle_graphed",
                                                                             "speedup_vs_dense")
    add("T1+T2+T3 graphed vs EAGLE graphed", "≥ 1.0× (paper: 1.05×)", lambda v: v >= 1.0, x / y if x and y else None,
        "each against its own graphed dense" if x and y else None)
    v = _fig(by, "llama2_7b_t1_t2_device", "walk_syncs_per_token")
    add("host round trips per token in the walk, device-resident", "0", lambda v: v == 0, v,
        "llama2_7b_t1_t2_device" if v is not None else None)
    for runtime in ("graphed", "eager"):
        p, ci, step = _aa(by, runtime)
        ok = (lambda c: lambda _v: c is not None and 1 - AA_HALF_WIDTH <= c[0] and c[1] <= 1 + AA_HALF_WIDTH)(ci)
        add(f"A/A noise, dense {runtime} vs itself (95 % interval)", f"within 1 ± {AA_HALF_WIDTH:.2f} "
            "(half the 1.20× sought)", ok, p, step, ci=ci)
    return rows


def goals(steps: list[dict]) -> list[dict]:
    """Each goal with its measured value, where it came from, and met / missed / not measured (why)."""
    by = {r["step"]: r.get("figures") or {} for r in steps if r.get("figures")}
    # why a step left no figures (a step that failed a GPU-only check still has them)
    why = {r["step"]: f"{r['status']}: {r.get('why') or last_line(r.get('error'))}".rstrip(": ") for r in steps
           if r["step"] not in by}
    failed_checks = [r["step"] for r in steps if r.get("status") == "check failed"]
    out = []
    for g in goal_rows(by):
        ok = g.pop("_ok")
        if g["measured"] is None:
            reasons = [f"{n}: {why[n]}" for n in GOAL_STEPS.get(g["figure"], []) if n in why]
            g["verdict"] = "not measured" + (f" ({'; '.join(reasons)})" if reasons else
                                             " (its steps did not run, or their results lack the figure)")
        elif ok is None:
            g["verdict"] = "stated"
        else:
            g["verdict"] = "met" if ok(g["measured"]) else "missed"
        # a figure from a step that failed a GPU-only check (graphs recorded while timed, ...) is suspect
        suspect = [n for n in failed_checks if n in (g["from"] or "")]
        if g["measured"] is not None and suspect:
            g["verdict"] += f" (suspect: {', '.join(suspect)} failed a GPU-only check)"
        out.append(g)
    return out


# which steps each goal reads (to say why one is not measured)
GOAL_STEPS = {
    "dense eager vs HF generate eager (eager vs eager, same job)": ["llama2_7b_t1_t2_eager",
                                                                    "llama2_7b_dense_graphed_aa"],
    "T1+T2 eager vs dense eager (same runtime, paired)": ["llama2_7b_t1_t2_eager"],
    "T1+T2 graphed vs dense graphed (same runtime, paired)": ["llama2_7b_t1_t2_graphed"],
    "T1+T2 device-resident vs dense graphed (same runtime, paired)": ["llama2_7b_t1_t2_device"],
    "T1+T2 eager vs HF generate eager (the paper's metric, eager vs eager)": ["llama2_7b_t1_t2_eager"],
    "best T1+T2 vs the strongest dense baseline of any runtime": [*T12, "llama2_7b_hf_static_eager_aa"],
    "best T1+T2 vs HF static-compiled generate": [*T12, "llama2_7b_hf_static_eager_aa"],
    "T1+T2+T3 graphed vs EAGLE graphed": ["llama2_7b_t1_t2_t3_graphed", "llama2_7b_eagle_graphed"],
    "host round trips per token in the walk, device-resident": ["llama2_7b_t1_t2_device"],
    "A/A noise, dense graphed vs itself (95 % interval)": ["llama2_7b_dense_graphed_aa"],
    "A/A noise, dense eager vs itself (95 % interval)": ["llama2_7b_hf_static_eager_aa"],
}


# -- plan ----------------------------------------------------------------------------------------
def plan(steps, budget_s: float, skipped: dict | None = None) -> list[dict]:
    """Each step's expected duration, its cap, and whether it fits: ``fits_expected`` if every
    earlier step takes its expected time, ``fits_at_worst`` if every earlier one uses its cap.
    ``skipped``: step -> why this machine cannot run it (it takes no time)."""
    skipped = skipped or {}
    rows, at, worst = [], 0.0, 0.0
    for s in steps:
        if s.name in skipped:
            rows.append({"step": s.name, "cap_s": s.cap_s, "expected_s": 0, "basis": f"skipped: {skipped[s.name]}",
                         "starts_expected_s": at, "fits_expected": True, "fits_at_worst": True})
            continue
        rows.append({"step": s.name, "cap_s": s.cap_s, "expected_s": s.expected_s, "basis": s.basis,
                     "starts_expected_s": at, "fits_expected": at + s.expected_s <= budget_s,
                     "fits_at_worst": worst + s.cap_s <= budget_s})
        at += s.expected_s
        worst += s.cap_s
    return rows


def print_plan(rows: list[dict], budget_s: float) -> None:
    total = sum(r["expected_s"] for r in rows)
    print(f"GPU check plan: budget {budget_s:.0f} s ({RESERVE_S} s kept for the summary); {total} s expected on "
          "an H200, steps in order:")
    for r in rows:
        note = "" if r["fits_expected"] else "  (expected to be cut by the budget: rerun it with --steps)"
        print(f"  {r['step']:32s} expected {r['expected_s']:4d} s, cap {r['cap_s']:4d} s ({r['basis']}){note}")
    print(flush=True)


# -- the output folder ---------------------------------------------------------------------------
def write_json(path: Path, doc) -> None:
    """Whole or not at all: a check killed mid-write leaves the previous version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


def write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def step_path(out: Path, name: str) -> Path:
    return out / "steps" / f"{name}.json"


def last_line(text) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def log_tail(path: Path, lines: int = 120, chars: int = 12000) -> str:
    """The end of a step's log as a terminal shows it (a progress bar's redraws collapsed)."""
    try:
        raw = path.read_text(errors="replace")
    except OSError:
        return ""
    shown = [ln.rsplit("\r", 1)[-1] for ln in raw.splitlines()]
    return "\n".join(shown[-lines:])[-chars:]


def error_text(tail: str) -> str:
    """The part of a log's tail that says what went wrong: from the first traceback or error
    line on (the full text, not Hydra's closing hint), else the whole tail."""
    lines = tail.splitlines()
    for i, ln in enumerate(lines):
        if ln.startswith(("Traceback", "specee: error:", "Error executing job")):
            return "\n".join(lines[i:])
    return tail


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or (Path.home() / ".cache")
    try:
        p = Path(base) / "specee" / "gpu_check"
        p.mkdir(parents=True, exist_ok=True)
        return p
    except OSError:  # a read-only home: the temp folder
        return Path(tempfile.gettempdir()) / "specee_gpu_check"


class Check:
    """One check's run: its folder, caches, device facts and the step running now."""

    def __init__(self, out: Path, cache: Path, dry: bool, budget_s: float, steps: list):
        self.out, self.cache, self.dry, self.budget_s, self.steps = out, cache, dry, budget_s, steps
        self.proc: subprocess.Popen | None = None
        self.info: dict | None = None  # check.json, its used seconds kept current
        self.current: dict | None = None
        self.t_start = time.perf_counter()
        self.env = {**os.environ, "HYDRA_FULL_ERROR": "1", "PYTHONUNBUFFERED": "1",
                    "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
                    "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}

    def command(self, step: Step, overrides: list, run_dir: Path) -> list[str]:
        return [sys.executable, str(ROOT / "run.py"), *overrides, f"hydra.run.dir={run_dir}", "force=true"]

    def record(self, row: dict) -> None:
        write_json(step_path(self.out, row["step"]), row)
        if self.info is not None:
            self.info["used_s"] = round(time.perf_counter() - self.t_start, 1)
            write_json(self.out / "check.json", self.info)
        write_summary(self.out)

    def run_step(self, step: Step, overrides: list, timeout: float) -> dict:
        name = step.name
        run_dir = self.cache / "runs" / name
        shutil.rmtree(run_dir, ignore_errors=True)
        log = self.out / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        (self.out / "results" / f"{name}.json").unlink(missing_ok=True)  # a rerun's result replaces an old one
        row = {"step": name, "status": "running", "overrides": overrides, "runtime": step.runtime,
               "timeout_s": round(timeout), "expected_s": step.expected_s, "log": f"logs/{name}.log",
               "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "check_pid": os.getpid()}
        self.current = row
        self.record(row)
        t0 = time.perf_counter()
        with log.open("w") as f:
            f.write("$ " + " ".join(self.command(step, overrides, run_dir)) + "\n")
            f.flush()
            # its own process group: a timeout (or this check being stopped) ends its compile workers too
            self.proc = subprocess.Popen(self.command(step, overrides, run_dir), cwd=ROOT, stdout=f,
                                         stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
            row["step_pid"] = self.proc.pid  # its process group, to end by hand if this check is killed
            write_json(step_path(self.out, name), row)
            try:
                rc = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill_step()
                rc = "timeout"
        self.proc = None
        row["seconds"] = round(time.perf_counter() - t0, 1)
        row["rc"] = rc
        path = run_dir / "results.json"
        if rc == 0 and path.is_file():
            doc = json.loads(path.read_text())
            (self.out / "results").mkdir(exist_ok=True)
            shutil.copyfile(path, self.out / "results" / f"{name}.json")
            m = doc["metrics"]
            row["metrics"] = {k: m[k] for k in KEYS if k in m}
            row["figures"] = figures(m)
            row["dense"] = {k: (m.get("dense") or {}).get(k) for k in ("tokens_per_s", "decode_tokens_per_s",
                                                                      "energy")}
            row["synthetic"] = doc.get("synthetic", {})
            row["gpu_only_checks"] = gpu_only_checks(overrides, m, self.dry)
            row["status"] = "check failed" if any(c["verdict"] == "fail" for c in row["gpu_only_checks"]) \
                else "passed"
        else:
            row["status"] = "timeout" if rc == "timeout" else "failed"
            tail = log_tail(log)
            row["error"] = (f"exceeded its {timeout:.0f} s timeout; the log ends:\n" + tail) if rc == "timeout" \
                else error_text(tail) if rc != 0 else f"no results.json in the run folder\n{tail}"
        self.current = None
        self.record(row)
        return row

    def kill_step(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def stopped(self, signum, _frame) -> None:
        """Stopped from outside (a session's time limit, Ctrl-C): end the step, mark it, keep the rest."""
        self.kill_step()
        if self.current is not None:
            row = {**self.current, "status": "killed", "rc": f"signal {signum}",
                   "error": f"the check was stopped (signal {signum}) during this step; the log ends:\n"
                            + log_tail(self.out / self.current["log"])}
            write_json(step_path(self.out, row["step"]), row)
        write_summary(self.out)
        sys.exit(128 + signum)


def run_steps(check: Check) -> list[dict]:
    deadline = check.t_start + check.budget_s - RESERVE_S
    for s in check.steps:  # every selected step has its file from the start
        write_json(step_path(check.out, s.name), {"step": s.name, "status": "pending", "runtime": s.runtime,
                                                  "expected_s": s.expected_s})
    write_summary(check.out)
    rows = []
    for s in check.steps:
        left = deadline - time.perf_counter()
        # A dry run still asks the GPU question (its code is checked) and runs the step on the CPU.
        why = s.skip() if s.skip else None
        overrides = dry_run(s.overrides) if check.dry else s.overrides
        if why and not check.dry:
            row = {"step": s.name, "status": "skipped", "runtime": s.runtime, "why": why, "overrides": overrides}
            check.record(row)
        elif left < MIN_STEP_S and not check.dry:
            row = {"step": s.name, "status": "skipped", "runtime": s.runtime, "overrides": overrides,
                   "why": f"time budget spent ({left:.0f} s left of {check.budget_s:.0f} s); rerun with --steps"}
            check.record(row)
        else:
            row = check.run_step(s, overrides, DRY_RUN_STEP_S if check.dry else min(s.cap_s, left))
            if why:
                row["on_a_gpu_here"] = f"would be skipped: {why}"
                check.record(row)
        rows.append(row)
        print(f"{s.name}: {row['status']} in {row.get('seconds', 0)} s "
              f"({time.perf_counter() - check.t_start:.0f} s of {check.budget_s:.0f} s used)", flush=True)
    return rows


# -- summary -------------------------------------------------------------------------------------
def alive(pid) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_steps(out: Path) -> list[dict]:
    """The step files in the plan's order (a rerun of some steps keeps the others' files). A step
    still ``running`` whose check is gone was killed with it (a SIGKILL leaves no one to say so)."""
    rows = []
    for name in STEP_NAMES:
        p = step_path(out, name)
        if not p.is_file():
            continue
        try:
            row = json.loads(p.read_text())
        except json.JSONDecodeError as err:
            row = {"step": name, "status": "unreadable", "error": f"{p.name}: {err}"}
        if row.get("status") == "running" and row.get("check_pid") != os.getpid() and not alive(row.get("check_pid")):
            row = {**row, "status": "killed", "error": "the check ended during this step (killed from outside); "
                                                       f"the log ends:\n{log_tail(out / row['log'])}"}
        rows.append(row)
    return rows


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


# -- command line --------------------------------------------------------------------------------
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
