"""The certified operating point as a setting (specee/decoding/operating_point.py): a job at
``early_exit.operating_point`` runs exactly the point the frontier certified and measured, records
where it came from, and refuses in one line what it cannot stand behind."""
import copy
import json

import pytest

from conftest import ROOT, run_cli
from specee.errors import SpeceeError

FRONTIER = ["experiment=frontier", "model=tiny", "experiment.count=1", "experiment.max_new_tokens=6",
            "experiment.delta=0.5", "experiment.fit_share=0.3", "experiment.timed_prompts=2",
            "experiment.cost_rounds=3", "experiment.measured_points=1", "experiment.real_only=[]",
            "experiment.lossless_peers=[]", "experiment.policies=[specee_t1_t2,specee_t1_t2_tuned,adainfer_crf]",
            "experiment.threshold_grid=[0.9,0.5,0.2]", "experiment.precision_grid=[0.95,0.7]",
            "experiment.p_stop_grid=[0.9,0.5]"]


@pytest.fixture(scope="module")
def frontier(tmp_path_factory):
    """A small frontier on tiny at a budget it can certify (delta 0.5 on 7 calibration prompts)."""
    root = tmp_path_factory.mktemp("operating_point")
    res = run_cli(*FRONTIER, f"experiment.report_dir={root / 'report'}", f"hydra.run.dir={root / 'run'}")
    assert res.returncode == 0, res.stderr[-3000:]
    return root


def _cfg(*over):
    from hydra import compose, initialize_config_dir
    from specee.config import register
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", ["model=tiny", "experiment=speed", *over])


def _doc(frontier):
    return json.loads((frontier / "report" / "frontier.json").read_text())


@pytest.mark.parametrize("policy", ["specee_t1_t2", "specee_t1_t2_tuned", "adainfer_crf"])
def test_the_certified_point_runs_exactly_as_the_frontier_measured_it(frontier, tiny, policy):
    """Built from the setting alone, the decoder repeats the frontier's own real runs at the certified
    point on its timed prompts: the same layers per token and the same sequences (deterministic on CPU)."""
    from specee.bench.inputs import generation_eos, load_prompts
    from specee.builders import build_decoder
    from specee.decoding.dense import DenseDecoder
    from specee.prompts import PromptEncoder
    from specee.runtime.build import build_runtime
    m = _doc(frontier)["metrics"]
    cal = m["calibration"][policy]
    assert cal["chosen"] is not None, f"{policy}: nothing certified at delta 0.5 ({cal.get('why_none')})"
    meas = next(p for p in m["measured"][policy] if p["index"] == cal["chosen"] and p["kv_policy"] == cal["kv_policy"])
    model, tok = tiny
    cfg = _cfg(f"ablation={policy}", f"early_exit.operating_point={frontier / 'report'}", "dataset.count=1",
               "dataset.max_new_tokens=6")
    rt = build_runtime(cfg.runtime, model)
    dec = build_decoder(cfg, rt)
    assert dec.operating_point["value"] == cal["value"] and dec.kv_policy == cal["kv_policy"]
    by_id = {p["id"]: p for p in load_prompts(cfg)}
    enc, eos, dense = PromptEncoder.for_runtime(tok, rt, 6), generation_eos(cfg, tok), DenseDecoder(rt)
    layers, same = [], []
    for pid in m["units"]["timed"]:
        ids = enc(by_id[pid]["text"], pid)
        g = dec.generate(ids, 6, eos)
        layers += g.layers_run[1:]
        same.append(g.tokens == dense.generate(ids, 6, eos).tokens)
    assert sum(layers) / len(layers) == pytest.approx(meas["avg_layers"], abs=1e-9)
    assert sum(same) / len(same) == pytest.approx(meas["sequence_identity"], abs=1e-9)
    if policy == "specee_t1_t2":
        assert meas["avg_layers"] < 32  # the point exits: the pin is not dense against dense
    if policy == "specee_t1_t2_tuned":  # the per-layer thresholds fitted on the fit split, not the bank's own
        fitted = m["curves"][policy][cal["chosen"]]["thresholds"]
        import math
        want = [1 / (1 + math.exp(-t)) if math.isfinite(t) else (1.0 if t > 0 else 0.0) for t in fitted]
        assert [float(x) for x in dec.predictors.layer_thresholds] == pytest.approx(want)


def test_a_speed_job_at_the_point_records_its_source_and_states_its_loss(frontier):
    out = frontier / "speed"
    res = run_cli("experiment=speed", "model=tiny", "ablation=specee_t1_t2", "dataset.count=1",
                  "dataset.categories=[writing,math]", "dataset.max_new_tokens=6", "experiment.cost_rounds=0",
                  "experiment.compare_hf_generate=false", f"early_exit.operating_point={frontier / 'report'}",
                  f"hydra.run.dir={out}")
    assert res.returncode == 0, res.stderr[-3000:]
    loss = json.loads((out / "results.json").read_text())["metrics"]["loss"]
    cal = _doc(frontier)["metrics"]["calibration"]["specee_t1_t2"]
    assert loss["certified"]["value"] == cal["value"] and loss["certified"]["delta"] == 0.5
    assert loss["statement"].startswith("certified at δ = 0.5") and str(frontier / "report") in loss["statement"]
    assert len(loss["per_prompt"]) == 2 and 0 <= loss["own_context_disagreement"] <= 1


