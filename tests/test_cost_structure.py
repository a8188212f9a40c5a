from specee.bench.cost_structure import measure, op_profile

TINY = "specee/artifacts/tiny"


def test_cost_benchmark_times_layer_head_and_draft():
    out = measure(TINY, "specee/artifacts/tiny_draft", context=16, repeats=5)
    assert set(out["median_us"]) == {"layer", "lm_head", "draft_step"}
    assert all(v > 0 for v in out["median_us"].values())
    assert 0.6 < out["lm_head_over_layer_params"] < 0.7  # tiny v2: Llama-2-7B's 0.65


def test_op_profile_breaks_a_layer_step_into_operators():
    out = op_profile(TINY, context=16, steps=3)
    assert out["op_calls_per_layer_step"] >= 7  # at least the layer's seven projections
    assert any(r["op"] in ("aten::mm", "aten::addmm", "aten::linear") for r in out["top_ops"])
    assert out["layer_bandwidth_floor_us"] > 0 and out["wall_us_per_layer_step"] > 0


def test_the_compiled_layer_step_dispatches_fewer_operators():
    """Fusion and compilation: one compiled call replaces the layer's ~200 operator dispatches."""
    eager = op_profile(TINY, context=16, steps=3)
    comp = op_profile(TINY, context=16, steps=3, runtime="compiled")
    assert comp["runtime"] == "compiled" and comp["wall_us_per_layer_step"] > 0
    assert comp["op_calls_per_layer_step"] < eager["op_calls_per_layer_step"] / 3, (comp, eager)
    out = measure(TINY, None, context=16, repeats=5, runtime="compiled")
    assert out["runtime"] == "compiled" and out["median_us"]["layer"] > 0
