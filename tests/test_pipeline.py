"""Every recipe end to end at micro scale, through the real CLI: base -> draft -> predictors -> speed."""
import json

import pytest

from conftest import MICRO_BASE, ROOT, run_cli  # noqa: F401 - the micro fixture lives in conftest

def test_draft_card_reports_agreement(micro):
    root, _ = micro
    card = json.loads((root / "draft" / "draft_card.json").read_text())
    q = card["held_out_agreement"]
    assert 0 <= q["top1"] <= q["top4"] <= 1 and q["positions"] > 0
    assert card["base_num_layers"] == 4


def test_predictor_card_describes_its_training(micro):
    root, _ = micro
    card = json.loads((root / "pred" / "predictors_card.json").read_text())
    assert card["k"] == 4 and card["num_layers"] == 4 and len(card["per_layer"]) == 3
    assert len(card["data_sha256"]) == 64 and "p_prev" in card["feature_definition"]
    assert card["calibration_prompt_ids"] and card["collected_tokens"] > 0


def test_exit_profile_and_statistics(micro, tmp_path):
    root, paths = micro
    prof = json.loads((root / "profile" / "exit_profile.json").read_text())
    assert len(prof["exit_counts"]) == 4 and sum(prof["exit_counts"]) == prof["tokens"] > 0
    res = run_cli("experiment=stats", *paths, "dataset.categories=[writing,qa]", "dataset.max_new_tokens=12",
                  "experiment.max_n=3", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-2000:]
    m = json.loads((tmp_path / "results.json").read_text())["metrics"]
    assert set(m["placements"]) == {"all_layers", "offline_topm", "online_union", "online_union_reference"}
    dist = m["exit_distribution"]["all"]
    assert abs(sum(dist["share_per_layer"]) - 1) < 1e-3
    cs = m["context_similarity"]["per_category"]["all"]
    assert [r["n"] for r in cs] == [1, 2, 3] and all(0 <= r["shuffled_chance"] <= 1 for r in cs)
    assert set(m["missed_exits"]) == {"offline_topm", "online_union", "online_union_reference"}
    assert 0 <= dist["skew_bottom_half_by_probability"] <= dist["share_of_exits_in_shallower_half_by_depth"] + 0.5
    assert 1 <= m["oracle"]["oracle_avg_layers"] <= m["oracle"]["oracle_stable_avg_layers"] <= 4
    assert m["oracle_avg_layers"] == m["oracle"]["oracle_avg_layers"]
    assert m["skew_bottom_half_by_probability"] == dist["skew_bottom_half_by_probability"]
    for row in m["placements"].values():
        assert row["avg_layers_over_oracle"] > 0


@pytest.mark.parametrize("ablation", ["dense", "specee_t1_t2", *(pytest.param(a, marks=pytest.mark.slow) for a in (
    "specee_t1", "adainfer", "eagle", "specee_full"))])  # dense and T1+T2 in the fast tier
