"""The per-run cost model: work counted from traces, priced by unit costs, projected elsewhere."""
import json
import math
import random

import pytest
import torch

from specee.cost_model import priced_work as cm
from specee.decoding.base import Generation

L = 32
UNITS = {"layer": 100.0, "lm_head": 60.0, "predictor": 20.0, "probe": 4.0, "adainfer_probe": 70.0, "rule_probe": 9.0,
         "draft_step": 180.0, "draft_tree": 500.0, "tree_layer": 130.0, "tree_lm_head": 90.0,
         "sync": 5.0, "step_overhead": 40.0}
ZERO = dict.fromkeys(UNITS, 0.0) | {"layer": 100.0}


def dense_counts(layers=L):
    return cm.count_work([Generation([1] * 9, 0.0, [], [])], layers, "dense")


def bare_mode(layers_per_token: float) -> dict:
    """A mode running ``layers_per_token`` block-1 layers and one LM head per token, nothing else."""
    return dense_counts() | {"layer_steps": layers_per_token}


def samples(table: dict, rounds: int, spread: float = 0.0, seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {u: [v * (1 + spread * rng.uniform(-1, 1)) for _ in range(rounds)] for u, v in table.items()}


# -- counts from hand-built generations -----------------------------------------------------

def test_count_work_autoregressive_specee():
    L4 = 4
    steps = [  # exit at layer 1 after one verification; then no exit, a failed verification
        {"exit_layer": 1, "layers": 2, "pred_calls": 2, "verify_calls": 1, "delta_probes": 0, "syncs": 5},
        {"exit_layer": 3, "layers": 4, "pred_calls": 3, "verify_calls": 1, "delta_probes": 1, "syncs": 6},
    ]
    c = cm.count_work([Generation([7, 8, 9], 0.0, [], [4, 2, 4], steps)], L4, "specee", "autoregressive")
    assert c["tokens"] == 2 and c["steps"] == 1 and c["draft_steps"] == 1 and c["draft_trees"] == 0
    assert c["layer_steps"] == 3 and c["tree_layer_steps"] == 0 and c["avg_layers"] == 3
    assert c["lm_heads"] == 1.5  # two verifications + the final head of the step without exit
    assert c["predictor_calls"] == 2.5 and c["delta_probes"] == 0.5 and c["syncs"] == 5.5
    # reads inside units: 1 draft + 2.5 predictor + 1.5 head per token; left: the exited token's re-read
    assert c["extra_syncs"] == pytest.approx(0.5)


def test_count_work_adainfer_prices_its_per_layer_heads_once():
    steps = [{"exit_layer": 1, "layers": 2, "pred_calls": 2, "verify_calls": 0, "syncs": 3},
             {"exit_layer": 3, "layers": 4, "pred_calls": 3, "verify_calls": 0, "syncs": 4}]
    c = cm.count_work([Generation([7, 8, 9], 0.0, [], [4, 2, 4], steps)], 4, "adainfer")
    assert c["lm_heads"] == 3  # (2 + 3 per-layer heads + 1 final) / 2 tokens
    assert c["adainfer_probes"] == 2.5 and c["priced_lm_heads"] == 0.5 and c["priced_predictor_calls"] == 0
    assert c["draft_steps"] == 0 and c["draft_trees"] == 0 and c["layer_steps"] == 3
    assert c["extra_syncs"] == pytest.approx(0.5)
    t, br = cm.modelled_time_us(c, UNITS)
    assert t == pytest.approx(3 * 100 + 0.5 * 60 + 2.5 * 70 + 0.5 * 5 + 40)
    assert "predictor" not in br


def test_count_work_tree():
    steps = [  # no exit, 3 tokens emitted; then an exit at layer 2 after one verification, 2 emitted
        {"exit_layer": 3, "layers": 4, "nodes": 5, "accepted": 3, "emitted": 3, "pred_calls": 0,
         "verify_calls": 0, "delta_probes": 0, "syncs": 11},
        {"exit_layer": 2, "layers": 3, "nodes": 5, "accepted": 2, "emitted": 2, "pred_calls": 6,
         "verify_calls": 1, "delta_probes": 1, "syncs": 12},
    ]
    c = cm.count_work([Generation([0] * 6, 0.0, [], [], steps)], 4, "specee", "tree", draft_tree_syncs=7)
    assert c["tokens"] == 5 and c["steps"] == pytest.approx(2 / 5) and c["nodes"] == 5
    assert c["tree_layer_steps"] == pytest.approx(7 / 5) and c["layer_steps"] == 0
    assert c["tree_lm_heads"] == pytest.approx(2 / 5) and c["lm_heads"] == 0
    assert c["draft_trees"] == pytest.approx(2 / 5) and c["draft_steps"] == 0
    assert c["predictor_calls"] == pytest.approx(6 / 5) and c["delta_probes"] == pytest.approx(1 / 5)
    assert c["avg_layers"] == pytest.approx((4 * 3 + 3 * 2) / 5)
    assert c["extra_syncs"] == pytest.approx(23 / 5 - 6 / 5 - 2 / 5 - 2 / 5 * 7)


def test_count_work_dense_and_eagle():
    d = cm.count_work([Generation([1, 2, 3, 4, 5], 0.0, [], [])], L, "dense")
    assert (d["steps"], d["layer_steps"], d["lm_heads"], d["tokens"]) == (1, L, 1, 4)
    assert d["extra_syncs"] == 0 and d["draft_steps"] == 0
    e = cm.count_work([Generation([0] * 3, 0.0, [], [], [{"exit_layer": L - 1, "layers": L, "nodes": 13,
                                                          "emitted": 2, "pred_calls": 0, "verify_calls": 0,
                                                          "syncs": 11}])], L, "eagle", "tree")
    assert e["tree_layer_steps"] == L / 2 and e["tree_lm_heads"] == 0.5 and e["draft_trees"] == 0.5


# -- modelled speedup ------------------------------------------------------------------------

def test_dense_against_itself_is_exactly_one():
    d = dense_counts()
    out = cm.modelled_speedup(d, d, samples(UNITS, 9, spread=0.3))
    assert out["value"] == 1.0 and out["band"] == [1.0, 1.0]


def test_half_the_layers_without_overheads_is_the_layer_ratio():
    out = cm.modelled_speedup(bare_mode(L / 2), dense_counts(), samples(ZERO, 5))
    assert out["value"] == pytest.approx(2.0)  # L / avg_layers
    units = ZERO | {"lm_head": 60.0}  # one head per token on both sides: (32*100 + 60) / (16*100 + 60)
    assert cm.modelled_speedup(bare_mode(L / 2), dense_counts(), samples(units, 5))["value"] == \
        pytest.approx(3260 / 1660)


@pytest.mark.parametrize("key, unit", [(k, u) for k, u in cm.PRICED if u not in ("layer", "step_overhead")])
def test_each_overhead_moves_the_speedup_by_its_price(key, unit):
    base = bare_mode(L / 2)
    t_dense = L * 100 + 60 + 40  # dense: layers, one head, one step overhead per token
    t_mode = L / 2 * 100 + 60 + 40
    assert cm.modelled_speedup(base, dense_counts(), samples(UNITS, 3))["value"] == pytest.approx(t_dense / t_mode)
    more = base | {key: base.get(key, 0.0) + 0.75}
    value = cm.modelled_speedup(more, dense_counts(), samples(UNITS, 3))["value"]
    assert value == pytest.approx(t_dense / (t_mode + 0.75 * UNITS[unit]))
    assert value < t_dense / t_mode


def test_fewer_steps_per_token_save_step_overhead():
    fewer = bare_mode(L / 2) | {"steps": 0.5}
    value = cm.modelled_speedup(fewer, dense_counts(), samples(UNITS, 3))["value"]
    assert value == pytest.approx((L * 100 + 100) / (L / 2 * 100 + 60 + 20))


def test_band_contains_the_value_and_collapses_on_equal_rounds():
    mode = bare_mode(20) | {"priced_predictor_calls": 10, "draft_steps": 1}
    noisy = cm.modelled_speedup(mode, dense_counts(), samples(UNITS, 200, spread=0.2, seed=3))
    assert noisy["band"][0] < noisy["value"] < noisy["band"][1]
    flat = cm.modelled_speedup(mode, dense_counts(), samples(UNITS, 7))
    assert flat["band"][0] == pytest.approx(flat["value"]) == pytest.approx(flat["band"][1])


def test_a_missing_price_is_an_error_not_a_free_unit():
    with pytest.raises(KeyError, match="draft_step"):
        cm.modelled_time_us(bare_mode(16) | {"draft_steps": 1}, {"layer": 1.0, "lm_head": 1.0, "step_overhead": 0})


def test_explain_gap_ranks_the_dominant_overhead_first():
    mode = bare_mode(16) | {"priced_predictor_calls": 10.0, "draft_steps": 1.0, "priced_lm_heads": 2.0,
                            "extra_syncs": 1.0}
    gap = cm.explain_gap(mode, dense_counts(), UNITS, L)
    assert [g["cost"] for g in gap] == ["predictor", "draft_step"]  # 200 us, 180 us (heads: +60, sync: +5)
    assert gap[0]["layer_units_per_token"] == pytest.approx(2.0) and gap[1]["layer_units_per_token"] == 1.8
    assert gap[0]["layer_ratio"] == 2.0


def test_explain_gap_prices_tree_blocks_against_block_one_layers():
    tree = dense_counts() | {"layer_steps": 0.0, "tree_layer_steps": 16.0, "lm_heads": 0.0,
                             "priced_lm_heads": 0.0, "tree_lm_heads": 0.5, "draft_trees": 0.5, "steps": 0.5}
    gap = cm.explain_gap(tree, dense_counts(), UNITS, L)
    assert gap[0] == {"cost": "tree_block", "layer_units_per_token": pytest.approx(4.8),
                      "us_per_token": pytest.approx(480.0), "layer_ratio": 2.0}
    assert gap[1]["cost"] == "draft_tree" and gap[1]["us_per_token"] == 250.0


# -- analytic prices and depth projection ----------------------------------------------------

def test_analytic_llama2_7b_bytes():
    params = 2 * 4096 * 4096 + 2 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096  # q,o + k,v + MLP + norms
    assert cm.layer_params(cm.SHAPES["llama2_7b"]) == params == 202_383_360
    out = cm.analytic_unit_costs(cm.SHAPES["llama2_7b"], bandwidth_gb_s=1000, sync_us=0, kernel_us=0, context=0)
    assert out["bytes"]["layer"] == params * 2 and out["bytes"]["lm_head"] == 32000 * 4096 * 2
    assert out["median_us"]["layer"] == pytest.approx(params * 2 / 1e9 * 1e6 / 1000)
    with_kv = cm.analytic_unit_costs(cm.SHAPES["llama2_7b"], 1000, 0, 0, context=1000)
    assert with_kv["bytes"]["layer"] - out["bytes"]["layer"] == 2 * 4096 * 1000 * 2  # K and V, 32 x 128 each
    assert cm.layer_params(cm.SHAPES["llama2_13b"]) == 4 * 5120 ** 2 + 3 * 5120 * 13824 + 2 * 5120


def test_analytic_kernel_floor_and_sync():
    out = cm.analytic_unit_costs(cm.SHAPES["llama2_7b"], bandwidth_gb_s=1e9, sync_us=10, kernel_us=5, context=0)
    u = out["median_us"]  # bandwidth so high that every unit sits on its launch floor
    assert u["layer"] == pytest.approx(cm.KERNELS["layer"] * 5)
    assert u["lm_head"] == pytest.approx(cm.KERNELS["lm_head"] * 5 + 10) and u["sync"] == 10
    assert u["dense_step"] == pytest.approx(32 * u["layer"] + u["lm_head"] + u["step_overhead"])
    assert out["method"].startswith("analytic")


def test_predict_speedup_rescales_per_layer_counts_only(tmp_path):
    mode = bare_mode(16) | {"priced_predictor_calls": 8.0, "predictor_calls": 8.0, "draft_steps": 1.0,
                            "priced_lm_heads": 1.5, "lm_heads": 1.5, "extra_syncs": 0.5}
    units = {"layer": 100.0, "lm_head": 60.0, "predictor": 20.0, "draft_step": 180.0, "sync": 5.0,
             "step_overhead": 40.0}
    # llama2_13b: 40 layers -> 20 layer steps, 10 predictor calls; heads, draft, syncs as counted
    want = (40 * 100 + 60 + 40) / (20 * 100 + 10 * 20 + 1.5 * 60 + 180 + 0.5 * 5 + 40)
    assert cm.predict_speedup(mode, dense_counts(), L, "llama2_13b", units) == pytest.approx(want)
    path = tmp_path / "gpu_units.json"
    path.write_text(json.dumps(units))
    assert cm.predict_speedup(mode, dense_counts(), L, cm.SHAPES["llama2_13b"], str(path)) == pytest.approx(want)
    d = dense_counts()
    analytic = cm.analytic_unit_costs(cm.SHAPES["llama2_7b"], 4800, 10, 4, context=512)
    assert cm.predict_speedup(d, d, L, "llama2_7b", analytic) == 1.0


def test_predict_speedup_rescales_adainfer_per_layer_heads():
    steps = [{"exit_layer": 15, "layers": 16, "pred_calls": 16, "verify_calls": 0, "syncs": 17}]
    c = cm.count_work([Generation([1, 2], 0.0, [], [], steps)], L, "adainfer")
    deeper = cm.rescale_depth(c, 2.0)
    assert deeper["adainfer_probes"] == 32 and deeper["lm_heads"] == 32 and deeper["priced_lm_heads"] == 0


# -- measured on the real model ---------------------------------------------------------------

def test_measure_unit_costs_on_tiny_with_specee(tiny):
    from conftest import early_exit_parts
    from specee.decoding.dense import DenseDecoder
    from specee.decoding.specee_ar import SpecEEDecoder
    from specee.runtime.layerwise import LayerwiseLM
    rt, draft, bank = early_exit_parts(32, rt=LayerwiseLM(tiny[0]))
    decoder = SpecEEDecoder(rt, draft, bank)
    prompt = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    out = cm.measure_unit_costs(rt, decoder, DenseDecoder(rt), prompt, 16, rounds=2, calls=1, warmup_rounds=0)
    assert out["context"] == 8 + 8
    want = {"layer", "lm_head", "predictor", "probe", "draft_step", "sync", "dense_step"}
    assert want <= set(out["median_us"]) and "tree_layer" not in out["median_us"]
    for u in want:
        assert len(out["samples_us"][u]) == 2
        assert math.isfinite(out["median_us"][u]) and out["median_us"][u] > 0, u
    assert math.isfinite(out["step_overhead_us"])  # its sign is noise-dependent
    mode = bare_mode(20) | {"priced_predictor_calls": 10.0, "draft_steps": 1.0}
    assert cm.modelled_speedup(mode, dense_counts(), out)["value"] > 0


def test_explain_gap_lists_costs_not_savings():
    gap = cm.explain_gap(bare_mode(16) | {"extra_syncs": 1.0}, dense_counts(), UNITS, L)
    assert [g["cost"] for g in gap] == ["sync"]


def test_a_speed_result_is_a_unit_table_for_prediction(tmp_path):
    """A GPU speed job's results.json prices counts like a hand-written table."""
    import json

    from specee.cost_model.priced_work import predict_speedup
    units = {"layer": 10.0, "lm_head": 5.0, "predictor": 1.0, "probe": 0.5, "draft_step": 12.0, "sync": 0.0,
             "step_overhead": 2.0}
    dense = {"steps": 1.0, "layer_steps": 32.0, "priced_lm_heads": 1.0}
    mode = {"steps": 1.0, "layer_steps": 16.0, "priced_lm_heads": 1.0, "draft_steps": 1.0}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"metrics": {"cost_model": {"units_us": units}}}))
    want = (32 * 10 + 5 + 2) / (16 * 10 + 5 + 12 + 2)
    assert predict_speedup(mode, dense, 32, "llama2_7b", units) == pytest.approx(want)
    assert predict_speedup(mode, dense, 32, "llama2_7b", path) == pytest.approx(want)


