"""Values of the wrong type, range or shape inside a user's own files, by file kind: task YAMLs,
prompt files, model folders' config.json, predictor / AdaInfer / exit-profile / draft cards and
draft vocabulary tables, and the results.json files a report reads. Each bad value ends in one
SpeceeError line naming the file (or file:line for row data) and the key; a whole run through
run.py ends in that line with exit status 2, no traceback and no run folder. Every case runs in
process (milliseconds each) except the two whole runs."""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import ROOT, run_cli
from specee.errors import SpeceeError, one_line

ART = ROOT / "specee" / "artifacts"


def _one_line(err: SpeceeError, *named: str) -> str:
    msg = str(err)
    assert msg == one_line(msg) and len(msg.splitlines()) == 1, msg
    assert "Traceback" not in msg
    for n in named:
        assert n in msg, (n, msg)
    return msg


# -- task YAMLs (experiment.include_path) --------------------------------------------------------
GOOD_TASK = ("task: own\noutput_type: generate_until\ndataset_path: json\n"
             "dataset_kwargs:\n  data_files: {{test: {data}}}\ntest_split: test\n"
             "doc_to_text: \"{{{{q}}}}\"\ndoc_to_target: \"{{{{a}}}}\"\n")
# (what is wrong, the YAML line(s) appended to a good task, the key the error must name)
TASK_VALUES = [
    ("type", "num_fewshot: five", "num_fewshot"),
    ("range", "num_fewshot: -1", "num_fewshot"),
    ("type", "metric_list: 3", "metric_list"),
    ("shape", "metric_list: [acc]", "metric_list[0]"),
    ("shape", "metric_list: [{aggregation: mean}]", "metric_list[0]"),
    ("range", "metric_list: [{metric: accuracy}]", "metric_list[0].metric"),
    ("range", "metric_list: [{metric: acc, aggregation: average}]", "metric_list[0].aggregation"),
    ("type", "metric_list: [{metric: acc, higher_is_better: yes please}]", "metric_list[0].higher_is_better"),
    ("type", "generation_kwargs: [until]", "generation_kwargs"),
    ("range", "generation_kwargs: {max_gen_toks: 0}", "generation_kwargs.max_gen_toks"),
    ("type", "generation_kwargs: {until: 5}", "generation_kwargs.until"),
    ("range", "generation_kwargs: {temperature: -1}", "generation_kwargs.temperature"),
    ("type", "filter_list: take_first", "filter_list"),
    ("shape", "filter_list: [{name: f}]", "filter_list[0]"),
    ("shape", "filter_list: [{name: f, filter: [take_first]}]", "filter_list[0].filter[0]"),
    ("range", "filter_list: [{name: f, filter: [{function: nope}]}]", "filter_list[0].filter[0].function"),
    ("range", "output_type: generate", "output_type"),
    ("type", "output_type: 7", "output_type"),
    ("type", "doc_to_text: [1, 2]", "doc_to_text"),
    ("type", "doc_to_target: {a: 1}", "doc_to_target"),
    ("type", "doc_to_choice: 5", "doc_to_choice"),
    ("type", "doc_to_text: true", "doc_to_text"),
    ("range", "fewshot_split: train", "fewshot_split"),
    ("range", "repeats: 0", "repeats"),
    ("type", "description: 5", "description"),
    ("type", "should_decontaminate: maybe", "should_decontaminate"),
    ("type", "dataset_kwargs: {data_files: 5}", "dataset_kwargs.data_files"),
    ("range", "metadata: {chance: 2}", "metadata.chance"),
    ("shape", "output_type: multiple_choice", "doc_to_choice"),
    ("type", "include: 5", "include"),
]