def test_speed_run_writes_a_self_describing_result(micro, ablation, tmp_path):
    root, paths = micro
    args = [f"ablation={ablation}", *paths, "dataset.categories=[writing,qa]", "dataset.max_new_tokens=12",
            f"hydra.run.dir={tmp_path}"]
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    m = doc["metrics"]
    assert doc["config"]["ablation"]["name"] == ablation and doc["env"]["packages"]["torch"]
    assert doc["env"]["seed"] == 0 and doc["env"]["dtype"] == "float32"
    for key in ("tokens_per_s", "latency_ms_per_token", "avg_layers", "speedup_vs_dense",
                "match_rate_vs_dense", "hf_generate_ratio"):
        assert key in m
    assert m["hf_generate_identical_share"] == 1.0
    # The paper's end-to-end speedup against HF generate, for every mode and for the dense loop.
    assert m["speedup_vs_hf_generate"] > 0 and m["dense"]["speedup_vs_hf_generate"] > 0
    assert m["speedup_vs_hf_generate"] == pytest.approx(m["tokens_per_s"] / m["hf_generate_tokens_per_s"])
    bb = m["bandwidth_bound"]
    assert bb["limit_ms_per_token"] > 0 and bb["bytes_per_token"]["kv"] > 0 and bb["copy_gb_per_s"] > 0
    assert m["ms_per_token_over_limit"] == pytest.approx(m["ms_per_token"] / bb["limit_ms_per_token"])
    assert 1 <= m["avg_layers"] <= m["num_layers"] == 4
    if ablation in ("dense", "eagle"):  # lossless modes
        assert m["match_rate_vs_dense"] == 1.0
    if ablation == "dense":
        assert m["avg_layers"] == 4
    elif ablation in ("eagle", "specee_full"):
        assert m["mean_accepted_length"] >= 1 and m["verification_steps"] > 0
        assert m["tree_shape"]["independent_evals_per_layer"] < m["tree_shape"]["nodes"]
    else:
        for key in ("predictor_calls_per_token", "overhead_share", "draft_share", "efficiency"):
            assert key in m
    if ablation in ("specee_t1", "specee_t1_t2", "adainfer"):
        assert len(doc["prompts"][0]["trace"]) == doc["prompts"][0]["tokens"] - 1
    # Counted work x unit costs measured in the same job, beside the measured speedup.
    cm = m["cost_model"]
    assert cm["modelled_speedup_vs_dense"] > 0 and cm["units_us"]["layer"] > 0
    assert cm["counts"]["layer_steps"] + cm["counts"]["tree_layer_steps"] > 0
    assert set(cm["predicted_gpu"]["speedup_vs_dense"]) == {"llama2_7b", "llama2_13b"}
    if ablation == "dense":
        assert cm["modelled_speedup_vs_dense"] == pytest.approx(1.0)
    if ablation in ("specee_t1", "specee_t1_t2", "adainfer", "specee_full"):  # exits against the oracle
        g = m["oracle_gap"]
        assert g["tokens"] > 0 and m["avg_layers_over_oracle"] == g["avg_layers_over_oracle"] > 0
    else:
        assert "oracle_gap" not in m
    # A rerun into the same directory skips the finished job.
    again = run_cli(*args)
    assert again.returncode == 0 and "skipping" in again.stdout


def test_evaluation_prompts_overlapping_calibration_are_refused(micro, tmp_path):
    _, paths = micro
    res = run_cli("ablation=specee_t1", *paths, "dataset.offset=10", "dataset.count=1",
                  f"hydra.run.dir={tmp_path}")
    assert res.returncode == 2 and "used to train the predictors" in res.stderr
    assert not (tmp_path / "results.json").exists()


def test_specee_without_a_draft_is_refused(micro, tmp_path):
    _, paths = micro
    res = run_cli("ablation=specee_t1", "draft=none", *paths[:1], f"hydra.run.dir={tmp_path}")
    assert res.returncode == 2 and "draft" in res.stderr and "Traceback" not in res.stderr


