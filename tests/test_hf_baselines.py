"""The dense baselines a GPU user would pick, timed in the speed job: transformers' generate eager,
generate over a static cache with its decode forward compiled, and the harness's own dense loop;
every SpecEE figure is also stated against the fastest of them."""
import json

import pytest
import torch

from conftest import random_lm, run_cli
from specee.bench.speed import HFStaticCompiled, hf_generate, strongest_dense

QUICK = ["experiment=speed", "model=tiny", "dataset.categories=[writing]", "dataset.count=1",
         "dataset.max_new_tokens=4", "experiment.cost_rounds=0", "experiment.hf_static_compiled=true"]


def test_static_compiled_generate_matches_eager_and_compiles_only_in_warm_up():
    model = random_lm("llama", layers=2)
    ids = torch.randint(1, 101, (1, 6), generator=torch.Generator().manual_seed(0))
    side = HFStaticCompiled(model, 6 + 5, backend="eager")  # dynamo traces; no code generation
    side.warm(ids, 5, None)
    assert side.warmup["graphs_compiled"] >= 1  # the decode forward really went through torch.compile
    tokens, secs = side.generate(ids, 5, None)
    assert tokens == hf_generate(model, ids, 5, None)[0] and secs > 0
    assert side.timed["graphs_compiled"] == 0  # one cache, reset between requests: no recompilation
    cache = side.cache
    side.generate(ids[:, :4], 5, None)  # a shorter request reuses the same cache
    assert side.cache is cache and side.timed["graphs_compiled"] == 0
    assert not side.fits(torch.zeros(1, 7, dtype=torch.long), 5)
    side.grow(12)
    assert side.fits(torch.zeros(1, 7, dtype=torch.long), 5) and side.cache is not cache
    d = side.describe()
    assert d["cache_implementation"] == "static" and d["max_cache_len"] == 12 and d["compile_mode"] == "default"


def test_strongest_dense_baseline_is_the_fastest_timed_one():
    got = strongest_dense({"hf_generate_eager": 10.0, "hf_static_compiled": None, "dense_eager": 12.5,
                           "dense_graphed": 11.0})
    assert got == {"name": "dense_eager", "tokens_per_s": 12.5,
                   "candidates": {"hf_generate_eager": 10.0, "dense_eager": 12.5, "dense_graphed": 11.0}}
    assert strongest_dense({"hf_generate_eager": None}) is None


def _check_job(tmp_path, backend: str) -> dict:
    from specee.bench.metrics_catalog import unknown_keys
    res = run_cli(*QUICK, f"experiment.hf_static_compiled_backend={backend}", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "strongest dense baseline timed here:" in res.stdout
    m = json.loads((tmp_path / "results.json").read_text())["metrics"]
    assert not unknown_keys(m)
    hs = m["hf_static_compiled"]
    assert hs["backend"] == backend and hs["identical_share"] == 1.0 and hs["graphs_compiled_in_warmup"] >= 1
    assert hs["graphs_compiled_in_timed_runs"] == 0 and m["runtime"]["graphs_compiled_in_timed_runs"] == 0
    assert m["hf_static_compiled_tokens_per_s"] == hs["tokens_per_s"] > 0
    sb = m["strongest_dense_baseline"]
    assert set(sb["candidates"]) == {"hf_generate_eager", "hf_static_compiled", "dense_eager"}
    assert sb["tokens_per_s"] == max(sb["candidates"].values()) == sb["candidates"][sb["name"]]
    assert m["speedup_vs_strongest_dense"] == pytest.approx(m["tokens_per_s"] / sb["tokens_per_s"])
    assert m["speedup_vs_hf_static_compiled"] == pytest.approx(m["tokens_per_s"] / hs["tokens_per_s"])
    assert m["dense"]["speedup_vs_hf_static_compiled"] == pytest.approx(m["dense"]["tokens_per_s"] / hs["tokens_per_s"])
    return m


def test_speed_job_times_the_static_compiled_baseline_beside_the_others(tmp_path):
    """The wiring, with torch.compile's eager backend (tracing, no code generation: fast on a CPU)."""
    _check_job(tmp_path, "eager")


@pytest.mark.slow  # inductor compiles tiny's 32-layer decode forward: ~1 min on a 2-core CPU
def test_speed_job_with_transformers_compiled_fast_path(tmp_path):
    _check_job(tmp_path, "inductor")


def test_the_static_compiled_baseline_is_off_by_default():
    from specee.config.schemas import SpeedExperiment
    assert SpeedExperiment().hf_static_compiled is False and SpeedExperiment().hf_static_compiled_backend == "inductor"