def _write(tmp_path, doc, name="frontier.json"):
    d = tmp_path / "f"
    d.mkdir(exist_ok=True)
    (d / name).write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return d


@pytest.mark.parametrize("case, says", [
    ("missing", "no frontier result there"),
    ("not_json", "is not JSON"),
    ("not_frontier", "is not a frontier result"),
    ("other_policy", "not ablation=specee_t1"),
    ("other_budget", "certified on real decoding at δ = 0.5 only"),
    ("nothing_certified", "nothing was certified for specee_t1_t2"),
    ("replay_only", "teacher-forced replay"),
    ("no_identity", "re-run experiment=frontier"),
    ("other_model", "model: 'tiny_other' there, 'tiny' here"),
    ("other_bank", "bank.digest"),
    ("other_placement", "placement"),
])
def test_the_setting_refuses_in_one_line(frontier, tmp_path, case, says):
    from specee.decoding.operating_point import read
    doc = copy.deepcopy(_doc(frontier))
    m = doc["metrics"]
    over, src = ["ablation=specee_t1_t2"], None
    if case == "missing":
        src = tmp_path / "nowhere"
    elif case == "not_json":
        src = _write(tmp_path, "{not json")
    elif case == "not_frontier":
        src = _write(tmp_path, {"metrics": {"speedup_vs_dense": 1.0}}, "results.json")
    elif case == "other_policy":
        over = ["ablation=specee_t1"]
    elif case == "other_budget":
        over.append("early_exit.operating_budget=0.01")
    elif case == "nothing_certified":
        m["calibration"]["specee_t1_t2"].update(chosen=None, why_none="no point passed")
    elif case == "replay_only":
        m["calibration"]["specee_t1_t2"]["on"] = "replay"
    elif case == "no_identity":
        del m["policies"]["specee_t1_t2"]["identity"]
    elif case == "other_model":
        m["policies"]["specee_t1_t2"]["identity"]["model"] = "tiny_other"
    elif case == "other_bank":
        m["policies"]["specee_t1_t2"]["identity"]["bank"]["digest"] = "0" * 16
    elif case == "other_placement":
        over.append("placement=all_layers")
    src = src or _write(tmp_path, doc)
    cfg = _cfg(*over, f"early_exit.operating_point={src}")
    with pytest.raises(SpeceeError) as err:
        read(cfg)
    msg = str(err.value)
    assert says in msg and "\n" not in msg and msg.startswith(f"early_exit.operating_point={src}")


def test_a_frontier_job_refuses_the_setting_before_anything_loads(frontier, tmp_path):
    res = run_cli("experiment=frontier", "model=tiny", f"early_exit.operating_point={frontier / 'report'}",
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 2 and "is for experiment=speed and experiment=accuracy" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "run" / "results.json").exists()


def test_the_main_job_runs_each_certified_ablation_at_its_point_and_no_other(frontier):
    from experiments.reproduce import plan
    from hydra import compose, initialize_config_dir
    from specee.config import register
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", ["experiment=reproduce", f"experiment.operating_point={frontier / 'report'}"])
    at = f"early_exit.operating_point={frontier / 'report'}"
    jobs = dict(plan(cfg))
    assert at in jobs["speed_specee_t1_t2"] and at in jobs["accuracy_specee_t1_t2"]
    assert at not in jobs["speed_dense"] and at not in jobs["speed_specee_full"]


@pytest.mark.parametrize("rows, says", [
    ([{"speedup_vs_dense": 1.0}], "– (no exit)"),
    ([{"oracle_gap": {}, "loss": {"own_context_disagreement": 0.0123, "certified": None}}], "uncertified: 0.0123 measured"),
    ([{"oracle_gap": {}}], "not measured (a result from before the loss was recorded: re-run)"),
    ([{"oracle_gap": {}, "loss": {"own_context_disagreement": 0.0, "certified": {
        "delta": 0.01, "knob": "threshold", "value": 0.9, "kv_policy": "holes", "held_out": {"loss": 0.002}}}}],
     "certified δ = 0.01 (threshold 0.9, K/V holes; held-out 0.0020); here 0.0000"),
])
def test_every_early_exit_row_of_the_report_states_the_loss_it_runs_at(rows, says):
    from specee.report_pages.speed import loss_cell
    assert loss_cell(rows) == says


def test_the_main_job_refuses_a_point_that_is_not_a_frontier_result(tmp_path):
    from experiments.reproduce import plan
    from hydra import compose, initialize_config_dir
    from specee.config import register
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", ["experiment=reproduce", f"experiment.operating_point={tmp_path / 'nowhere'}"])
    with pytest.raises(SpeceeError) as err:
        plan(cfg)
    assert str(err.value).startswith(f"experiment.operating_point={tmp_path / 'nowhere'}: no frontier result there")
