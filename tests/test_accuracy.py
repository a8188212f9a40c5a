"""lm-eval integration: the model adapter, the local tasks, the accuracy recipe and the drift check,
on the micro artifacts of test_pipeline (CPU, offline)."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, run_cli

from specee.decoding.dense import DenseDecoder
from specee.errors import SpeceeError
from specee.evaluation import drift, registry
from specee.evaluation.lm import SpeceeLM
from specee.runtime.layerwise import LayerwiseLM

os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
DATA = (ROOT / os.environ.get("SPECEE_DATA_ROOT", "data")).resolve()
TINY_BASELINE = ROOT / "specee" / "evaluation" / "baselines" / "tiny.json"
QUIET = ["threads=1"]


def req(kind, args, doc_id=0, idx=0, task="t"):
    from lm_eval.api.instance import Instance
    return Instance(kind, {}, args, idx, (task, doc_id, 1))


@pytest.fixture(scope="module")
def loaded(micro):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer
    root, _ = micro
    model = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(root / "base")


def hf_loglikelihood(model, ctx, cont):
    ids = torch.tensor([ctx + cont])
    with torch.inference_mode():
        logp = torch.log_softmax(model(ids).logits[0, len(ctx) - 1:-1].float(), -1)
    picked = logp.gather(-1, torch.tensor(cont)[:, None])[:, 0]
    return float(picked.sum()), bool((logp.argmax(-1) == torch.tensor(cont)).all())


PAIRS = [("Once upon a time", " there was a cat."), ("The dog said ", "hello to me"),
         ("", "Just a text"), ("Question: 2+2?\nAnswer:", " 4")]


def test_dense_loglikelihood_equals_hf_model(loaded):
    from lm_eval.api.model import TemplateLM
    model, tok = loaded
    lm = SpeceeLM(DenseDecoder(LayerwiseLM(model)), tok)
    got = lm.loglikelihood([req("loglikelihood", p, i) for i, p in enumerate(PAIRS)], disable_tqdm=True)
    lm_eval_side = SimpleNamespace(backend="causal", tok_encode=tok.encode)
    for (ctx_text, cont_text), (logprob, greedy) in zip(PAIRS, got):
        ctx, cont = lm.encode_pair(ctx_text, cont_text)
        if ctx_text:  # the split is lm-eval's own (trailing context space moves to the continuation)
            assert (ctx, cont) == TemplateLM._encode_pair(lm_eval_side, ctx_text, cont_text)
        else:
            assert ctx == [tok.eos_token_id]  # BOS (here = EOS) conditions an empty context
        ref, ref_greedy = hf_loglikelihood(model, ctx, cont)
        assert logprob == pytest.approx(ref, abs=1e-4) and greedy == ref_greedy
    assert all(r["mean_layers"] == 4 for r in lm.records.values())


def test_dense_rolling_loglikelihood_equals_hf_model(loaded):
    """Perplexity's input: a whole text after the prefix token, as the HF model scores it."""
    model, tok = loaded
    lm = SpeceeLM(DenseDecoder(LayerwiseLM(model)), tok)
    text = "Once upon a time there was a little cat. It liked milk."
    got, = lm.loglikelihood_rolling([req("loglikelihood_rolling", (text,))], disable_tqdm=True)
    ref, _ = hf_loglikelihood(model, [lm.prefix_token_id], tok.encode(text))
    assert got == pytest.approx(ref, abs=1e-3)


def test_overflow_truncates_context_left_and_counts_or_raises(loaded):
    model, tok = loaded
    dense = DenseDecoder(LayerwiseLM(model))
    lm = SpeceeLM(dense, tok, max_length=12)
    ctx, cont = lm.encode_pair("One day a little girl named Lily went to the park with her mom.", " She was happy.")
    assert len(ctx) + len(cont) - 1 > 12
    (logprob, _), = lm.loglikelihood([req("loglikelihood", ("One day a little girl named Lily went to the park "
                                                            "with her mom.", " She was happy."))], True)
    kept = ctx[-(13 - len(cont)):]
    assert logprob == pytest.approx(hf_loglikelihood(model, kept, cont)[0], abs=1e-4)
    assert lm.task_stats()["t"]["truncated"] == 1
    strict = SpeceeLM(dense, tok, max_length=12, on_overflow="error")
    with pytest.raises(SpeceeError, match="exceeds"):
        strict.loglikelihood([req("loglikelihood", ("One day a little girl named Lily went to the park "
                                                    "with her mom.", " She was happy."))], True)


