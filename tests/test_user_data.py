"""A fresh clone runs on the shipped data; users bring their own prompts (JSONL, datasets folders)
and their own lm-eval task YAMLs."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, run_cli
from specee import data


def test_shipped_data_covers_what_the_main_job_and_tests_read():
    shipped = ROOT / "data"
    for rel in (data.SPEC_BENCH, data.MT_BENCH, data.TINYSTORIES_VALID, data.TINYSTORIES_CONTINUATION):
        assert (shipped / rel).is_file(), rel
    from specee.evaluation import registry
    for task in registry.available():
        for path in registry.data_files(task, shipped).values():
            assert path.is_file()
    for folder in (p for p in shipped.iterdir() if p.is_dir()):
        assert (folder / "SOURCE.md").is_file(), f"{folder.name} has no SOURCE/licence note"
    # Training corpora and the non-commercial instruction set stay outside the repository.
    assert not (shipped / data.TINYSTORIES_TRAIN).exists()
    assert not (shipped / "alpaca_gpt4_demo").exists()
    size = sum(f.stat().st_size for f in shipped.rglob("*") if f.is_file())
    assert size < 8 * 2**20, f"shipped data is {size / 2**20:.1f} MB"


def test_training_only_file_names_where_it_comes_from(tmp_path):
    res = run_cli("experiment=train_base", "experiment.steps=1", f"experiment.out_dir={tmp_path / 'out'}",
                  f"experiment.checkpoint_dir={tmp_path / 'ckpt'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 2, res.stderr[-1500:]
    assert "needed only for training tiny" in res.stderr and "paths.data_root" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.fixture()
def fresh_clone(tmp_path):
    """The repository's files (as git would clone them: tracked and not ignored) in a folder with
    nothing beside it."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                                cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone" / "specee"
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (clone / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, clone / rel)
    assert not (clone.parent / "shared").exists()
    return clone


def _run_in(clone, *args):
    env = {k: v for k, v in os.environ.items() if k != "SPECEE_DATA_ROOT"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(clone))
    return subprocess.run([sys.executable, str(clone / "run.py"), *args], cwd=clone, capture_output=True,
                          text=True, timeout=900, env=env)


def test_fresh_clone_runs_a_speed_and_an_accuracy_job(fresh_clone):
    res = _run_in(fresh_clone, "experiment=speed", "ablation=specee_t1_t2", "dataset.categories=[writing]",
                  "dataset.max_new_tokens=8", "threads=1", "hydra.run.dir=runs/speed_check")
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((fresh_clone / "runs/speed_check/results.json").read_text())
    assert doc["config"]["paths"]["data_root"] == "data"
    assert oct((fresh_clone / "runs/speed_check/results.json").stat().st_mode & 0o044) == oct(0o044)
    assert "wrote" in (fresh_clone / "runs/speed_check/run.log").read_text()
    res = _run_in(fresh_clone, "experiment=accuracy", "experiment.tasks=[copa]", "experiment.limit=4",
                  "threads=1", "hydra.run.dir=runs/acc_check")
    assert res.returncode == 0, res.stderr[-2000:]
    acc = json.loads((fresh_clone / "runs/acc_check/results.json").read_text())["metrics"]["accuracy"]
    assert acc["copa"]["n"] == 4
    assert (fresh_clone / "runs/acc_check/hf_datasets_cache").is_dir(), "datasets cache left the run dir"


