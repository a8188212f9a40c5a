"""Verdicts a reader can trust: "not testable here" whenever dense's interval reaches chance (read
as printed), each row naming its model, protocol and bank, and per-item records that let a later
row pair with an earlier report's dense without rerunning it."""
import json

import pytest
from omegaconf import OmegaConf

from specee import verdicts
from specee.intervals import paired_change


def _doc(name, mode, values, chance, task="sst2_paper", model="smollm2_135m",
         predictors="specee/artifacts/smollm2_135m_predictors_paper", settings=None):
    n = len(values)
    acc = sum(values) / n
    return {"specee_results": 1, "created": "2026-12-03T00:00:00+00:00", "device": "cpu",
            "config": {"experiment": {"_target_": "experiments.accuracy.run"}, "model": {"name": model},
                       "ablation": {"name": name, "mode": mode}, "early_exit": {"predictors_path": predictors},
                       "runtime": {"kind": "eager"}},
            "env": {"cpu": "test cpu", "torch_threads": 2, "gpus": []},
            "settings": settings or {"limit": None, "num_fewshot": 0, "max_gen_tokens": 128, "seed": 0},
            "metrics": {"accuracy": {task: {"accuracy": acc, "accuracy_stderr": (acc * (1 - acc) / (n - 1)) ** 0.5,
                                            "primary_metric": "exact_match_paper_offset", "chance": chance, "n": n,
                                            "protocol": "specee_paper"}}, "mode": mode},
            "items": {task: {str(i): {"value": v, "answer": str(v)} for i, v in enumerate(values)}}}


def _sst2(dense_right=465, n=872, changed_to_right=88, changed_to_wrong=31):
    """SmolLM2's SST-2 under the paper's protocol: dense 465 of 872, T1+T2 119 answers changed."""
    dense = [1.0] * dense_right + [0.0] * (n - dense_right)
    mode = list(dense)
    for i in range(changed_to_wrong):
        mode[i] = 0.0
    for i in range(changed_to_right):
        mode[dense_right + i] = 1.0
    return (_doc("dense", "dense", dense, 0.5),
            _doc("specee_t1_t2_paper", "specee", mode, 0.5))


def test_sst2_on_smollm2_is_not_testable_here():
    rows = verdicts.verdict_rows(list(_sst2()))
    assert len(rows) == 1
    r = rows[0]
    # the normal approximation put dense's lower end at 50.01 (above chance by a hundredth): the
    # exact interval starts at 49.95 and the printed one at 50.0 — at chance either way
    assert r["dense"] == "53.3 [50.0, 56.7]" and r["dense_interval"] == "exact binomial"
    assert r["verdict"] == "not testable here" and "reaches chance 50" in r["why"]
    assert (r["model"], r["bank"], r["bank_source"]) == ("smollm2_135m", "paper-recipe bank",
                                                         "smollm2_135m_predictors_paper")
    assert r["protocol"].startswith("the paper's")
    md = verdicts.markdown(rows)
    assert "| smollm2_135m | sst2_paper |" in md and "`smollm2_135m_predictors_paper`" in md


def test_a_model_clearly_above_chance_is_judged():
    dense, mode = _sst2(dense_right=520, changed_to_right=0, changed_to_wrong=0)
    r, = verdicts.verdict_rows([dense, mode])
    assert r["verdict"] == "confirmed" and "why" not in r


@pytest.mark.parametrize("right, n, chance, testable", [
    (230, 1221, 0.2, False),   # CommonsenseQA: 18.8 %, below chance
    (465, 872, 0.5, False),    # SST-2: 53.3 %, its interval reaches 50
    (480, 872, 0.5, True),     # 55.0 %: [51.7, 58.3]
    (60, 200, 0.25, False),    # 30 %: exact [23.7, 36.9] vs 25
])
def test_reaches_chance_reads_the_exact_interval(right, n, chance, testable):
    lo, hi, how = verdicts.dense_interval({"accuracy": right / n, "n": n, "accuracy_stderr": 0.0})
    assert how == "exact binomial" and lo < 100 * right / n < hi
    assert verdicts.reaches_chance(lo, chance) is not testable