def test_generate_until_honours_stop_strings_and_max_gen_toks(loaded):
    model, tok = loaded
    lm = SpeceeLM(DenseDecoder(LayerwiseLM(model)), tok)
    free, = lm.generate_until([req("generate_until", ("Once upon a time", {"max_gen_toks": 12}))], True)
    free_tokens = lm.records[("t", 0, 0)]["tokens"]
    assert free_tokens <= 12 and free
    assert free.strip()
    stop = free.strip()[len(free.strip()) // 2:][:3]  # a string the greedy output contains
    cut, = lm.generate_until([req("generate_until", ("Once upon a time", {"until": [stop], "max_gen_toks": 12}))],
                             True)
    assert cut == free[:free.index(stop)] and stop not in cut
    # ... and the generation itself ended when the stop string appeared, not at max_gen_toks.
    assert lm.records[("t", 0, 0)]["tokens"] < free_tokens
    with pytest.raises(SpeceeError, match="greedily"):
        lm.generate_until([req("generate_until", ("Hi", {"do_sample": True}))], True)


def test_tasks_load_offline_with_a_disjoint_fewshot_pool(tmp_path):
    from specee.evaluation.tasks.utils import FEWSHOT_POOL
    names = registry.available()
    assert names == sorted(["boolq", "piqa", "hellaswag", "arc_easy", "arc_challenge", "winogrande",
                            "copa", "sst2", "gsm8k", "sst2_gen", "boolq_gen", "sst2_gen_flex", "boolq_gen_flex",
                            "tinystories_ppl", "csqa_paper", "sst2_paper"])
    tm = registry.task_manager(names, DATA, tmp_path)
    assert sorted(tm.all_tasks) == names  # include_defaults=False: nothing but ours
    for name, task in tm.load(names)["tasks"].items():
        if name == "tinystories_ppl":  # no shots: one document per validation story
            stories = list(task.eval_docs)
            assert len(stories) == 500 and all("<|endoftext|>" not in d["text"] and d["text"] for d in stories)
            continue
        if name.endswith("_paper"):  # the authors' shots sit in the prompt: every item is evaluated
            rows = (DATA / task.config.dataset_kwargs["data_files"]["test"]).read_text().splitlines()
            assert len(list(task.eval_docs)) == len(rows)  # (num_fewshot > 0 is refused: check_fewshot)
            continue
        evaluated, pool = list(task.eval_docs), list(task.fewshot_docs())
        rows = (DATA / task.config.dataset_kwargs["data_files"]["test"]).read_text().splitlines()
        assert len(pool) == FEWSHOT_POOL and len(evaluated) == len(rows) - FEWSHOT_POOL
        key = lambda d: json.dumps(d, sort_keys=True)  # noqa: E731
        assert not {key(d) for d in pool} & {key(d) for d in evaluated}, name
        assert task.doc_to_text(evaluated[0]) is not None and task.doc_to_target(evaluated[0]) is not None


def test_unknown_task_and_empty_file_are_clear_errors(tmp_path):
    with pytest.raises(SpeceeError, match="valid: arc_challenge, arc_easy, boolq"):
        registry.check_names(["boolq", "nope"])
    (tmp_path / "copa").mkdir()
    (tmp_path / "copa" / "copa_validation.jsonl").write_text("\n")
    with pytest.raises(SpeceeError, match="empty"):
        registry.write_task_configs(["copa"], tmp_path, tmp_path / "tasks")
    res = run_cli("experiment=accuracy", "experiment.tasks=[copa,nope]", f"hydra.run.dir={tmp_path / 'r'}", *QUIET)
    assert res.returncode == 2 and "valid:" in res.stderr and "Traceback" not in res.stderr


def test_accuracy_run_end_to_end(micro, tmp_path):  # noqa: F811
    _, paths = micro
    args = ["experiment=accuracy", "ablation=dense", *paths, "experiment.tasks=[copa,gsm8k,sst2_gen,tinystories_ppl]",
            "experiment.limit=4", "experiment.max_gen_tokens=6", f"hydra.run.dir={tmp_path}", *QUIET]
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    acc = doc["metrics"]["accuracy"]
    assert acc["sst2_gen"]["primary_metric"] == "exact_match_first_word" and 0 <= acc["sst2_gen"]["accuracy"] <= 1
    ppl = acc["tinystories_ppl"]
    assert ppl["primary_metric"] == "bits_per_byte" and ppl["accuracy"] > 0 and ppl["word_perplexity"] > 1
    assert ppl["lower_is_better"] is True and acc["copa"]["lower_is_better"] is False
    for task in ("copa", "gsm8k"):
        m = acc[task]
        assert m["n"] == 4 and 0 <= m["accuracy"] <= 1 and m["accuracy_stderr"] is not None
        assert m["mean_layers"] == 4 and m["truncated"] == 0
        assert len((tmp_path / f"samples_{task}.jsonl").read_text().splitlines()) == 4
    assert acc["copa"]["acc"] == acc["copa"]["accuracy"] and acc["copa"]["requests"] == 8
    assert acc["gsm8k"]["primary_metric"] == "exact_match_final_number"
    for task in ("copa", "gsm8k", "sst2_gen"):  # per-item records: their mean is the task's accuracy
        items = doc["items"][task]
        assert len(items) == 4 and abs(sum(i["value"] for i in items.values()) / 4 - acc[task]["accuracy"]) < 1e-9
    assert all(i["value"] > 0 for i in doc["items"]["tinystories_ppl"].values())  # each story's bits per byte
    again = run_cli(*args)
    assert again.returncode == 0 and "skipping" in again.stdout


def test_specee_scoring_records_exit_layers(micro, tmp_path):  # noqa: F811
    _, paths = micro
    res = run_cli("experiment=accuracy", "ablation=specee_t1", *paths, "experiment.tasks=[copa]",
                  "experiment.limit=4", f"hydra.run.dir={tmp_path}", *QUIET)
    assert res.returncode == 0, res.stderr[-2000:]
    m = json.loads((tmp_path / "results.json").read_text())["metrics"]["accuracy"]["copa"]
    assert 1 <= m["mean_layers"] <= 4 and m["n"] == 4
    sample = json.loads((tmp_path / "samples_copa.jsonl").read_text().splitlines()[0])
    assert len(sample["specee"]) == 2  # one record per choice


def test_drift_check_passes_identical_and_fails_doctored_baseline(micro, tmp_path):  # noqa: F811
    _, paths = micro
    base = tmp_path / "baseline.json"
    common = ["experiment=accuracy", "ablation=dense", *paths, "experiment.tasks=[copa]", "experiment.limit=6",
              f"experiment.baseline={base}", *QUIET]
    res = run_cli(*common, "experiment.update_baseline=true", f"hydra.run.dir={tmp_path / 'u'}")
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "u" / "results.json").read_text())
    assert doc["repeat"]["copa"] == {"spread": 0.0, "identical_responses": True}  # CPU runs are deterministic
    entry = json.loads(base.read_text())["tasks"]["copa"]["dense"]
    assert entry["n"] == 6 and entry["tolerance"] > 0 and "binomial" in entry["justification"]
    from experiments.accuracy import item_records
    logged = {"copa": [json.loads(l) for l in (tmp_path / "u" / "samples_copa.jsonl").read_text().splitlines()]}
    rows, ok, gate = drift.check(base, "dense", doc["settings"], doc["metrics"]["accuracy"], item_records(logged),
                                 gate="auto", env=doc["env"])
    assert ok and rows[0]["status"] == "ok" and rows[0]["delta"] == 0
    assert gate["gate"] == "exact" and rows[0]["changed"] == []  # same machine: the per-item gate ran
    assert len(entry["items"]) == 6 and all({"answer", "loglik", "layers"} <= set(v) for v in entry["items"].values())
    doctored = json.loads(base.read_text())
    e = doctored["tasks"]["copa"]["dense"]
    e["accuracy"] += (1 if e["accuracy"] < 0.5 else -1) * (e["tolerance"] + 0.01)  # just beyond tolerance
    base.write_text(json.dumps(doctored))
    res = run_cli(*common, "experiment.check_baseline=true", "experiment.drift_gate=interval",
                  f"hydra.run.dir={tmp_path / 'c'}")
    assert res.returncode == 2 and "DRIFT" in res.stderr and "| copa | dense |" in res.stderr
    again = run_cli(*common, "experiment.check_baseline=true", f"hydra.run.dir={tmp_path / 'c'}")
    assert "skipping" in again.stdout and again.returncode == 2  # a finished run still reports drift
    with pytest.raises(SpeceeError, match="other settings"):
        drift.check(base, "dense", {**doc["settings"], "limit": 7}, doc["metrics"]["accuracy"])


