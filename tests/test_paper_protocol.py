"""The SpecEE authors' accuracy protocol (csqa_paper, sst2_paper) and predictor recipe: the prompt
byte for byte, their offset parser, both denominators, the recipe preset, a user's own task."""
import hashlib
import json
import os

import pytest
from hydra import compose, initialize_config_dir

from conftest import ROOT, run_cli

from specee.errors import SpeceeError
from specee.evaluation import answer_figures, registry
from specee.evaluation.tasks import utils

os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
DATA = (ROOT / os.environ.get("SPECEE_DATA_ROOT", "data")).resolve()

# The authors' constants (infinigence/SpecEE cd09de7, SpecEE_cloud/accuracy_prompt.py), by hash and
# by their opening and closing bytes.
SHOTS = {"commonsense_qa_5shot.txt": "b9c9678f3b43cbcba429c716ee029a7e7b89ef929daa52aa1c333d08aba2b323",
         "sst2_5shot.txt": "394a960f7b056acae6fc7360cc4baa141c0231e73bfb2deff45962f6bfa0f911"}


def _rows(rel):
    return [json.loads(line) for line in (DATA / rel).read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("name", sorted(SHOTS))
def test_shots_are_the_authors_bytes(name):
    raw = (utils.PAPER_PROMPTS / name).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == SHOTS[name]
    assert utils.paper_shots(name).encode() == raw  # read without newline translation


def test_csqa_prompt_byte_for_byte():
    doc = _rows("commonsense_qa/dev_rand_split.jsonl")[0]
    prompt = utils.csqa_paper_prompt(doc)
    assert prompt.startswith("Here are some questions.You should give your answers.Your answer must be among "
                             "A,B,C,D and E.\nThe sanctions against the school were a punishing blow")
    assert prompt.endswith("E. dense forest\nAnswer: C\n\n"
                           "A revolving door is convenient for two direction travel, but it also serves as a "
                           "security measure at a what?\nA. bank\nB. library\nC. department store\nD. mall\n"
                           "E. new york\n")  # nothing after the options: the model writes "Answer: X"
    assert prompt.count("Answer: ") == 5 and utils.csqa_paper_target(doc) == "A"


def test_sst2_prompt_byte_for_byte():
    doc = _rows("sst2/sst2_validation.jsonl")[1]
    prompt = utils.sst2_paper_prompt(doc)
    assert prompt.startswith("Here are some sentences.You need to answer the sentiment of these sentences.If the "
                             "sentiment of a sentence is positive,you need to output 1,otherwise 0.\n"
                             "Sentence: hide new secretions from the parental units\nSentiment: 0\n\n")
    assert "human nature \nSentiment: 1" in prompt  # their trailing spaces kept
    assert prompt.endswith("emotional wallop . \nSentiment: 1\n\nSentence: unflinchingly bleak and desperate\n"
                           "Sentiment")
    assert utils.sst2_paper_target(doc) == "0"


def test_shots_are_not_evaluated_items():
    shots = utils.paper_shots("commonsense_qa_5shot.txt") + utils.paper_shots("sst2_5shot.txt")
    questions = [r["question"] for r in _rows("commonsense_qa/dev_rand_split.jsonl")]
    sentences = [r["sentence"] for r in _rows("sst2/sst2_validation.jsonl")]
    assert len(questions) == 1221 and len(sentences) == 872
    assert not any(q + "\n" in shots for q in questions)
    assert not any("Sentence: " + s.strip() in shots for s in sentences)


@pytest.mark.parametrize("written, letter", [
    ("Answer: C", "C"), ("Answer:c", "C"),                         # the expected shapes
    (" Answer: B\n", ":"),        # one leading space shifts their offset onto the colon
    ("The answer is B", "W"),     # something else: their offset reads whatever sits after 7 chars
    ("B", "N/A"), ("", "N/A"), ("Answer:", "N/A"), ("\n\n\"", "N/A"),  # nothing left to read
    ("Answer: \u00e9t\u00e9", "\u00c9"),                                 # garbage is a character, not an error
])
def test_csqa_offset_parse(written, letter):
    assert utils.csqa_paper_parse([[written]], [None]) == [[letter]]


@pytest.mark.parametrize("written, digit", [(": 1", "1"), (":0", "0"), (": positive", "p"), ("", "N/A"), (":", "N/A")])
def test_sst2_offset_parse(written, digit):
    assert utils.sst2_paper_parse([[written]], [None]) == [[digit]]


def _samples(answers, golds):
    return [{"filtered_resps": [a], "target": g, "exact_match": float(a == g)} for a, g in zip(answers, golds)]


def test_both_denominators_and_the_unparsed_share():
    golds = list("ABCDEABCDE")
    answers = ["A", "B", "C", "N/A", "N/A", "E", "I", "D", "N/A", "A"]  # 3 right, 6 parsed to A-E
    meta = {"answer_labels": list("ABCDE"), "paper_denominator": {"dense": "all", "speculative": "parsed"}}
    spec = answer_figures.figures(_samples(answers, golds), "exact_match", meta, "specee")
    assert spec["accuracy_all_items"] == pytest.approx(0.3)
    assert spec["parsed_items"] == 6 and spec["unparsed_share"] == pytest.approx(0.4)
    assert spec["accuracy_parsed_items"] == pytest.approx(0.5)
    assert spec["paper_denominator"] == "parsed" and spec["accuracy_paper_denominator"] == pytest.approx(0.5)
    dense = answer_figures.figures(_samples(answers, golds), "exact_match", meta, "dense")
    assert dense["paper_denominator"] == "all" and dense["accuracy_paper_denominator"] == pytest.approx(0.3)
    # a task that declares no labels: its distinct gold answers are the label set
    own = answer_figures.figures(_samples(answers, golds), "exact_match", {}, "specee")
    assert own["answer_labels"] == list("ABCDE") and own["parsed_items"] == 6
    assert own["accuracy_paper_denominator"] == own["accuracy_all_items"]  # no declared quirk: all items
    with pytest.raises(SpeceeError, match="paper_denominator"):
        answer_figures.figures(_samples(answers, golds), "exact_match", {"paper_denominator": {"dense": "some"}},
                               "dense")


def test_fixed_shots_refuse_more_fewshot():
    registry.check_fewshot(["csqa_paper", "boolq"], 0)
    registry.check_fewshot(["boolq"], 3)
    with pytest.raises(SpeceeError, match="num_fewshot=0"):
        registry.check_fewshot(["sst2_paper"], 5)


def _compose(*overrides):
    from specee.config import register
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose("config", overrides=list(overrides))


def test_paper_recipe_preset_sets_the_authors_settings():
    from experiments.train_predictors import resolve_recipe
    cfg = _compose("experiment=train_predictors", "experiment.recipe=paper")
    resolve_recipe(cfg)
    e = cfg.experiment
    assert (e.epochs, e.batch_size, e.lr, e.hidden, e.held_out_share) == (100, 1024, 1e-3, 512, 0.2)
    assert e.label == "unnormed" and cfg.early_exit.threshold == 0.5
    c = e.calibration
    assert c.min_tokens >= 15000 and c.max_new_tokens == 256 and c.spec_bench_offset >= 10
    assert "math_reasoning" not in c.spec_bench_categories and c.story_prompts == 0
    harness = _compose("experiment=train_predictors")
    resolve_recipe(harness)
    assert harness.experiment.epochs == 15 and harness.experiment.label == "final"  # named "harness", not "paper"
    for clash in ("experiment.epochs=5", "experiment.calibration.min_tokens=100", "early_exit.threshold=0.7"):
        with pytest.raises(SpeceeError, match="recipe=paper"):
            resolve_recipe(_compose("experiment=train_predictors", "experiment.recipe=paper", clash))
    same = _compose("experiment=train_predictors", "experiment.recipe=paper", "experiment.epochs=100")
    resolve_recipe(same)  # the recipe's own value is no clash


def test_paper_tasks_end_to_end_on_tiny(tmp_path):
    res = run_cli("experiment=accuracy", "model=tiny", "ablation=dense", "experiment.tasks=[csqa_paper,sst2_paper]",
                  "experiment.limit=3", "threads=1", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    for task, labels in (("csqa_paper", list("ABCDE")), ("sst2_paper", ["0", "1"])):
        m = doc["metrics"]["accuracy"][task]
        assert m["n"] == 3 and m["protocol"] == "specee_paper" and m["answer_labels"] == labels
        assert m["accuracy_all_items"] == m["accuracy"] and m["paper_denominator"] == "all"
        assert 0 <= m["unparsed_share"] <= 1 and len(doc["items"][task]) == 3
        rows = [json.loads(line) for line in (tmp_path / f"samples_{task}.jsonl").read_text().splitlines()]
        build = utils.csqa_paper_prompt if task == "csqa_paper" else utils.sst2_paper_prompt
        for r in rows:  # the request is the authors' prompt, byte for byte, 3 tokens and no stop
            context, kwargs = r["arguments"][0] if isinstance(r["arguments"][0], list) else r["arguments"]["gen_args_0"].values()
            assert context == build(r["doc"])
            assert kwargs["max_gen_toks"] == 3 and kwargs["until"] == []
    bad = run_cli("experiment=accuracy", "model=tiny", "experiment.tasks=[csqa_paper]", "experiment.num_fewshot=2",
                  f"hydra.run.dir={tmp_path / 'bad'}")
    assert bad.returncode != 0 and "num_fewshot=0" in bad.stderr and "Traceback" not in bad.stderr


def test_a_users_generative_task_gets_the_same_figures(tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    rows = [{"q": f"Is {i} even? Answer yes or no.", "a": "yes" if i % 2 == 0 else "no"} for i in range(4)]
    (tmp_path / "own.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "own_gen.yaml").write_text(
        "task: own_gen\noutput_type: generate_until\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files: {{test: {tmp_path / 'own.jsonl'}}}\ntest_split: test\n"
        "doc_to_text: \"{{q}}\\nAnswer:\"\ndoc_to_target: \"{{a}}\"\n"
        "generation_kwargs: {until: [\"\\n\"], do_sample: false, max_gen_toks: 3}\n"
        "filter_list:\n  - name: word\n    filter:\n      - function: regex\n        regex_pattern: \"(yes|no)\"\n"
        "      - function: take_first\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    res = run_cli("experiment=accuracy", "model=tiny", "ablation=dense", "experiment.tasks=[own_gen]",
                  f"experiment.include_path={tasks}", "experiment.limit=4", "threads=1", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr[-2000:]
    m = json.loads((tmp_path / "run" / "results.json").read_text())["metrics"]["accuracy"]["own_gen"]
    assert m["answer_labels"] == ["no", "yes"] and m["paper_denominator"] == "all"
    for key in ("accuracy_all_items", "accuracy_paper_denominator", "unparsed_share"):
        assert 0 <= m[key] <= 1


def test_paper_speed_preset_plans_every_set_at_256_tokens():
    from experiments.reproduce import plan
    jobs = dict(plan(_compose("experiment=reproduce_paper_speed", "model=smollm2_135m")))
    sets = ["mt_bench", "spec_bench_summarization", "spec_bench_qa", "gsm8k", "humaneval"]
    assert sorted(jobs) == sorted(f"speed_{a}_{s}" for a in ("dense", "specee_t1_t2", "specee_t1_t2_paper", "eagle")
                                  for s in sets)
    args = jobs["speed_specee_t1_t2_paper_spec_bench_qa"]
    assert "dataset.max_new_tokens=256" in args and "dataset.categories=[qa]" in args and "dataset.count=2" in args
    assert "ablation=specee_t1_t2_paper" in args


def _acc_doc(name, mode, values, chance, predictors="x/smollm2_135m_predictors_paper"):
    n = len(values)
    acc = sum(values) / n
    se = (acc * (1 - acc) / (n - 1)) ** 0.5
    return {"config": {"experiment": {"_target_": "experiments.accuracy.run"}, "model": {"name": "m"},
                       "ablation": {"name": name, "mode": mode}, "early_exit": {"predictors_path": predictors}},
            "metrics": {"accuracy": {"t": {"accuracy": acc, "accuracy_stderr": se, "primary_metric": "acc",
                                           "chance": chance, "n": n}}},
            "items": {"t": {str(i): {"value": v, "answer": v} for i, v in enumerate(values)}}}


@pytest.mark.parametrize("dense, mode, chance, word", [
    ([1.0] * 150 + [0.0] * 50, [1.0] * 150 + [0.0] * 50, 0.25, "confirmed"),       # identical answers
    ([1.0] * 150 + [0.0] * 50, [1.0] * 100 + [0.0] * 100, 0.25, "refuted"),        # 25 points lost
    ([1.0] * 150 + [0.0] * 50, [1.0] * 146 + [0.0] * 54, 0.25, "inconclusive"),    # 2 points, wide interval
    ([1.0] * 100 + [0.0] * 100, [1.0] * 50 + [0.0] * 150, 0.5, "not testable here"),  # dense at chance
])
def test_accuracy_verdict_rules(dense, mode, chance, word):
    from specee import verdicts
    rows = verdicts.verdict_rows([_acc_doc("dense", "dense", dense, chance),
                                  _acc_doc("specee_t1_t2_paper", "specee", mode, chance)])
    assert len(rows) == 1 and rows[0]["verdict"] == word and rows[0]["bank"] == "paper-recipe bank"
    assert rows[0]["protocol"] == "harness log-likelihood"