@pytest.fixture()
def task_dir(tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tmp_path / "own.jsonl"
    data.write_text(json.dumps({"q": "1+1=", "a": "2"}) + "\n")
    return tasks, GOOD_TASK.format(data=data)


@pytest.mark.parametrize("what,line,key", TASK_VALUES, ids=[f"{w}:{l}"[:60] for w, l, _ in TASK_VALUES])
def test_task_yaml_value(task_dir, what, line, key):
    from specee.evaluation.registry import check_user_tasks
    tasks, good = task_dir
    (tasks / "own.yaml").write_text(good + line + "\n")
    with pytest.raises(SpeceeError) as err:
        check_user_tasks(["own"], tasks)
    _one_line(err.value, str(tasks / "own.yaml"), key)


def test_a_bad_value_in_an_included_yaml_names_that_file(task_dir):
    from specee.evaluation.registry import check_user_tasks
    tasks, good = task_dir
    (tasks / "_base.yaml").write_text("num_fewshot: five\n")
    (tasks / "own.yaml").write_text("include: _base.yaml\n" + good)
    with pytest.raises(SpeceeError) as err:
        check_user_tasks(["own"], tasks)
    _one_line(err.value, str(tasks / "_base.yaml"), "num_fewshot")


def test_task_yamls_lm_eval_reads_pass(task_dir):
    """The values the checks accept: every kind lm-eval's readers take, and the shipped tasks."""
    from specee.evaluation import registry
    tasks, good = task_dir
    (tasks / "own.yaml").write_text(good + "num_fewshot: 0\nrepeats: 1\ndoc_to_choice: [a, b]\n"
                                    "generation_kwargs: {until: [\"\\n\"], max_gen_toks: 4, do_sample: false, "
                                    "temperature: 0}\nfilter_list: [{name: f, filter: [{function: take_first}]}]\n"
                                    "metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]\n"
                                    "metadata: {chance: 0.5}\n")
    registry.check_user_tasks(["own"], tasks)
    import yaml
    from specee.evaluation import task_values
    for name in registry.available():  # their data files lie under the data root: values only
        yml = registry.TASKS_DIR / f"{name}.yaml"
        merged = registry.check_task_fields(yml, yaml.load(yml.read_text(), Loader=registry._Lenient))
        assert merged is not None and task_values.check_merged(merged) is None, name


def test_lm_eval_output_types_are_read_from_lm_eval():
    from lm_eval.api.task import ALL_OUTPUT_TYPES
    from specee.evaluation.task_values import output_types
    assert set(output_types()) == set(ALL_OUTPUT_TYPES)


# -- prompt files (dataset=jsonl) ----------------------------------------------------------------
# (what is wrong, settings, the bad row, the key the error must name)
PROMPT_VALUES = [
    ("type", {"field": "prompt"}, {"prompt": 5}, "'prompt'"),
    ("range", {"field": "prompt"}, {"prompt": "   "}, "'prompt'"),
    ("shape", {"field": "prompt"}, {"prompt": ["ok", 3]}, "'prompt'"),
    ("shape", {"field": "prompt"}, {"prompt": []}, "'prompt'"),
    ("type", {"turns_field": "turns"}, {"turns": {"a": 1}}, "'turns'"),
    ("type", {"field": "prompt", "id_field": "uid"}, {"prompt": "x", "uid": [1]}, "'uid'"),
    ("type", {"field": "prompt", "id_field": "uid"}, {"prompt": "x", "uid": True}, "'uid'"),
    ("range", {"field": "prompt", "id_field": "uid"}, {"prompt": "x", "uid": "a"}, "'a'"),  # repeats row 1's
    ("type", {"field": "prompt", "category_field": "kind"}, {"prompt": "x", "kind": None}, "'kind'"),
    ("shape", {"field": "prompt"}, ["not", "an", "object"], "JSON object"),
]


@pytest.mark.parametrize("what,settings,row,key", PROMPT_VALUES,
                         ids=[f"{w}:{json.dumps(r)}"[:50] for w, _, r, _ in PROMPT_VALUES])
def test_prompt_row_value(tmp_path, what, settings, row, key):
    from omegaconf import OmegaConf
    from specee.data import user_jsonl_prompts
    path = tmp_path / "prompts.jsonl"
    good = {"prompt": "Once upon a time", "turns": ["Hi"], "uid": "a", "kind": "story"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    d = OmegaConf.create({"name": "jsonl", "path": str(path), "field": None, "turns_field": None,
                          "category_field": None, "id_field": None, **settings})
    with pytest.raises(SpeceeError) as err:
        user_jsonl_prompts(d)
    _one_line(err.value, f"{path}:2", key)


@pytest.mark.parametrize("field,value", [("turns", "one turn"), ("turns", [1]), ("question_id", {"a": 1}),
                                         ("category", 3)])
def test_a_spec_bench_row_of_the_wrong_type_names_file_line_and_field(tmp_path, field, value):
    from specee import data
    shutil.copytree(ROOT / "data" / "spec_bench", tmp_path / "spec_bench")
    path = tmp_path / data.SPEC_BENCH
    rows = path.read_text().splitlines()
    bad = json.loads(rows[2])
    bad[field] = value
    rows[2] = json.dumps(bad)
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(SpeceeError) as err:
        data.spec_bench_prompts(tmp_path)
    _one_line(err.value, f"{path}:3", repr(field))


# -- model folders (config.json) -----------------------------------------------------------------
MODEL_VALUES = [
    ("type", "num_hidden_layers", "thirty-two"),
    ("range", "num_hidden_layers", 0),
    ("type", "hidden_size", 19.2),
    ("type", "tie_word_embeddings", "yes"),
    ("type", "rms_norm_eps", "small"),
    ("range", "rms_norm_eps", -1e-5),
    ("range", "max_position_embeddings", -3),
    ("type", "max_position_embeddings", "1024"),
    ("range", "intermediate_size", 0),
    ("range", "eos_token_id", 99999),
    ("shape", "eos_token_id", [0, "end"]),
    ("range", "attention_dropout", 7),
    ("type", "hidden_act", 5),
    ("shape", "rope_parameters", 3),
    ("shape", "num_key_value_heads", 4),  # 6 heads are not divisible by 4
]


@pytest.mark.parametrize("what,key,value", MODEL_VALUES, ids=[f"{w}:{k}={v!r}" for w, k, v in MODEL_VALUES])
def test_model_config_value(tmp_path, what, key, value):
    from specee.models.loader import check_config_shape
    path = tmp_path / "config.json"
    conf = json.loads((ART / "tiny" / "config.json").read_text())
    conf[key] = value
    path.write_text(json.dumps(conf))
    with pytest.raises(SpeceeError) as err:
        check_config_shape(path)
    _one_line(err.value, str(path), key)


def test_every_shipped_model_config_passes():
    from specee.models.loader import check_config_shape
    for path in [*ART.glob("*/config.json"), *(ROOT / "specee" / "models" / "shapes").glob("*.json")]:
        check_config_shape(path)


# -- cards: predictors, AdaInfer, exit profile, draft, draft vocabulary ----------------------------
def _predictors(folder):
    from specee.early_exit.predictor import PredictorBank
    return PredictorBank.check(folder, 32, 4, "per_layer")


def _adainfer(folder):
    from specee.decoding.adainfer import load_classifier
    return load_classifier(folder, "svm")


def _profile(folder):
    from specee.early_exit.schedule import load_profile
    return load_profile(folder, 32)


def _draft(folder):
    from specee.models.draft import check_draft
    return check_draft(folder, 32, 192)


def _draft_vocab(folder):
    from specee.models.draft_vocab import read_table
    return read_table(folder, 1536)


# card kind -> (shipped folder, its file, its check)
CARD_FILES = {"predictors": ("tiny_predictors", "predictors_card.json", _predictors),
              "adainfer": ("tiny_adainfer", "adainfer_svm.json", _adainfer),
              "profile": ("tiny_exit_profile", "exit_profile.json", _profile),
              "draft": ("tiny_draft", "draft_card.json", _draft),
              "draft_vocab": ("tiny_draft", "draft_vocab.json", _draft_vocab)}
THRESHOLDS_32 = [0.5] * 32
CARD_VALUES = [
    ("predictors", "range", "layer_thresholds", [1.5] + THRESHOLDS_32[1:]),
    ("predictors", "type", "layer_thresholds", ["high"] * 32),
    ("predictors", "shape", "layer_thresholds", [0.5] * 3),
    ("predictors", "range", "threshold", 1.5),
    ("predictors", "type", "threshold", "half"),
    ("predictors", "type", "k", "four"),
    ("predictors", "range", "per_layer", [{"layer": 99, "threshold": 0.5}]),
    ("predictors", "range", "per_layer", [{"layer": 0, "threshold": 2}]),
    ("predictors", "type", "calibration_prompt_ids", 7),
    ("adainfer", "type", "coef", ["a", "b"]),
    ("adainfer", "shape", "coef", [1.0]),
    ("adainfer", "type", "intercept", "zero"),
    ("adainfer", "range", "num_layers", 0),
    ("adainfer", "type", "calibration_prompt_ids", {"a": 1}),
    ("profile", "type", "exit_counts", ["many"] * 32),
    ("profile", "shape", "exit_counts", [1, 2]),
    ("profile", "range", "default_offline_set", [0, 40]),
    ("profile", "type", "default_offline_set", "0,1"),
    ("profile", "range", "threshold", -0.1),
    ("profile", "range", "tokens", -5),
    ("draft", "type", "base_num_layers", "32"),
    ("draft", "range", "hidden_size", 0),
    ("draft", "type", "base_weights_fingerprint", 12),
    ("draft_vocab", "type", "order", ["a"] + list(range(1, 1536))),
    ("draft_vocab", "range", "held_out_coverage", {"256": 3.0}),
]


@pytest.mark.parametrize("card,what,key,value", CARD_VALUES,
                         ids=[f"{c}:{w}:{k}={json.dumps(v)[:20]}" for c, w, k, v in CARD_VALUES])
def test_card_value(tmp_path, card, what, key, value):
    shipped, name, check = CARD_FILES[card]
    folder = tmp_path / shipped
    shutil.copytree(ART / shipped, folder)
    doc = json.loads((folder / name).read_text())
    if card == "predictors" and key != "layer_thresholds":
        doc["layer_thresholds"] = THRESHOLDS_32
    doc[key] = value
    (folder / name).write_text(json.dumps(doc))
    with pytest.raises(SpeceeError) as err:
        check(folder)
    _one_line(err.value, str(folder / name) if card != "profile" or key != "exit_counts" else str(folder),
              key if key != "exit_counts" or what == "type" else "layers")


# -- results.json read by the report -------------------------------------------------------------
def _result(**metrics) -> dict:
    recipe = "accuracy" if "accuracy" in metrics else "speed"
    return {"specee_results": 1, "created": "2026-01-01T00:00:00+00:00",
            "config": {"model": {"name": "tiny"}, "ablation": {"name": "dense", "mode": "dense"},
                       "experiment": {"_target_": f"experiments.{recipe}.run"}},
            "env": {"cpu": "x", "torch_threads": 1, "gpus": []},
            "metrics": {"decode_tokens_per_s": 10.0, "speedup_vs_dense": 1.0, **metrics}}


RESULT_VALUES = [
    ("type", {"decode_tokens_per_s": "fast"}, "metrics.decode_tokens_per_s"),
    ("range", {"match_rate_vs_dense": 1.7}, "metrics.match_rate_vs_dense"),
    ("shape", {"speedup_vs_dense_ci": [1.0]}, "metrics.speedup_vs_dense_ci"),
    ("type", {"noisy": "no"}, "metrics.noisy"),
    ("type", {"dense": {"decode_tokens_per_s": [1, 2]}}, "metrics.dense.decode_tokens_per_s"),
    ("type", {"accuracy": {"copa": {"accuracy": "high", "n": 4}}}, "metrics.accuracy.copa.accuracy"),
    ("range", {"accuracy": {"copa": {"accuracy": 0.5, "n": -4}}}, "metrics.accuracy.copa.n"),
    ("shape", {"accuracy": [0.5]}, "metrics.accuracy"),
]


@pytest.mark.parametrize("what,metrics,key", RESULT_VALUES, ids=[f"{w}:{k}" for w, _, k in RESULT_VALUES])
def test_results_value_skips_that_file_and_keeps_the_rest(tmp_path, what, metrics, key):
    from specee.results import read_sweep
    good, bad = tmp_path / "good" / "results.json", tmp_path / "bad" / "results.json"
    for path, doc in ((good, _result()), (bad, _result(**metrics))):
        path.parent.mkdir()
        path.write_text(json.dumps(doc))
    whole, skipped = read_sweep(tmp_path)
    assert [p for p, _ in whole] == [good]
    assert [p for p, _ in skipped] == [bad]
    _one_line(SpeceeError(skipped[0][1]), str(bad), key)


def test_a_wrongly_typed_name_in_a_result_is_named():
    from specee.result_values import check_result_values
    doc = _result()
    doc["config"]["ablation"]["name"] = 3
    with pytest.raises(SpeceeError) as err:
        check_result_values("r/results.json", doc)
    _one_line(err.value, "r/results.json", "config.ablation.name")


def test_shipped_reports_results_pass():
    from specee.results import read_results
    paths = sorted((ROOT / "reports").rglob("results.json"))
    assert paths
    for path in paths:
        read_results(path, "fix")


# -- whole runs: one line, exit 2, no run folder ---------------------------------------------------
def _refused_whole_run(tmp_path, args, *named):
    run = tmp_path / "run"
    res = run_cli(*args, "threads=1", f"hydra.run.dir={run}", timeout=300)
    assert res.returncode == 2, (res.returncode, res.stderr[-1500:])
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-1500:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("specee: error: "), res.stderr[-1500:]
    for n in named:
        assert n in lines[0], (n, lines[0])
    assert not run.exists()  # checked before Hydra makes the run folder


def test_the_issue_task_yaml_ends_in_one_line_before_any_folder(task_dir, tmp_path):
    tasks, good = task_dir
    (tasks / "own.yaml").write_text(good + "num_fewshot: five\nmetric_list: 3\n")
    _refused_whole_run(tmp_path, ["experiment=accuracy", "model=tiny", "experiment.tasks=[own]",
                                  f"experiment.include_path={tasks}", "experiment.limit=1"],
                       str(tasks / "own.yaml"), "num_fewshot")


def test_a_prompt_row_of_the_wrong_type_ends_in_one_line_before_any_folder(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n" + json.dumps({"prompt": 42}) + "\n")
    _refused_whole_run(tmp_path, ["experiment=speed", "model=tiny", "dataset=jsonl", f"dataset.path={path}",
                                  "dataset.field=prompt"], f"{path}:2", "'prompt'")


@pytest.mark.parametrize("source,body,named", [
    ("alpaca_gpt4_demo", json.dumps([{"instruction": 5, "output": "x"}]), "[0]: field 'instruction'"),
    ("alpaca_gpt4_demo", json.dumps({"instruction": "x"}), "JSON array"),
    ("dolly_sample", json.dumps({"prompt": "a", "answer": "b"}) + "\n" + json.dumps({"prompt": ["a"], "answer": "b"}),
     ":2: field 'prompt'"),
    ("dolly_sample", json.dumps({"prompt": "a"}), ":1: missing field 'answer'"),
])
def test_instruction_data_value(tmp_path, source, body, named):
    """Training data under paths.data_root (the draft head's instruction sets) is a user's file too."""
    from specee import data
    path = tmp_path / data.INSTRUCTION_FILES[source]
    path.parent.mkdir(parents=True)
    path.write_text(body + "\n")
    with pytest.raises(SpeceeError) as err:
        data.instruction_pairs(tmp_path, [source])
    _one_line(err.value, str(path), named)


def test_another_recipes_metrics_are_not_read_as_speed_metrics():
    """The catalog is the speed recipe's: a frontier result's `prompts` (a mapping of counts per
    half) is not a speed job's prompt count."""
    from specee.result_values import check_result_values
    doc = _result(prompts={"calibration": 7, "test": 6, "timed": [1, 2]})
    doc["config"]["experiment"]["_target_"] = "experiments.frontier.run"
    check_result_values("r/results.json", doc)