@pytest.mark.slow
@pytest.mark.parametrize("change", ["early_exit.kv_policy=propagate"])
def test_exact_drift_gate_flags_a_small_behaviour_change(micro, tmp_path, change):  # noqa: F811
    """The per-item gate passes the unchanged mode and names the items a small change moved."""
    _, paths = micro
    base = tmp_path / "baseline.json"
    common = ["experiment=accuracy", "ablation=specee_t1", *paths, "experiment.tasks=[copa,piqa]",
              "experiment.limit=8", f"experiment.baseline={base}", *QUIET]
    assert run_cli(*common, "experiment.update_baseline=true", f"hydra.run.dir={tmp_path / 'u'}").returncode == 0
    same = run_cli(*common, "experiment.check_baseline=true", f"hydra.run.dir={tmp_path / 's'}")
    assert same.returncode == 0 and "drift gate: exact" in same.stdout, same.stderr[-2000:]
    moved = run_cli(*common, change, "experiment.check_baseline=true", f"hydra.run.dir={tmp_path / 'm'}")
    assert moved.returncode == 2 and "DRIFT" in moved.stderr and " item " in moved.stderr, moved.stderr[-2000:]
    assert "Traceback" not in moved.stderr
    # Across machines the interval gate is the right one, and it lets such a change through.
    loose = run_cli(*common, change, "experiment.check_baseline=true", "experiment.drift_gate=interval",
                    f"hydra.run.dir={tmp_path / 'l'}")
    assert "drift gate: interval" in loose.stdout + loose.stderr
    # One item's recorded answer changed in the baseline: the exact gate names that item.
    doctored = json.loads(base.read_text())
    first = sorted(doctored["tasks"]["copa"]["specee_t1"]["items"], key=int)[0]
    item = doctored["tasks"]["copa"]["specee_t1"]["items"][first]
    item["answer"] = 1 - item["answer"]
    base.write_text(json.dumps(doctored))
    res = run_cli(*common, "experiment.check_baseline=true", f"hydra.run.dir={tmp_path / 's'}")  # reuses 's'
    assert res.returncode == 2 and f"copa item {first} (answer)" in res.stderr, res.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(not TINY_BASELINE.is_file(), reason="no committed tiny accuracy baseline yet")