def test_exact_interval_matches_known_values():
    lo, hi = verdicts.exact_interval(465, 872)
    assert lo == pytest.approx(0.499506, abs=1e-6) and hi == pytest.approx(0.566783, abs=1e-6)
    assert verdicts.exact_interval(0, 10) == (0.0, pytest.approx(0.308497, abs=1e-6))


def test_rows_of_two_models_are_not_mixed():
    a = _sst2(dense_right=520, changed_to_right=0, changed_to_wrong=0)
    b = [_doc(d["config"]["ablation"]["name"], d["config"]["ablation"]["mode"],
              [v["value"] for v in d["items"]["sst2_paper"].values()], 0.5, model="other") for d in _sst2()]
    rows = verdicts.verdict_rows([*a, *b])
    assert {(r["model"], r["verdict"]) for r in rows} == {("smollm2_135m", "confirmed"), ("other", "not testable here")}


def test_records_pair_a_later_row_with_an_earlier_dense(tmp_path):
    dense, mode = _sst2(dense_right=520)
    both = verdicts.verdict_rows([dense, mode])
    written = verdicts.write_item_records([dense, mode], tmp_path / "report")
    assert sorted(p.relative_to(tmp_path / "report").as_posix() for p in written) == [
        "items/smollm2_135m/sst2_paper/dense.jsonl", "items/smollm2_135m/sst2_paper/specee_t1_t2_paper.jsonl"]
    assert written[0].stat().st_size < 60_000  # small enough to commit (872 items)
    # a later sweep holds only the mode's run, and the earlier report's dense records
    later = tmp_path / "sweep"
    (later / "items/smollm2_135m/sst2_paper").mkdir(parents=True)
    (later / "items/smollm2_135m/sst2_paper/dense.jsonl").write_text(written[0].read_text())
    docs = verdicts.with_item_records([mode], later)
    assert len(docs) == 2 and docs[1]["item_records"].endswith("dense.jsonl")
    paired = verdicts.verdict_rows(docs)
    assert [(r["figure"], r["verdict"]) for r in paired] == [(r["figure"], r["verdict"]) for r in both]
    # a dense record under other settings does not pair
    other = json.loads(written[0].read_text().splitlines()[0])
    other["settings"]["max_gen_tokens"] = 3
    lines = written[0].read_text().splitlines()
    (later / "items/smollm2_135m/sst2_paper/dense.jsonl").write_text(
        "\n".join([json.dumps(other)] + lines[1:]) + "\n")
    r, = verdicts.verdict_rows(verdicts.with_item_records([mode], later))
    assert r["verdict"] == "not testable here" and "max_gen_tokens" in r["why"]


def test_report_keeps_the_records_it_rests_on(tmp_path):
    from experiments.report import run
    sweep = tmp_path / "sweep"
    for d in _sst2(dense_right=520):
        job = sweep / d["config"]["ablation"]["name"]
        job.mkdir(parents=True)
        (job / "results.json").write_text(json.dumps(d))
    out = tmp_path / "report"
    run(OmegaConf.create({"sweep": str(sweep), "experiment": {"out_dir": str(out)}}))
    assert (out / "items/smollm2_135m/sst2_paper/dense.jsonl").is_file()
    summary = (out / "summary.md").read_text()
    assert "| smollm2_135m | sst2_paper |" in summary and "confirmed" in summary


def test_the_records_a_report_writes_are_ignored_so_the_main_job_leaves_only_its_pages_changed():
    """The main job rewrites reports/default/ (report.pdf, summary.md: committed) and its per-item
    records (regenerated each time: ignored); git status then lists only the committed pages."""
    import shutil
    import subprocess

    from conftest import ROOT
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    rels = list(verdicts.item_records(list(_sst2())))
    assert rels and all(r.startswith(f"{verdicts.ITEMS}/") for r in rels)
    paths = [f"reports/default/{r}" for r in rels]
    ignored = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert sorted(ignored) == sorted(paths)
    pages = ["reports/default/report.pdf", "reports/default/summary.md"]
    tracked = subprocess.run(["git", "ls-files", *pages], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert sorted(tracked) == pages
    none = subprocess.run(["git", "check-ignore", *pages], cwd=ROOT, capture_output=True, text=True)
    assert none.returncode == 1 and not none.stdout  # none of the pages is ignored
