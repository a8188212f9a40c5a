"""Checkpoints by name (issue 42): the design card's sweep over models runs as written once each
model's folders are under the models root, and refuses in one line naming the missing folder
without them; per-model defaults (the tree) come from the model's config; the paper recipe writes
where the paper ablation reads."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specee.errors import SpeceeError
from specee.launch import compose_and_check

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "specee" / "artifacts" / "tiny"
CPU = ["model.device=cpu", "model.dtype=float32"]
SMALL = ["dataset.count=1", "dataset.max_new_tokens=4", "experiment.cost_rounds=0", "experiment.warmup=0",
         "experiment.compare_hf_generate=false", "dataset.categories=[writing]"]


def _checkpoint(root: Path, name: str, layers: int) -> None:
    """A small random Llama saved under ``name`` with tiny's tokenizer, and the artifacts
    specee_t1_t2 reads beside it (random draft head and predictors, a flat exit profile): test
    fixtures for the folder layout, not models anyone measures."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from specee.early_exit.predictor import PredictorBank
    from specee.models.draft import DraftHead
    from specee.runtime.layerwise import LayerwiseLM
    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=1536, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    model = LlamaForCausalLM(conf).eval()
    model.save_pretrained(root / name)
    for f in TINY.glob("tokenizer*"):
        shutil.copy(f, root / name / f.name)
    rt = LayerwiseLM(model)
    DraftHead(model.config).attach(rt).save(root / f"{name}_draft", {"base_num_layers": layers, "hidden_size": 64})
    (root / f"{name}_predictors").mkdir()
    PredictorBank.random(layers, 4).save(root / f"{name}_predictors", {"num_layers": layers, "k": 4})
    (root / f"{name}_exit_profile").mkdir()
    (root / f"{name}_exit_profile" / "exit_profile.json").write_text(json.dumps({"exit_counts": [1] * layers}))


def _run(args, env_root: Path, tmp: Path):
    env = {**os.environ, "SPECEE_MODELS_ROOT": str(env_root)}
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


CARD = ["-m", "model=llama2_7b,llama2_13b", "ablation=dense,specee_t1_t2", "experiment=speed"]


