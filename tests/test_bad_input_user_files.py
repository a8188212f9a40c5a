"""Files a user brings, refused by class: every kind of file a user can point the harness at (a
prompt JSONL, a task YAML and its data file, a model folder) x every way it can be broken (random
bytes, another encoding, truncated, empty, a huge line, wrong types, a folder where a file is
expected). Each must end in exit 2 with one line naming the file, no traceback, no result file."""
import json
import os
import random
import shutil

import pytest

from conftest import ROOT, run_cli

FAST_TIER_SAMPLE = 4  # the fast tier runs one in 4 of this matrix's cases (tests/conftest.py)

TINY = ROOT / "specee" / "artifacts" / "tiny"
GOOD_ROW = {"prompt": "Once upon a time"}


def _breakage(kind: str, good: bytes, path):
    """Write ``path`` as the good bytes broken one way; return the path to pass to the harness."""
    rng = random.Random(kind)
    if kind == "random_bytes":
        path.write_bytes(bytes(rng.randrange(256) for _ in range(4096)))
    elif kind == "latin1":
        path.write_bytes(good.decode("utf-8").replace("time", "tim\u00e9 caf\u00e9").encode("latin-1"))
    elif kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "huge_line":
        path.write_bytes(b"{\"" + b"x" * (4 << 20) + b"\n")
    elif kind == "wrong_types":
        path.write_bytes(json.dumps(["not", "an", "object"]).encode() + b"\n")
    elif kind == "folder":
        path.mkdir()
    return path


PROMPT_KINDS = ["random_bytes", "latin1", "truncated", "empty", "huge_line", "wrong_types", "folder"]


@pytest.mark.parametrize("kind", PROMPT_KINDS)
def test_prompt_file(kind, tmp_path):
    good = (json.dumps(GOOD_ROW) + "\n").encode() * 3  # halved: the second line is cut
    f = _breakage(kind, good, tmp_path / "prompts.jsonl")
    _refused(tmp_path, ["experiment=speed", "model=tiny", "dataset=jsonl", f"dataset.path={f}", "dataset.field=prompt",
                        "dataset.max_new_tokens=2", "experiment.repeats=1", "experiment.warmup=0"], str(f))


TASK_YAML = ("task: own\noutput_type: generate_until\ndataset_path: json\n"
             "dataset_kwargs:\n  data_files: {{test: {data}}}\ntest_split: test\n"
             "doc_to_text: \"{{{{q}}}}\"\ndoc_to_target: \"{{{{a}}}}\"\n"
             "generation_kwargs: {{until: [\"\\n\"], max_gen_toks: 2}}\n"
             "metric_list:\n  - metric: exact_match\n")


@pytest.mark.parametrize("kind", ["random_bytes", "truncated", "empty", "wrong_types"])
def test_task_yaml(kind, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tmp_path / "own.jsonl"
    data.write_text(json.dumps({"q": "1+1=", "a": "2"}) + "\n")
    good = TASK_YAML.format(data=data).encode()
    if kind == "wrong_types":
        (tasks / "own.yaml").write_text("task: [1, 2]\noutput_type: 7\n")
    else:
        _breakage(kind, good, tasks / "own.yaml")
    _refused(tmp_path, ["experiment=accuracy", "model=tiny", "experiment.tasks=[own]",
                        f"experiment.include_path={tasks}", "experiment.limit=1"], "own")


@pytest.mark.parametrize("kind", ["random_bytes", "latin1", "truncated", "empty", "wrong_types"])
def test_task_data_file(kind, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    good = (json.dumps({"q": "time 1+1=", "a": "2"}) + "\n").encode() * 3
    data = _breakage(kind, good, tmp_path / "own.jsonl")
    (tasks / "own.yaml").write_text(TASK_YAML.format(data=data))
    _refused(tmp_path, ["experiment=accuracy", "model=tiny", "experiment.tasks=[own]",
                        f"experiment.include_path={tasks}", "experiment.limit=1"], "own")


@pytest.mark.parametrize("kind", ["random_bytes", "truncated", "empty", "wrong_types", "no_weights"])
def test_model_folder(kind, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(TINY, folder)
    cfg = folder / "config.json"
    if kind == "no_weights":
        for f in folder.glob("*.safetensors"):
            f.unlink()
    elif kind == "wrong_types":
        c = json.loads(cfg.read_text())
        c["num_hidden_layers"] = "thirty-two"
        cfg.write_text(json.dumps(c))
    else:
        _breakage(kind, cfg.read_bytes(), cfg)
    _refused(tmp_path, ["experiment=speed", f"model.path={folder}", "dataset.count=1", "dataset.max_new_tokens=2",
                        "experiment.repeats=1", "experiment.warmup=0"], str(folder))


def _refused(tmp_path, args, names: str):
    run = tmp_path / "run"
    res = run_cli(*args, "threads=1", f"hydra.run.dir={run}", timeout=300)
    err = res.stderr.strip()
    assert res.returncode == 2, (res.returncode, err[-1500:])
    assert "Traceback" not in res.stderr + res.stdout, err[-1500:]
    line = [ln for ln in err.splitlines() if ln.startswith("specee: error:")]
    assert len(line) == 1 and names in line[0], err[-1500:]
    assert not (run / "results.json").exists()
    assert os.path.getsize(tmp_path) >= 0  # the folder is still there to inspect