@pytest.mark.slow
def test_jsonl_prompts_with_categories_and_turns(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"conv": ["Write a poem.", "Now shorter."], "kind": "poetry", "uid": "a"}) + "\n\n"
                 + json.dumps({"conv": ["Tell a story."], "kind": "story", "uid": "b"}) + "\n")
    res = run_cli("experiment=speed", "dataset=jsonl", f"dataset.path={f}", "dataset.turns_field=conv",
                  "dataset.category_field=kind", "dataset.id_field=uid", "dataset.turns=2",
                  "dataset.max_new_tokens=4", "threads=1", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads((tmp_path / "run" / "results.json").read_text())["prompts"]
    assert {(r["id"], r["category"], r["turn"]) for r in rows} == {("a", "poetry", 0), ("a", "poetry", 1),
                                                                  ("b", "story", 0)}


@pytest.mark.parametrize("rows,message", [
    (['{"q": "fine"}', '{not json'], "mine.jsonl:2: not valid JSON"),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [  # the first case stays in the fast tier
        (['{"q": "fine"}', '{"x": 1}'], "mine.jsonl:2: no key 'q'"),
        (['{"q": ""}'], "mine.jsonl:1: the prompt must be a non-empty string"),
        (['[1, 2]'], "mine.jsonl:1: expected a JSON object")]),
])
def test_bad_jsonl_rows_name_their_line(tmp_path, rows, message):
    f = tmp_path / "mine.jsonl"
    f.write_text("\n".join(rows) + "\n")
    res = run_cli("experiment=speed", "dataset=jsonl", f"dataset.path={f}", "dataset.field=q",
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 2 and message in res.stderr, res.stderr[-1500:]
    assert "Traceback" not in res.stderr and not (tmp_path / "run" / "results.json").exists()


def test_jsonl_needs_a_path_and_a_field(tmp_path):
    res = run_cli("experiment=speed", "dataset=jsonl", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 2 and "dataset.path=FILE.jsonl" in res.stderr
    res = run_cli("experiment=speed", "dataset=jsonl", f"dataset.path={tmp_path}/x.jsonl", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 2 and "dataset.field=KEY" in res.stderr


@pytest.mark.slow
def test_hf_dataset_folder(tmp_path):
    import datasets
    ds = datasets.Dataset.from_dict({"text": ["Once upon a time", "The cat sat"], "id": ["x", "y"]})
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "ds"))
    res = run_cli("experiment=speed", "dataset=hf", f"dataset.path={tmp_path / 'ds'}", "dataset.split=test",
                  "dataset.field=text", "dataset.max_new_tokens=4", "threads=1", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "results.json").read_text())["metrics"]["prompts"] == 2
    res = run_cli("experiment=speed", "dataset=hf", f"dataset.path={tmp_path / 'ds'}", "dataset.split=nope",
                  "dataset.field=text", f"hydra.run.dir={tmp_path / 'run2'}")
    assert res.returncode == 2 and "dataset.split=nope" in res.stderr and "Traceback" not in res.stderr
    res = run_cli("experiment=speed", "dataset=hf", "dataset.path=some-org/some-set", "dataset.field=text",
                  f"hydra.run.dir={tmp_path / 'run3'}")
    assert res.returncode == 2 and "dataset.allow_hub=true" in res.stderr


@pytest.mark.slow
def test_own_task_yaml_through_include_path(tmp_path):
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"q": f"Is {i} even?", "label": int(i % 2 == 0)}) + "\n" for i in range(6)))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "even.yaml").write_text(
        "task: my_even\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files: {{test: {items}}}\n"
        "output_type: multiple_choice\ntest_split: test\n"
        'doc_to_text: "Question: {{q}}\\nAnswer:"\ndoc_to_choice: ["no", "yes"]\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n")
    res = run_cli("experiment=accuracy", "experiment.tasks=[my_even,copa]", f"experiment.include_path={tasks}",
                  "experiment.limit=6", "threads=1", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr[-2000:]
    acc = json.loads((tmp_path / "run" / "results.json").read_text())["metrics"]["accuracy"]
    assert acc["my_even"]["n"] == 6 and acc["my_even"]["primary_metric"] == "acc"
    assert acc["copa"]["n"] == 6


def test_unknown_task_points_at_lm_eval_switch(tmp_path):
    res = run_cli("experiment=accuracy", "experiment.tasks=[mmlu]", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 2 and "experiment.task_source=lm_eval" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("model,arch,marker", [("qwen2_7b", "qwen2", "<|im_start|>user"),
                                               ("mistral_7b", "mistral", "[INST] ")])
@pytest.mark.slow
def test_own_checkpoint_through_a_model_config(tmp_path, model, arch, marker):
    """A local HF folder of a Qwen2 / Mistral architecture runs through model=<config> model.path=...
    (random weights at toy size, saved with tiny's tokenizer: the path a user's checkpoint takes)."""
    from transformers import AutoTokenizer
    from conftest import TINY, random_lm
    from specee.prompts import format_conversation
    lm = random_lm(arch, layers=3)
    tok = AutoTokenizer.from_pretrained(TINY)
    lm.resize_token_embeddings(len(tok))
    lm.config.eos_token_id = tok.eos_token_id
    lm.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    res = run_cli("experiment=speed", f"model={model}", f"model.path={tmp_path / 'ckpt'}", "model.device=cpu",
                  "model.dtype=float32", "dataset.categories=[writing]", "dataset.max_new_tokens=6",
                  "threads=1", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    assert doc["metrics"]["match_rate_vs_dense"] == 1.0 and doc["chat_template"] == doc["config"]["model"]["chat_template"]
    assert marker in format_conversation(doc["chat_template"], [("hi", None)])
