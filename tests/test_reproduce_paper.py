"""experiment=reproduce_paper (issue 42): the paper's tables for a model in one preset, run here on
Llama-2-7B's random-weight shape at minimal sizes with the paper's figures beside each row; its
plan takes the authors' bank when present; the README's 7B walkthrough composes on the shape."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specee.launch import compose_and_check

ROOT = Path(__file__).resolve().parents[1]
RANDOM = ["model.init=random", "model.device=cpu", "model.dtype=float32"]


def _plan(*overrides):
    from experiments.reproduce import plan
    return plan(compose_and_check(["experiment=reproduce_paper", *overrides]))


def test_plan_takes_the_authors_bank_when_present_and_the_trained_one_otherwise():
    authors = dict(_plan("model=llama2_7b", *RANDOM, "experiment.bank=authors"))
    trained = dict(_plan("model=llama2_7b", *RANDOM))  # auto on random weights: every bank is a stand-in
    assert "ablation=specee_t1_t2_authors" in authors["speed_specee_t1_t2_mt_bench"]
    assert "ablation=specee_full_authors" in authors["speed_specee_full_gsm8k"]
    assert "ablation=specee_t1_t2" in trained["speed_specee_t1_t2_mt_bench"]
    for jobs in (authors, trained):
        assert {"ablation=adainfer", "ablation=adainfer_crf", "ablation=eagle"} <= {a for j in jobs.values() for a in j}
        acc = jobs["accuracy_dense"]
        assert "experiment.tasks=[csqa_paper,sst2_paper]" in acc and "experiment.limit=null" in acc
        assert all("model.init=random" in j for j in jobs.values())
    # the paper's sets; alpaca only where the data root holds it (not shipped)
    sets = {n.split("_", 2)[-1] for n in trained if n.startswith("speed_dense_")}
    assert sets == {"mt_bench", "spec_bench_summarization", "spec_bench_qa", "gsm8k", "humaneval"}


@pytest.mark.slow  # 12 jobs in their own processes (~90 s on 2 cores); CI runs it in the slow tier
def test_reproduce_paper_on_random_llama2_7b_reports_the_papers_figures_beside_ours(tmp_path):
    name = f"ci_paper_{tmp_path.name}"
    report = tmp_path / "report"
    args = ["experiment=reproduce_paper", "model=llama2_7b", *RANDOM, "model.num_layers=1", "threads=1",
            f"experiment.name={name}", f"experiment.report_dir={report}", "experiment.count=1",
            "experiment.max_new_tokens=4", "experiment.speed_sets=[mt_bench]", "experiment.accuracy_limit=1",
            "experiment.ablations=[dense,specee_t1_t2,adainfer_crf]", "experiment.accuracy_ablations=[dense]",
            "experiment.stats=false",
            'experiment.speed_overrides=["experiment.cost_rounds=0","experiment.warmup=0"]']
    try:
        r = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        md = (report / "summary.md").read_text()
    finally:
        shutil.rmtree(ROOT / "runs" / "reproduce" / name, ignore_errors=True)
    page = md[md.index("## Beside the paper's own figures"):]
    page = page[: page.index("\n## ", 5)] if "\n## " in page[5:] else page
    rows = [line for line in page.splitlines() if line.startswith("| speed") or line.startswith("| accuracy")]
    assert len(rows) == 3 + 2  # three speed jobs, dense's two paper tasks
    full = next(r for r in rows if "| specee_t1_t2 |" in r)
    assert "random weights: cost only" in full  # labelled: a cost on the shape, not a model's behaviour
    assert any("2.25×" in r for r in page.splitlines()) or "not digitised" in page
    assert "within 1 point of dense" in page or "not digitised" in page
    t1t2 = full.split("|")
    assert re.match(r"\s*\d+\.\d+×", t1t2[5])  # measured speedup beside the paper's cell


def _walkthrough() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text[text.index("## Your own model on a GPU"):]
    block = block[block.index("```bash") + 7: block.index("```", block.index("```bash") + 7)]
    lines = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    m = next(line for line in lines if line.startswith("M="))
    assert "model=llama2_7b" in m
    return [line for line in lines if line.startswith("python run.py")]


def test_readme_7b_walkthrough_is_five_commands_that_compose_on_the_shape():
    cmds = _walkthrough()
    assert len(cmds) == 5
    on_shape = "model=llama2_7b " + " ".join(RANDOM)
    for cmd in cmds:
        args = shlex.split(cmd.replace("$M", on_shape))[2:]
        if args[0] == "-m":  # a sweep: each job as the launcher's check composes it
            from specee.launch import sweep_jobs
            jobs = sweep_jobs(args)
        else:
            jobs = [args]
        for job in jobs:
            compose_and_check(job)  # the report's sweep is read when it runs, after the sweep wrote it
