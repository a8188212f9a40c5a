"""A user's own task keeps what it declares: its num_fewshot reaches lm-eval unless the user gives
one, its answer labels come from the task (all its items, not those experiment.limit kept) and
chance follows from them."""
import json
import os
from types import SimpleNamespace

import pytest

from conftest import run_cli

from specee.evaluation import answer_figures

os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")

# Four options; the first items' golds hold only A-C, D comes later: a label set read from the
# evaluated items alone would lose D.
GOLDS = list("ABCABC") + list("DDDD")


def _letter_task(tmp_path, shots: int = 5):
    rows = [{"q": f"Which letter is number {i}?", "answer": g} for i, g in enumerate(GOLDS)]
    train = [{"q": f"Shot question {i}?", "answer": "ABCD"[i % 4]} for i in range(8)]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "letters.yaml").write_text(
        "task: my_letters\noutput_type: generate_until\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files: {{test: {tmp_path / 'test.jsonl'}, train: {tmp_path / 'train.jsonl'}}}\n"
        f"test_split: test\nfewshot_split: train\nnum_fewshot: {shots}\n"
        "doc_to_text: \"Question: {{q}}\\nA. one\\nB. two\\nC. three\\nD. four\\nAnswer:\"\n"
        "doc_to_target: \"{{answer}}\"\n"
        "generation_kwargs: {until: [\"\\n\"], do_sample: false, max_gen_toks: 3}\n"
        "filter_list:\n  - name: letter\n    filter:\n      - function: regex\n        regex_pattern: \"([A-D])\"\n"
        "      - function: take_first\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    return tasks


def _run(tmp_path, tasks, name, *extra):
    res = run_cli("experiment=accuracy", "model=tiny", "ablation=dense", "experiment.tasks=[my_letters]",
                  f"experiment.include_path={tasks}", "experiment.limit=6", "threads=1", *extra,
                  f"hydra.run.dir={tmp_path / name}")
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / name / "results.json").read_text())
    samples = [json.loads(line) for line in (tmp_path / name / "samples_my_letters.jsonl").read_text().splitlines()]
    return res, doc, samples


def _prompt(sample) -> str:
    args = sample["arguments"]
    return args[0][0] if isinstance(args, list) else next(iter(args.values()))["arg_0"]


def test_a_users_task_keeps_its_fewshot_and_label_set(tmp_path):
    tasks = _letter_task(tmp_path)
    res, doc, samples = _run(tmp_path, tasks, "own")
    m = doc["metrics"]["accuracy"]["my_letters"]
    assert m["num_fewshot"] == 5 and doc["settings"]["num_fewshot"] == 5
    assert "Overwriting default num_fewshot" not in res.stderr + res.stdout
    assert len(samples) == 6 and all(_prompt(s).count("Answer:") == 6 for s in samples)  # 5 shots + the item
    # the evaluated golds are A-C; the task's own items hold D too
    assert {s["target"] for s in samples} == set("ABC")
    assert m["answer_labels"] == list("ABCD") and m["chance"] == pytest.approx(0.25)
    assert "all 10 items" in m["answer_labels_from"]

    # a number the user gives still overrides the task's own
    _, doc2, samples2 = _run(tmp_path, tasks, "two", "experiment.num_fewshot=2")
    assert doc2["metrics"]["accuracy"]["my_letters"]["num_fewshot"] == 2
    assert all(_prompt(s).count("Answer:") == 3 for s in samples2)


def _fake_task(golds, choices=None, meta=None):
    docs = [{"g": g} for g in golds]
    cfg = SimpleNamespace(metadata=meta or {}, doc_to_choice=choices)
    return SimpleNamespace(config=cfg, eval_docs=docs, doc_to_target=lambda d: d["g"],
                           doc_to_choice=lambda d: choices)


def test_the_label_set_does_not_shrink_with_limit():
    task = _fake_task(GOLDS)
    own = answer_figures.task_labels(task)
    assert own["labels"] == list("ABCD") and own["chance"] == pytest.approx(0.25)
    kept = GOLDS[:6]  # what experiment.limit=6 evaluates: A-C only
    samples = [{"filtered_resps": ["D"], "target": g, "exact_match": 0.0} for g in kept]
    with_task = answer_figures.figures(samples, "exact_match", {}, "dense", own["labels"])
    assert with_task["parsed_items"] == 6 and with_task["unparsed_share"] == 0.0 and with_task["chance"] == 0.25
    alone = answer_figures.figures(samples, "exact_match", {}, "dense")  # the evaluated golds only
    assert alone["parsed_items"] == 0 and alone["answer_labels"] == list("ABC")


def test_declared_labels_and_choices_come_first():
    declared = answer_figures.task_labels(_fake_task(GOLDS, meta={"answer_labels": list("ABCDE"), "chance": 0.2}))
    assert declared["labels"] == list("ABCDE") and declared["chance"] == 0.2
    choices = answer_figures.task_labels(_fake_task([0, 1, 2], choices=["yes", "no", "maybe"]))
    assert choices["labels"] == ["yes", "no", "maybe"] and choices["chance"] == pytest.approx(1 / 3)
    free = answer_figures.task_labels(_fake_task([str(i) for i in range(40)]))
    assert free["labels"] is None and free["chance"] is None  # free-form answers: no label set, no chance
