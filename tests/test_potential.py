"""experiment=potential: exit potential, unit costs, ceilings and a verdict, before any training."""
import json
import shutil

import pytest

from conftest import TINY, run_cli

SMALL = ["dataset.count=1", "dataset.categories=[summarization,translation,qa]", "dataset.max_new_tokens=12",
         "experiment.rounds=3", "threads=1"]
CEILINGS = ("layer_skip_only", "specee_ar_perfect", "specee_ar_paper_predictors_t1",
            "specee_ar_paper_predictors_t1_t2", "eagle_chain_best", "specee_tree_best", "break_even")


def _potential(tmp_path, *args):
    res = run_cli("experiment=potential", *args, *SMALL, f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads((tmp_path / "results.json").read_text())["metrics"]


@pytest.fixture(scope="module")
def tiny_potential(tmp_path_factory):
    return _potential(tmp_path_factory.mktemp("potential"), "model=tiny")


def test_potential_on_tiny_writes_every_figure(tiny_potential):
    m = tiny_potential
    L = m["num_layers"]
    o = m["oracle_floor"]
    assert 1 <= o["first"] <= o["stable"] <= L
    lo, hi = o["interval_95"]["first"]
    assert lo <= o["first"] <= hi
    agree = m["agreement_by_layer"]["all"]
    assert len(agree) == L and agree[-1] == pytest.approx(1.0) and all(0 <= a <= 1 for a in agree)
    assert set(m["agreement_by_layer"]) >= {"all", "summarization", "translation", "qa"}
    for where in ("here", "gpu"):
        c = m["ceilings"][where]
        assert set(c) >= set(CEILINGS)
        # more costs, lower bound: layer skipping alone >= with a draft step >= with predictor calls
        assert c["layer_skip_only"]["speedup"] >= c["specee_ar_perfect"]["speedup"] \
            >= c["specee_ar_paper_predictors_t1_t2"]["speedup"] >= c["specee_ar_paper_predictors_t1"]["speedup"]
        assert c["layer_skip_only"]["speedup"] == pytest.approx(L / o["first"])
    u = m["unit_costs"]["here"]["median_us"]
    assert all(u[k] > 0 for k in ("layer", "lm_head", "predictor", "draft_step"))
    assert "1" in m["unit_costs"]["block_costs"]["median_us"] and m["unit_costs"]["gpu"]["name"]
    assert m["draft_coverage"]["top1"] <= m["draft_coverage"]["top4"]  # tiny has a draft head
    assert "at best" in m["verdict"] and m["synthetic"] is None


def test_a_qwen2_shaped_random_model_loads_through_the_same_path(tmp_path):
    """Another family (Qwen2: biases on q/k/v) from a local folder; random weights are labelled."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    tok = AutoTokenizer.from_pretrained(TINY)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    folder = tmp_path / "qwen2_small"
    Qwen2ForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    assert Qwen2ForCausalLM(cfg).model.layers[0].self_attn.q_proj.bias is not None
    m = _potential(tmp_path / "run", "model=tiny", f"model.path={folder}", "draft=none")
    assert m["num_layers"] == 3 and m["draft_coverage"] is None
    assert "A perfect draft chain" in m["verdict"]


@pytest.mark.slow
@pytest.mark.parametrize("ablation, ceiling", [("specee_t1_t2", "specee_ar_perfect"), ("eagle", "eagle_chain_best"),
                                               ("adainfer", "layer_skip_only"), ("pld", "prompt_lookup_best")])
def test_a_measured_speed_never_beats_its_ceiling(tiny_potential, tmp_path, ablation, ceiling):
    res = run_cli("experiment=speed", "model=tiny", f"ablation={ablation}", *SMALL[:3], "experiment.repeats=1",
                  "experiment.cost_rounds=0", "experiment.compare_hf_generate=false", "threads=1", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-2000:]
    measured = json.loads((tmp_path / "results.json").read_text())["metrics"]["speedup_vs_dense_ci"]
    assert measured[0] <= tiny_potential["ceilings"]["here"][ceiling]["speedup"]