def test_corrupt_predictor_artifact_is_one_clear_error(micro, tmp_path):
    root, paths = micro
    bad = tmp_path / "pred"
    bad.mkdir()
    (bad / "predictors_card.json").write_text((root / "pred" / "predictors_card.json").read_text())
    (bad / "predictors.safetensors").write_bytes(b"garbage")
    args = [p for p in paths if not p.startswith("early_exit.predictors_path")]
    res = run_cli("ablation=specee_t1", *args, f"early_exit.predictors_path={bad}",
                  "dataset.categories=[writing]", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 2 and "corrupt" in res.stderr and "Traceback" not in res.stderr


def _pdf_pages(path) -> int:
    import re
    return len(re.findall(rb"/Type\s*/Page[^s]", path.read_bytes()))


@pytest.mark.slow
def test_sweep_collect_and_report(micro, tmp_path):
    """A real two-job sweep (one process per job), rerun skips, then table + PDF from stored results."""
    _, paths = micro
    sweep = ["-m", "ablation=dense,specee_t1", *paths, "dataset.categories=[writing,qa]",
             "dataset.max_new_tokens=10", "sweep_name=test", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    res = run_cli(*sweep)
    assert res.returncode == 0, res.stderr[-2000:]
    found = sorted((tmp_path / "sweep").rglob("results.json"))
    assert len(found) == 2
    again = run_cli(*sweep)
    assert again.returncode == 0 and again.stdout.count("skipping") == 2
    res = run_cli("experiment=stats", *paths, "dataset.categories=[writing,qa]", "dataset.max_new_tokens=10",
                  "experiment.max_n=3", f"hydra.run.dir={tmp_path / 'sweep' / 'stats'}")
    assert res.returncode == 0, res.stderr[-2000:]

    res = run_cli("experiment=collect", f"sweep={tmp_path / 'sweep'}", f"hydra.run.dir={tmp_path / 'c'}")
    assert res.returncode == 0, res.stderr[-2000:]
    import pandas as pd
    table = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert len(table) == 3 and {"metrics.speedup_vs_dense", "ablation.name", "env.torch"} <= set(table.columns)

    out = tmp_path / "report"
    res = run_cli("experiment=report", f"sweep={tmp_path / 'sweep'}", f"experiment.out_dir={out}",
                  f"hydra.run.dir={tmp_path / 'r'}")
    assert res.returncode == 0, res.stderr[-2000:]
    # cover + speedup per category + staircase (dense, T1) + measured against modelled + where a
    # token's time goes on a GPU per path + exit distribution + context similarity + overhead +
    # exits against the oracle + verdicts on the paper's claims (from the stats job); accuracy is
    # skipped with its reason.
    assert _pdf_pages(out / "report.pdf") == 10
    assert "## Where a token's time goes on a GPU, per path" in (out / "summary.md").read_text()
    md = (out / "summary.md").read_text()
    assert "## Verdicts on the paper's claims" in md and "skewed exits (Fig. 10)" in md
    assert "## Ablation staircase" in md and "Accuracy: no accuracy results" in md
    assert "## Measured against modelled speedup" in md and "## Exits against the oracle" in md
    assert "bottom half by exit probability" in md and "oracle floor" in md and "vs HF generate" in md
    assert "× bandwidth floor" in md and "×) |" in md


@pytest.mark.slow
def test_submitit_local_launcher_runs_the_same_path(micro, tmp_path):
    _, paths = micro
    res = run_cli("-m", "hydra/launcher=local", "ablation=dense", *paths, "dataset.categories=[writing]",
                  "dataset.max_new_tokens=6", f"hydra.sweep.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(list(tmp_path.rglob("results.json"))) == 1


def _main_job_config():
    """The main job's config as `python run.py` composes it (its preset: conf/experiment/reproduce.yaml)."""
    from hydra import compose, initialize_config_dir

    from specee.config import register
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose("config", overrides=["experiment=reproduce", "model=tiny"])


def test_reproduce_plan_covers_the_ablations():
    from experiments.reproduce import plan
    cfg = _main_job_config()
    names = [n for n, _ in plan(cfg)]
    # the default main job (cut to its time budget): the staircase, EAGLE and prompt lookup (ours, with
    # transformers' beside it in the same job)
    assert names == ["speed_dense", "speed_pld", "speed_specee_t1_t2",
                     "speed_eagle", "speed_specee_full", "stats", "accuracy_dense", "accuracy_dense_perplexity",
                     "accuracy_specee_t1_t2", "accuracy_specee_t1_t2_perplexity"]
    jobs = dict(plan(cfg))
    # the main job's budget: 25 accuracy items, 6 TinyStories stories for perplexity
    assert "experiment.limit=25" in jobs["accuracy_specee_t1_t2"]
    assert "experiment.limit=6" in jobs["accuracy_specee_t1_t2_perplexity"]
    assert "dataset.count=1" in jobs["stats"] and "experiment.placements=[all_layers,offline_topm,online_union]" in jobs["stats"]


def test_full_reproduction_preset_plans_every_variant():
    from hydra import compose, initialize_config_dir

    from experiments.reproduce import plan
    from specee.config import register
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["experiment=reproduce_full"])
    names = [n for n, _ in plan(cfg)]
    assert cfg.experiment.name == "full"
    assert names == ["speed_dense", "speed_pld", "speed_hf_pld", "speed_adainfer", "speed_specee_t1",
                     "speed_specee_t1_t2", "speed_specee_t1_t2_tuned", "speed_eagle", "speed_specee_full",
                     "speed_specee_t1_propagate", "speed_specee_full_independent", "speed_dense_compiled",
                     "speed_specee_t1_t2_compiled", "speed_specee_t1_t2_tuned_compiled", "speed_eagle_compiled",
                     "speed_specee_full_compiled", "stats", "accuracy_dense", "accuracy_specee_t1_t2"]
    jobs = dict(plan(cfg))
    assert "runtime=compiled" in jobs["speed_eagle_compiled"] and "ablation=eagle" in jobs["speed_eagle_compiled"]
    assert not any(a.startswith("runtime=") for a in jobs["speed_eagle"])
    assert "experiment.tasks=[boolq,piqa,copa,tinystories_ppl]" in jobs["accuracy_dense"]


def test_reproduce_plan_runs_perplexity_tasks_as_their_own_job_with_their_own_limit():
    from omegaconf import OmegaConf

    from experiments.reproduce import plan
    from specee.config import Config, ModelConfig, ReproduceExperiment
    cfg = OmegaConf.structured(Config(experiment=ReproduceExperiment(
        accuracy_ablations=["dense", "specee_t1_t2_tuned"], accuracy_tasks=["piqa", "winogrande"], accuracy_limit=200,
        perplexity_tasks=["tinystories_ppl"], perplexity_limit=20)))
    cfg.model = OmegaConf.structured(ModelConfig(name="smollm2_135m"))
    jobs = {n: a for n, a in plan(cfg) if n.startswith("accuracy_")}
    assert list(jobs) == ["accuracy_dense", "accuracy_dense_perplexity", "accuracy_specee_t1_t2_tuned",
                          "accuracy_specee_t1_t2_tuned_perplexity"]
    assert "experiment.tasks=[piqa,winogrande]" in jobs["accuracy_dense"] and "experiment.limit=200" in jobs["accuracy_dense"]
    ppl = jobs["accuracy_specee_t1_t2_tuned_perplexity"]
    assert "experiment.tasks=[tinystories_ppl]" in ppl and "experiment.limit=20" in ppl
    assert "ablation=specee_t1_t2_tuned" in ppl


def test_smollm2_reproduction_preset_plans_the_committed_report():
    from hydra import compose, initialize_config_dir

    from experiments.reproduce import plan
    from specee.config import register
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["experiment=reproduce_smollm2_135m", "model=smollm2_135m"])
    jobs = dict(plan(cfg))
    assert cfg.experiment.name == "smollm2_135m"
    for a in ("dense", "specee_t1_t2", "specee_t1_t2_tuned"):
        assert "experiment.limit=200" in jobs[f"accuracy_{a}"]
        assert "experiment.tasks=[tinystories_ppl]" in jobs[f"accuracy_{a}_perplexity"]
    assert "speed_eagle_compiled" in jobs and "speed_specee_full_compiled" in jobs
    assert not any(n.endswith(("_propagate", "_independent")) for n in jobs)
    chat = jobs["accuracy_specee_t1_t2_tuned_chat"]
    assert "experiment.chat_template=true" in chat and "experiment.tasks=[boolq_gen_flex,sst2_gen_flex]" in chat
    assert not any("chat_template" in a for a in jobs["accuracy_dense"])
