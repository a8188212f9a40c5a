"""Exit replay and random-weight shapes: a real mode's work on a real shape, with its exits given."""
import json

import pytest
import torch

from conftest import early_exit_parts, run_cli
from specee.decoding.specee_ar import SpecEEDecoder
from specee.decoding.tree import TreeDecoder
from specee.early_exit.replayed_exits import ExitReplay, prompt_sha
from specee.early_exit.schedule import TwoLevelSchedule
from specee.errors import SpeceeError

K, L = 4, 8


@pytest.fixture(scope="module")
def parts():
    return early_exit_parts(L, K)


def prompts(n=3):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, 101, (1, 7 + 2 * i), generator=g) for i in range(n)]


def profile(tmp_path, counts):
    (tmp_path / "exit_profile.json").write_text(json.dumps({"exit_counts": counts}))
    return str(tmp_path)


def test_replayed_profile_sets_avg_layers_on_all_layers(parts, tmp_path):
    rt, draft, bank = parts
    counts = [0, 5, 1, 0, 9, 2, 0, 3]  # layer 7 (the last) = no exit
    replay = ExitReplay(profile(tmp_path, counts), L, seed=0)
    d = SpecEEDecoder(rt, draft, bank, k=K, replay=replay)
    trace = [t for ids in prompts() for t in d.generate(ids, 40).trace]
    targets = [t["replay_target"] + 1 for t in trace]
    layers = [t["layers"] for t in trace]
    assert layers == targets  # all layers scheduled: the exit is the target
    assert abs(sum(layers) / len(layers) - replay.target_avg_layers) < 0.5
    assert all(t["pred_calls"] == min(t["replay_target"] + 1, L - 1) for t in trace)  # every predictor ran
    assert all(t["verify_calls"] == (t["replay_target"] < L - 1) for t in trace)  # and the verification


def test_scheduled_replay_exits_at_the_next_scheduled_layer(parts, tmp_path):
    rt, draft, bank = parts
    replay = ExitReplay(profile(tmp_path, [1] * L), L, seed=1)
    sched = TwoLevelSchedule(L, [5], False, 5, 1)  # offline only: layer 5
    trace = SpecEEDecoder(rt, draft, bank, k=K, schedule=sched, replay=replay).generate(prompts(1)[0], 40).trace
    for t in trace:
        assert t["exit_layer"] == (5 if t["replay_target"] <= 5 else L - 1)


@pytest.mark.parametrize("tree", [False, True])
def test_replaying_a_recorded_trace_reproduces_the_tokens(parts, tmp_path, tree):
    rt, draft, bank = parts
    sched = lambda: TwoLevelSchedule(L, [2, 3], True, 2, 1)  # noqa: E731
    make = (lambda r: TreeDecoder(rt, draft, "small", bank=bank, schedule=sched(), mapping="merged", k=K, replay=r)) if tree else \
        (lambda r: SpecEEDecoder(rt, draft, bank, k=K, schedule=sched(), replay=r))
    real = {prompt_sha(ids): make(None).generate(ids, 30) for ids in prompts()}
    if not tree:
        assert any(l < L for g in real.values() for l in g.layers_run[1:]), "no exits to replay"
    # A tree step's exit layer is shared by its tokens: its targets are per step, not per token.
    per = (lambda g: [L] + [t["layers"] for t in g.trace]) if tree else (lambda g: g.layers_run)  # noqa: E731
    rows = [{"prompt_sha": k, "exit_layers": per(g)} for k, g in real.items()]
    (tmp_path / "results.json").write_text(json.dumps({"prompts": rows}))
    replay = ExitReplay(str(tmp_path / "results.json"), L)
    for ids in prompts():
        again = make(replay).generate(ids, 30)
        assert again.tokens == real[prompt_sha(ids)].tokens
        assert again.layers_run == real[prompt_sha(ids)].layers_run


def test_replay_refuses_what_does_not_fit(tmp_path):
    with pytest.raises(SpeceeError, match="this model has 8 layers"):
        ExitReplay(profile(tmp_path, [1, 2, 3]), L)
    (tmp_path / "results.json").write_text(json.dumps({"metrics": {}}))
    with pytest.raises(SpeceeError, match="neither an exit profile"):
        ExitReplay(str(tmp_path / "results.json"), L)
    res = run_cli("experiment=speed", "ablation=dense", f"early_exit.replay={tmp_path}", f"hydra.run.dir={tmp_path}/r")
    assert res.returncode == 2 and "replays SpecEE exit decisions" in res.stderr


def test_replay_on_tiny_from_its_exit_profile(tmp_path):
    res = run_cli("experiment=speed", "model=tiny", "ablation=specee_t1", "early_exit.replay=specee/artifacts/tiny_exit_profile",
                  "dataset.categories=[writing,qa]", "dataset.max_new_tokens=24", "experiment.compare_hf_generate=false",
                  "threads=1", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    m = doc["metrics"]
    assert abs(m["avg_layers"] - m["replay_target_avg_layers"]) <= 0.5
    assert "replayed from specee/artifacts/tiny_exit_profile" in doc["synthetic"]["exits"]


@pytest.mark.slow
def test_random_init_real_shape_with_cut_layers(tmp_path):
    res = run_cli("experiment=speed", "model=llama2_7b", "model.init=random", "model.device=cpu", "model.dtype=float32",
                  "model.num_layers=1", "ablation=specee_t1", "dataset.categories=[writing]", "dataset.max_new_tokens=3",
                  "experiment.compare_hf_generate=false", "experiment.warmup=0", "threads=1", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["config"]["model"]["init"] == "random" and doc["config"]["model"]["num_layers"] == 1
    assert doc["metrics"]["num_layers"] == 1 and doc["metrics"]["generated_tokens"] == 3
    assert "random" in doc["synthetic"]["weights"] and "predictors" in doc["synthetic"]


def test_a_shape_that_does_not_fit_is_refused_with_its_bytes(tmp_path):
    res = run_cli("experiment=speed", "model=llama2_70b", "model.init=random", "model.device=cpu",
                  "model.dtype=float32", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 2 and "needs 2" in res.stderr and "GiB available" in res.stderr
    assert "Traceback" not in res.stderr
