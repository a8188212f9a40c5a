"""Issue 44's table, end to end through run.py on tiny: each fault a user causes or suffers ends in
one `specee: error:` line naming the fix, exit status 2, no traceback and no results.json -- or, for
UTF-8 with a byte-order mark, runs. The classes are generated in tests/test_bad_input_faults.py."""
import json
import shutil

import pytest

from conftest import ROOT, run_cli

ART = ROOT / "specee" / "artifacts"
SMALL = ["dataset.count=1", "dataset.max_new_tokens=4", "experiment.repeats=1", "experiment.warmup=0", "threads=1"]


def _refused(res, *named):
    assert res.returncode == 2, (res.returncode, res.stderr[-1500:])
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-1500:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("specee: error:")]
    assert len(lines) == 1, res.stderr[-1500:]
    for n in named:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def test_run_folder_under_a_regular_file(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    run = tmp_path / "notes.txt" / "run"
    _refused(run_cli(*SMALL, f"hydra.run.dir={run}", timeout=300), str(run), "choose another hydra.run.dir")


def test_sweep_folder_under_a_regular_file(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    res = run_cli("-m", "ablation=dense", *SMALL, f"hydra.sweep.dir={tmp_path / 'notes.txt' / 's'}", timeout=300)
    _refused(res, "hydra.sweep.dir", "choose another")


def test_a_disk_without_room_is_refused_before_any_work(tmp_path):
    import os
    import subprocess
    import sys
    run = tmp_path / "run"
    res = subprocess.run([sys.executable, str(ROOT / "run.py"), *SMALL, f"hydra.run.dir={run}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "SPECEE_MIN_FREE_MB": str(10 ** 12)})
    _refused(res, str(run), "MB free", "free space")
    assert not run.exists()


def test_nan_predictor_bank_is_refused_before_any_decoding(tmp_path):
    from safetensors.torch import load_file, save_file
    bank = tmp_path / "bank"
    shutil.copytree(ART / "tiny_predictors", bank)
    state = load_file(str(bank / "predictors.safetensors"))
    state["w2"].fill_(float("nan"))
    save_file(state, str(bank / "predictors.safetensors"))
    run = tmp_path / "run"
    res = run_cli(*SMALL, "ablation=specee_t1", f"early_exit.predictors_path={bank}", f"hydra.run.dir={run}",
                  timeout=300)
    _refused(res, "predictors.safetensors", "non-finite", "retrain the predictors")
    assert not (run / "results.json").exists()


def test_a_draft_checkpoint_with_a_pickle_payload(tmp_path):
    import os

    import torch

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))
    draft = tmp_path / "eagle"
    draft.mkdir()
    torch.save({"fc.weight": torch.zeros(2, 2), "x": Payload()}, draft / "pytorch_model.bin")
    run = tmp_path / "run"
    res = run_cli(*SMALL, "ablation=eagle", f"draft.path={draft}", f"hydra.run.dir={run}", timeout=300)
    _refused(res, "pytorch_model.bin", "refused to unpickle it safely", "never loaded unsafely")
    assert not (tmp_path / "ran").exists() and not (run / "results.json").exists()


def test_a_model_config_with_zero_layers(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(ART / "tiny", model)
    conf = json.loads((model / "config.json").read_text())
    conf["num_hidden_layers"] = 0
    (model / "config.json").write_text(json.dumps(conf))
    _refused(run_cli(*SMALL, f"model.path={model}", f"hydra.run.dir={tmp_path / 'run'}", timeout=300),
             "config.json", "num_hidden_layers=0")


def test_a_task_yaml_with_anchors_and_unknown_fields(tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tmp_path / "own.jsonl"
    data.write_text(json.dumps({"q": "1+1=", "a": "2"}) + "\n")
    (tasks / "own.yaml").write_text(
        "common: &c\n  output_type: generate_until\ntask: own\n<<: *c\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files: {{test: {data}}}\ntest_split: test\n"
        "doc_to_text: \"{{q}}\"\ndoc_to_target: \"{{a}}\"\nmax_tokens: 2\n")
    res = run_cli("experiment=accuracy", "experiment.tasks=[own]", f"experiment.include_path={tasks}",
                  "experiment.limit=1", "threads=1", f"hydra.run.dir={tmp_path / 'run'}", timeout=300)
    _refused(res, "own.yaml", "'common'", "'max_tokens'")


def test_a_prompt_file_with_a_byte_order_mark_runs(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "Once upon a time"}).encode() + b"\n")
    run = tmp_path / "run"
    res = run_cli("dataset=jsonl", f"dataset.path={prompts}", "dataset.field=prompt", *SMALL[1:],
                  f"hydra.run.dir={run}", timeout=600)
    assert res.returncode == 0, res.stderr[-1500:]
    doc = json.loads((run / "results.json").read_text())
    assert doc["metrics"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Two finished jobs of a real sweep (tiny, dense and eagle)."""
    root = tmp_path_factory.mktemp("sweep")
    res = run_cli("-m", "ablation=dense,eagle", *SMALL, f"hydra.sweep.dir={root}", timeout=900)
    assert res.returncode == 0, res.stderr[-1500:]
    assert len(list(root.rglob("results.json"))) == 2
    return root


def test_a_report_over_a_sweep_with_one_empty_results_renders_the_rest(sweep, tmp_path):
    root = tmp_path / "sweep"
    shutil.copytree(sweep, root)
    broken = sorted(root.rglob("results.json"))[0]
    broken.write_text("")
    (root / "job_x").mkdir()
    (root / "job_x" / "results.json").write_bytes(b"\x00\xff garbage")
    out = tmp_path / "report"
    res = run_cli("experiment=report", f"sweep={root}", f"experiment.out_dir={out}",
                  f"hydra.run.dir={tmp_path / 'r'}", timeout=600)
    assert res.returncode == 0, res.stderr[-1500:]
    assert (out / "report.pdf").is_file()
    skipped = [ln for ln in res.stdout.splitlines() if ln.strip().startswith("skipped ") and "results.json" in ln]
    assert any(str(broken) in ln and "empty" in ln for ln in skipped), res.stdout[-1500:]
    assert any("job_x" in ln and "corrupt" in ln for ln in skipped), res.stdout[-1500:]
    assert "2 broken results.json skipped" in (out / "summary.md").read_text()


def test_a_sweep_rerun_over_a_corrupt_result_refuses_that_job_and_runs_the_rest(sweep, tmp_path):
    """The chosen behaviour: a corrupt results.json is never rerun over (it may be the only copy of
    a result, and the harness never half-writes one); that job is refused in one line, the others
    are reused, and the sweep ends non-zero naming the refused job."""
    root = tmp_path / "sweep"
    shutil.copytree(sweep, root)
    broken = sorted(root.rglob("results.json"))[0]
    broken.write_bytes(b'{"specee_results": 1, "metr')
    before = broken.read_bytes()
    res = run_cli("-m", "ablation=dense,eagle", *SMALL, f"hydra.sweep.dir={root}", timeout=900)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-1500:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("specee: error:")]
    assert len(errors) == 1 and str(broken) in errors[0] and "force=true" in errors[0], res.stderr[-1500:]
    assert broken.read_bytes() == before  # left as it was, for its owner to look at
    assert "results exist, skipping" in res.stdout  # the whole job is reused
