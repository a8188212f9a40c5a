"""The bad-input matrix: one row per malformed input, each must end in one clear error (exit 2,
the message naming the fix), never a traceback, never a result file. These are hand-picked, end to
end; the generated matrices (every schema field, key level, option and artifact file) are in
test_bad_input_config.py, test_bad_input_artifacts.py and test_bad_input_cli.py."""
import json
import shutil

import pytest

from conftest import ROOT, run_cli
from specee.config import safe_dirname

FAST_TIER_SAMPLE = 3  # the fast tier runs one in 3 of this matrix's cases (tests/conftest.py)

ART = ROOT / "specee" / "artifacts"


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """Broken artifacts and data files, each a copy of a good one with one thing wrong."""
    root = tmp_path_factory.mktemp("bad")
    ckpt = root / "ckpt"  # a checkpoint folder whose weights are garbage
    ckpt.mkdir()
    for f in (ART / "tiny").iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, ckpt / f.name)
    (ckpt / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    draft = root / "draft"
    shutil.copytree(ART / "tiny_draft", draft)
    (draft / "draft_card.json").write_text("{ not json")
    ada = root / "ada"
    shutil.copytree(ART / "tiny_adainfer", ada)
    card = json.loads((ada / "adainfer_svm.json").read_text())
    card["base_weights_fingerprint"] = "0" * 64
    (ada / "adainfer_svm.json").write_text(json.dumps(card))
    data = root / "data"
    shutil.copytree(ROOT / "data", data)
    with open(data / "spec_bench" / "question.jsonl", "a") as f:
        f.write('{"question_id": 999, "category": "writing", "turns": ["x"]\n')
    with open(data / "copa" / "copa_validation.jsonl", "a") as f:
        f.write("not json at all\n")
    sweep = root / "sweep" / "job"
    sweep.mkdir(parents=True)
    (sweep / "results.json").write_text(json.dumps({"metrics": [1, 2, 3]}))
    done = root / "done"
    done.mkdir()
    (done / "results.json").write_text("{}")
    return root


# (arguments, expected message); "{bad}" is the fixture folder.
CASES = [
    (["dataset.max_new_tokens=0"], "dataset.max_new_tokens=0 must be >= 1"),
    (["dataset.max_new_tokens=-5", "experiment.compare_hf_generate=false"], "dataset.max_new_tokens=-5 must be >= 1"),
    (["ablation=specee_t1_t2", "placement.n_history=0"], "placement.n_history=0 must be >= 1"),
    (["ablation=specee_t1_t2", "placement.window=-2"], "placement.window=-2 must be >= 0"),
    (["ablation=specee_t1", "placement=offline_topm", "placement.m=-3"], "placement.m=-3 must be >= 1"),
    (["ablation=specee_t1", "placement=offline_topm", "placement.coverage=1.5"], "placement.coverage=1.5"),
    (["experiment.repeats=0"], "experiment.repeats=0 must be >= 1"),
    (["experiment.warmup=-1"], "experiment.warmup=-1 must be >= 0"),
    (["ablation=eagle", "ablation.tree=[[x]]"], "ablation.tree"),
    (["ablation=eagle", "ablation.tree=5"], "ablation.tree"),
    (["ablation=eagle", "ablation.tree=[[0,1]]"], "lack their parent path"),
    (["ablation=specee_t1", "early_exit.threshold=1.5"], "early_exit.threshold=1.5 must lie in [0, 1]"),
    (["ablation=specee_t1", "early_exit.k=0"], "early_exit.k=0 must be >= 1"),  # the generic range check (one rule)
    (["threads=0"], "threads=0 must be >= 1"),
    (["model=llama2_7b", "model.init=random", "model.device=cpu", "model.num_layers=0"], "model.num_layers=0"),
    (["model.init=zeros"], "model.init='zeros' is unknown"),
    (["experiment=accuracy", "experiment.limit=0"], "experiment.limit=0 must be >= 1"),
    (["experiment=accuracy", "experiment.drift_gate=fuzzy"], "experiment.drift_gate='fuzzy' is unknown"),
    (["dataset.source=csv"], "dataset.source='csv' is unknown"),
    (["model.path={bad}/ckpt"], "could not load the checkpoint"),
    (["ablation=specee_t1", "draft.path={bad}/draft"], "draft_card.json is corrupt"),
    (["ablation=adainfer", "early_exit.adainfer_path={bad}/ada"], "trained for another base model"),
    (["paths.data_root={bad}/data"], "question.jsonl:481: not valid JSON"),
    (["experiment=accuracy", "experiment.tasks=[copa]", "paths.data_root={bad}/data"], "copa_validation.jsonl:101: not valid JSON"),
    (["experiment=report", "sweep={bad}/sweep"], "is not a specee results file"),
    (["experiment=collect", "sweep={bad}/sweep"], "is not a specee results file"),
    (["experiment=train_predictors", "hydra.run.dir={bad}/done"], "already holds a finished run"),
    (["ablation=dense", "early_exit.replay=specee/artifacts/tiny_exit_profile"], "replays SpecEE exit decisions"),
]


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_clear_error(bad, tmp_path, args, message):
    args = [a.replace("{bad}", str(bad)) for a in args]
    if not any(a.startswith("hydra.run.dir=") for a in args):
        args.append(f"hydra.run.dir={tmp_path / 'run'}")
    extra = [] if any(a.startswith("threads=") for a in args) else ["threads=1"]
    res = run_cli(*args, *extra, timeout=300)
    assert res.returncode == 2, (res.returncode, res.stderr[-1500:])
    assert message in res.stderr, res.stderr[-1500:]
    assert "Traceback" not in res.stderr + res.stdout
    assert not (tmp_path / "run" / "results.json").exists()


def test_a_report_that_fails_leaves_no_half_written_file(bad, tmp_path):
    out = tmp_path / "report"
    res = run_cli("experiment=report", f"sweep={bad}/sweep", f"experiment.out_dir={out}", f"hydra.run.dir={tmp_path}/r")
    assert res.returncode == 2 and not (out / "report.pdf").exists()
    assert not list(out.glob(".*.tmp")) if out.exists() else True


def test_sweep_folder_names_cannot_escape_the_sweep():
    for value in ("dataset.path=../../../etc", "x=/abs/path", "..", ".hidden"):
        name = safe_dirname(value)
        assert "/" not in name and not name.startswith(".")


def test_sweep_folder_names_stay_short_unique_and_stable():
    long_a = ",".join(f"x{i}.path=/a/very/long/folder/name/number/{i}" for i in range(12))
    long_b = long_a.replace("number/11", "number/12")
    a, b = safe_dirname(long_a), safe_dirname(long_b)
    assert len(a.encode()) <= 200 and len(b.encode()) <= 200
    assert a != b and a == safe_dirname(long_a)
    assert safe_dirname("ablation=dense") == "ablation=dense"