def test_card_sweep_runs_as_written_with_model_folders(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    _checkpoint(models, "llama2_7b", 4)
    _checkpoint(models, "llama2_13b", 5)
    sweep = tmp_path / "sweep"
    r = _run([*CARD, *CPU, *SMALL, "threads=1", f"hydra.sweep.dir={sweep}"], models, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    docs = [json.loads(p.read_text()) for p in sweep.rglob("results.json")]
    got = sorted((d["config"]["model"]["name"], d["config"]["ablation"]["name"]) for d in docs)
    assert got == [("llama2_13b", "dense"), ("llama2_13b", "specee_t1_t2"),
                   ("llama2_7b", "dense"), ("llama2_7b", "specee_t1_t2")]
    for d in docs:  # each job read its own model's folders, found by name
        name = d["config"]["model"]["name"]
        assert d["config"]["model"]["path"] == f"{models}/{name}"
        assert d["config"]["draft"]["path"] == f"{models}/{name}_draft"
        assert d["config"]["early_exit"]["predictors_path"] == f"{models}/{name}_predictors"
        assert d["synthetic"] == {}


def test_card_sweep_refuses_in_one_line_naming_the_missing_folder(tmp_path):
    models = tmp_path / "empty_models"
    models.mkdir()
    r = _run([*CARD, *CPU, *SMALL, f"hydra.sweep.dir={tmp_path / 'sweep'}"], models, tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert str(models / "llama2_7b") in lines[0] and "SPECEE_MODELS_ROOT" in lines[0]
    assert not (tmp_path / "sweep").exists()  # refused before Hydra made anything


def test_each_missing_artifact_named_with_its_fill(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    _checkpoint(models, "llama2_7b", 4)
    shutil.rmtree(models / "llama2_7b_predictors")
    os.environ["SPECEE_MODELS_ROOT"] = str(models)
    try:
        with pytest.raises(SpeceeError) as err:
            compose_and_check(["model=llama2_7b", "ablation=specee_t1_t2", *CPU])
        assert compose_and_check(["model=llama2_7b", "ablation=dense", *CPU]).model.path == f"{models}/llama2_7b"
        # a per-model override still works: the bank from another folder
        shutil.copytree(models / "llama2_7b_draft", tmp_path / "elsewhere_draft")
        _checkpoint(tmp_path, "elsewhere", 4)
        cfg = compose_and_check(["model=llama2_7b", "ablation=specee_t1_t2", *CPU,
                                 f"early_exit.predictors_path={tmp_path}/elsewhere_predictors"])
        assert cfg.early_exit.predictors_path == f"{tmp_path}/elsewhere_predictors"
    finally:
        del os.environ["SPECEE_MODELS_ROOT"]
    msg = str(err.value)
    assert len(msg.splitlines()) == 1
    assert f"{models}/llama2_7b_predictors" in msg and "experiment=train_predictors model=llama2_7b" in msg
    assert f"{models}/llama2_7b_draft" not in msg  # only what is missing


def test_random_shapes_run_for_every_model_with_the_paper_like_profile_standing_in():
    for name, layers in (("llama2_7b", 32), ("llama2_13b", 40)):
        cfg = compose_and_check([f"model={name}", "model.init=random", *CPU, "ablation=specee_t1_t2"])
        from specee.early_exit.schedule import build_schedule
        from specee.early_exit.standin import PAPER_LIKE, profile_dir
        from specee.io import project_path
        from specee.results import synthetic_inputs
        assert profile_dir(cfg, cfg.placement) == project_path(PAPER_LIKE)
        sched = build_schedule(cfg.placement, layers, profile_dir(cfg, cfg.placement))
        assert sched is not None
        syn = synthetic_inputs(cfg)
        assert "paper_like_32l_exit_profile" in syn["exit_profile"] and "synthetic" in syn["exit_profile"]


def test_synthetic_profile_rescales_keeping_depth_share():
    from specee.early_exit.standin import fit_depth
    prof = json.loads((ROOT / "specee/artifacts/paper_like_32l_exit_profile/exit_profile.json").read_text())
    for L in (4, 32, 40):
        c = fit_depth(prof, L)
        assert len(c) == L and sum(c) == sum(prof["exit_counts"]) and c[-1] == prof["exit_counts"][-1]
        mean = sum((i + 1) * n for i, n in enumerate(c[:-1])) / sum(c[:-1])
        ref = sum((i + 1) * n for i, n in enumerate(prof["exit_counts"][:-1])) / sum(prof["exit_counts"][:-1])
        assert abs(mean / L - ref / 32) < 0.6 / L + 0.02
    measured = {"exit_counts": [1, 2, 3]}
    assert fit_depth(measured, 5) == [1, 2, 3]  # a measured profile is never rescaled


def test_per_model_tree_and_tiny_unchanged():
    assert compose_and_check(["model=tiny", "ablation=eagle"]).ablation.tree == "small"
    assert compose_and_check(["model=tiny", "ablation=specee_full"]).ablation.tree == "small"
    for name in ("llama2_7b", "llama2_13b"):
        cfg = compose_and_check([f"model={name}", "model.init=random", *CPU, "ablation=eagle"])
        assert cfg.ablation.tree == "mc_sim_7b_63" and cfg.model.chat_template == "llama2_chat"
    cfg = compose_and_check(["model=llama2_7b", "model.init=random", *CPU, "ablation=eagle", "ablation.tree=small"])
    assert cfg.ablation.tree == "small"  # the ablation's own tree wins


def test_fine_tune_under_a_base_config_keeps_its_own_name(tmp_path):
    os.environ["SPECEE_MODELS_ROOT"] = str(tmp_path)
    try:
        from hydra import compose, initialize_config_dir
        from specee.config import register
        register()
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", ["model=llama2_7b", "model.name=my_ft", "experiment=train_predictors"])
        assert cfg.model.path == f"{tmp_path}/my_ft"  # interpolations resolve here, under the variable
        assert cfg.draft.path == f"{tmp_path}/my_ft_draft"
        assert cfg.experiment.out_dir == f"{tmp_path}/my_ft_predictors"
        assert cfg.experiment.adainfer_out_dir == f"{tmp_path}/my_ft_adainfer"
    finally:
        del os.environ["SPECEE_MODELS_ROOT"]


def test_paper_recipe_writes_where_the_paper_ablation_reads():
    from hydra import compose, initialize_config_dir
    from experiments.train_predictors import bank_dir
    from specee.config import register
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        train = compose("config", ["model=tiny", "experiment=train_predictors", "experiment.recipe=paper"])
        harness = compose("config", ["model=tiny", "experiment=train_predictors"])
        read = compose("config", ["model=tiny", "ablation=specee_t1_t2_paper"])
        both = compose("config", ["model=tiny", "experiment=train_predictors", "experiment.recipe=paper",
                                  "ablation=specee_t1_t2_paper"])
        mine = compose("config", ["model=tiny", "experiment=train_predictors", "experiment.recipe=paper",
                                  "experiment.out_dir=somewhere"])
    assert bank_dir(train) == read.early_exit.predictors_path == bank_dir(both)
    assert bank_dir(harness) == harness.early_exit.predictors_path
    assert bank_dir(mine) == "somewhere"  # an explicit folder is kept
