"""scripts/gpu_check.py without a GPU: its plan, its CPU mapping of every step, its goal table, and
its steps run at minimal size on the CPU (--dry-run), so a typo in a GPU-only path fails here."""
import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_steps_in_order_of_value_within_the_budget():
    names = [s[0] for s in gpu_check.STEPS]
    assert names[:2] == ["tiny_eagle_float16", "tiny_specee_full_bfloat16"]  # the unconfirmed fix first
    assert names.index("llama2_7b_dense_baselines") < names.index("llama2_7b_t1_t2_graphed") \
        < names.index("llama2_7b_t1_t2_t3_graphed")
    rows = gpu_check.plan(gpu_check.STEPS, 7.5 * 60 - gpu_check.RESERVE_S)
    assert rows[0]["fits_at_worst"] and 7.5 <= 8  # the default budget stays within 8 minutes
    baselines = dict((s[0], s[1]) for s in gpu_check.STEPS)["llama2_7b_dense_baselines"]
    assert gpu_check.HF_STATIC in baselines and "runtime.compile_mode=reduce-overhead" in baselines
    device = [s for s in gpu_check.STEPS if s[0] == "llama2_7b_t1_t2_device"][0]
    assert "runtime.exit_control=device" in device[1] and device[3] is gpu_check.conditional_nodes_missing
    assert gpu_check.conditional_nodes_missing() is None or "torch" in gpu_check.conditional_nodes_missing()


def test_dry_run_maps_every_step_to_the_cpu_at_minimal_size():
    for name, overrides, *_ in gpu_check.STEPS:
        cpu = gpu_check.dry_run(overrides)
        assert not any("cuda" in o for o in cpu), name
        assert "model=tiny" in cpu and "model.device=cpu" in cpu and "dataset.max_new_tokens=3" in cpu
        kept = [o for o in overrides if o.startswith(("ablation=", "runtime", "early_exit.", "placement.",
                                                      "experiment."))
                and not o.startswith("experiment.cost_rounds")]
        assert all(o in cpu for o in kept), name  # the same mode, runtime, exit control and replay


def _row(step, **figures):
    return {"step": step, "rc": 0, "figures": figures}


def test_goal_table_reads_each_figure_from_its_step_and_says_why_one_is_missing():
    rows = [_row("llama2_7b_dense_baselines", dense_eager_vs_hf_generate=0.9),
            _row("llama2_7b_t1_t2_eager", speedup_vs_dense=1.0, speedup_vs_hf_generate=0.7,
                 dense_eager_vs_hf_generate=1.05),
            _row("llama2_7b_t1_t2_graphed", speedup_vs_dense=1.22, speedup_vs_hf_generate=1.4,
                 speedup_vs_hf_static_compiled=0.95, speedup_vs_strongest_dense=0.95),
            {"step": "llama2_7b_t1_t2_device", "rc": "skipped", "skipped_why": "torch 2.11 has no conditional nodes"},
            _row("llama2_7b_eagle_graphed", speedup_vs_dense=1.5),
            _row("llama2_7b_t1_t2_t3_graphed", speedup_vs_dense=1.65)]
    g = {r["figure"]: r for r in gpu_check.goals(rows)}
    assert g["eager dense vs HF generate eager"]["measured"] == 1.05  # the eager job's, paired there
    assert g["eager dense vs HF generate eager"]["verdict"] == "met"
    assert g["T1+T2 graphed vs dense graphed"]["verdict"] == "met"
    assert g["best T1+T2 vs HF generate eager (the paper's metric)"]["measured"] == 1.4
    assert g["best T1+T2 vs HF static-compiled generate"]["verdict"] == "missed"
    assert g["T1+T2+T3 graphed vs EAGLE graphed"]["measured"] == pytest.approx(1.1)
    dev = g["T1+T2 device-resident vs dense graphed"]
    assert dev["measured"] is None and "no conditional nodes" in dev["verdict"]
    md = gpu_check.markdown({"date": "d", "torch": "t", "budget_s": 450, "used_s": 1}, rows)
    assert "## Goals (issue 41)" in md and "not measured (llama2_7b_t1_t2_device: torch 2.11" in md


def _dry_run(tmp_path, steps: str | None):
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path)]
    res = subprocess.run(cmd + (["--steps", steps] if steps else []), cwd=ROOT, capture_output=True, text=True,
                         timeout=3000)
    summary = json.loads(next(tmp_path.glob("*/summary.json")).read_text())
    return res, summary


def test_dry_run_of_a_tree_step_passes_on_the_cpu(tmp_path):
    res, summary = _dry_run(tmp_path, "tiny_eagle_float16")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (row,) = summary["steps"]
    assert row["rc"] == 0 and row["figures"]["speedup_vs_dense"] and summary["device"]["dry_run"]
    assert len(summary["goals"]) == len(gpu_check.GOALS)


@pytest.mark.slow  # every step on tiny, compiled ones included: several minutes on a 2-core CPU
def test_dry_run_of_every_step_passes_on_the_cpu(tmp_path):
    res, summary = _dry_run(tmp_path, None)
    assert res.returncode == 0, res.stdout[-3000:] + json.dumps([r for r in summary["steps"] if r["rc"] != 0])[-3000:]
    assert [r["step"] for r in summary["steps"]] == [s[0] for s in gpu_check.STEPS]
    device = {r["step"]: r for r in summary["steps"]}["llama2_7b_t1_t2_device"]
    assert device["figures"]["walk_syncs_per_token"] == 0  # exits decided on the device: no host round trip
    assert all(g["measured"] is not None for g in summary["goals"])