def _paper_like_counts():
    """Per-token counts of T1+T2 at the paper's exit depth on a 32-layer model (24.7 layers, ten
    predictor calls, one delta probe, 1.4 LM heads, a draft step, 12.6 host reads) and of dense."""
    dense = cm._priced({"steps": 1.0, "layer_steps": 32.0, "tree_layer_steps": 0.0, "lm_heads": 1.0,
                        "tree_lm_heads": 0.0, "predictor_calls": 0.0, "delta_probes": 0.0, "adainfer_probes": 0.0,
                        "draft_steps": 0.0, "draft_trees": 0.0, "syncs": 1.0, "extra_syncs": 0.0})
    mode = cm._priced({"steps": 1.0, "layer_steps": 24.7, "tree_layer_steps": 0.0, "lm_heads": 1.4,
                       "tree_lm_heads": 0.0, "predictor_calls": 10.0, "delta_probes": 1.0, "adainfer_probes": 0.0,
                       "draft_steps": 1.0, "draft_trees": 0.0, "syncs": 12.6, "extra_syncs": 0.0})
    return mode, dense


def test_gpu_paths_price_host_round_trips_and_graph_launches_where_each_path_pays_them():
    from specee.cost_model.speed_job import GPU_ANALYTIC
    mode, dense = _paper_like_counts()
    out = cm.predict_paths(mode, dense, 32, "llama2_7b", GPU_ANALYTIC, context=512)
    p = out["paths"]
    assert set(p) == set(cm.PATHS)
    # Every path streams the same bytes; only the host side differs.
    assert p["eager"]["us_per_token"]["layers"] == p["graphed_device_exits"]["us_per_token"]["layers"]
    host = {k: v["us_per_token"]["host"] for k, v in p.items()}
    assert host["graphed_device_exits"] < host["graphed_host_exits"] < host["eager"]
    # The host-exit path pays a drained queue per read: 12.6 reads cost more than one.
    one_read = cm.predict_paths({**mode, "syncs": 1.0}, dense, 32, "llama2_7b", GPU_ANALYTIC, context=512)
    assert one_read["paths"]["graphed_host_exits"]["us_per_token"]["host"] < host["graphed_host_exits"]
    # Below the layer ratio 32 / 24.7 = 1.30: the draft step and the verification heads cost their bytes.
    for v in p.values():
        assert 1.0 < v["speedup_vs_strongest_dense"] <= v["speedup_vs_dense_same_path"] < 32 / 24.7
    assert out["strongest_dense"] == "graphed"
    no_device = cm.predict_paths(mode, dense, 32, "llama2_7b", GPU_ANALYTIC, 512, device_exits=False)
    assert "graphed_device_exits" not in no_device["paths"]


def test_a_negative_step_overhead_is_read_as_zero_so_a_fast_mode_keeps_a_positive_time():
    """Noise on a loaded machine can make step_overhead (dense_step minus the separately timed layers
    and head) negative; priced as it is, a mode running two layers a token would take no time."""
    table = UNITS | {"step_overhead": -500.0}
    fast = bare_mode(2)
    t, parts = cm.modelled_time_us(fast, table)
    assert t == pytest.approx(2 * UNITS["layer"] + UNITS["lm_head"]) and parts["step_overhead"] == 0
    assert cm.modelled_speedup(fast, dense_counts(), samples(table, 3))["value"] > 0