@pytest.mark.parametrize("ablation", ["dense", "specee_t1_t2", "adainfer"])
def test_tiny_accuracy_matches_committed_baseline(ablation, tmp_path):
    base = json.loads(TINY_BASELINE.read_text())
    if not any(ablation in modes for modes in base["tasks"].values()):
        pytest.skip(f"baseline has no {ablation} entries")
    s = base["settings"]
    tasks = sorted(t for t, modes in base["tasks"].items() if ablation in modes)
    res = run_cli("experiment=accuracy", "model=tiny", f"ablation={ablation}", f"experiment.tasks=[{','.join(tasks)}]",
                  f"experiment.limit={s['limit']}", f"experiment.num_fewshot={s['num_fewshot']}",
                  f"experiment.max_gen_tokens={s['max_gen_tokens']}", f"seed={s['seed']}",
                  "experiment.check_baseline=true", f"hydra.run.dir={tmp_path}", *QUIET, timeout=3600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]


@pytest.mark.slow
def test_chat_template_on_a_tokenizer_without_one_is_one_clear_error(micro, tmp_path):  # noqa: F811
    _, paths = micro
    res = run_cli("experiment=accuracy", "ablation=dense", *paths, "experiment.tasks=[boolq_gen_flex]",
                  "experiment.limit=2", "experiment.chat_template=true", f"hydra.run.dir={tmp_path}", *QUIET)
    assert res.returncode != 0 and "carries no chat template" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "results.json").exists()
