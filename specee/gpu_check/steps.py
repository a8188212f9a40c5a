"""The GPU check's steps: each one ``run.py experiment=speed`` job with its overrides, cap and
expected duration (measured on an H200 where it has run), its budget, its CPU dry-run form, and the
plan that says which steps fit."""
from __future__ import annotations

from typing import Callable, NamedTuple


# A short GPU session may cap one command at 10 minutes: the default budget keeps 60 s of it for
# installing the carried wheels, Python's start, the preflight, ending a step at the deadline and
# the last summary (the check stops its steps at the budget, whatever they expected).
DEFAULT_BUDGET_MIN = 9.0

MIN_STEP_S = 20  # a step that cannot get this long is skipped, not started

RESERVE_S = 5  # kept back from the budget for the last summary

DRY_RUN_STEP_S = 900  # a step's timeout in a dry run (a 2-core CPU compiles tiny's graphs in minutes)

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
    from specee.runtime.device_walk import conditional_nodes_problem  # deferred: --plan runs without torch
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
