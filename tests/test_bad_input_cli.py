"""The bad-input contract end to end, for one case of each class the generated matrices check in
process (tests/test_bad_input_config.py, tests/test_bad_input_artifacts.py): through run.py, one
`specee: error:` line naming the key or file, exit status 2, no traceback, and nothing written --
the command line and input files are checked before Hydra makes a run folder."""
import shutil

import pytest

from conftest import ROOT, run_cli

ART = ROOT / "specee" / "artifacts"


@pytest.fixture(scope="module")
def corrupt_predictors(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pred")
    shutil.copytree(ART / "tiny_predictors", folder, dirs_exist_ok=True)
    (folder / "predictors_card.json").write_text('{"num_layers": 32, "k": 4,')  # cut short
    return folder


# (arguments, what the error line must name); the four classes first.
CASES = [
    (["ablation=eagle", "ablation.tree=[[0],[1],[2],[9]]"], "early_exit.k"),
    (["model=model_schema"], "valid: llama2_13b"),
    (["ablation=specee_t1", "+early_exit.thresold=0.9"], "early_exit.thresold"),
    (["ablation=specee_t1", "early_exit.predictors_path={pred}"], "predictors_card.json is corrupt (truncated)"),
    (["dataset.count=many"], "dataset.count"),
    (["model=llama9"], "model=llama9 is not an option"),
]


@pytest.mark.parametrize("args,named", CASES, ids=[" ".join(a)[:50] for a, _ in CASES])
def test_one_error_line_exit_2_nothing_written(corrupt_predictors, tmp_path, args, named):
    run = tmp_path / "run"
    args = [a.replace("{pred}", str(corrupt_predictors)) for a in args]
    res = run_cli(*args, f"hydra.run.dir={run}", "threads=1", timeout=300)
    assert res.returncode == 2, (res.returncode, res.stderr[-1500:])
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("specee: error: "), res.stderr[-1500:]
    assert named in lines[0], lines[0]
    assert "Traceback" not in res.stderr + res.stdout
    assert not run.exists()  # no run folder, no results.json, no .hydra/


def test_a_sweep_with_one_bad_value_runs_no_job(tmp_path):
    res = run_cli("-m", "ablation=dense,eagel", "threads=1", f"hydra.sweep.dir={tmp_path / 'sweep'}", timeout=300)
    assert res.returncode == 2, res.stderr[-1500:]
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "ablation=eagel is not an option" in lines[0], res.stderr[-1500:]
    assert not (tmp_path / "sweep").exists()
