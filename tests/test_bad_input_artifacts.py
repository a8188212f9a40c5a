"""The generated bad-input matrix for artifact folders: for every JSON and safetensors file that a
model, draft head, predictor bank, AdaInfer SVM, exit profile (and replay) or accuracy-baseline
folder holds (listed from the committed folders, so a file added later is covered), each fault
-- missing, truncated, empty, corrupt, wrong keys, wrong shapes, a foreign base model -- must end
in one SpeceeError naming the file (or its folder), raised before the model loads; only what needs
the loaded weights (the fingerprint, a checkpoint's own tensor shapes) may wait until the load.

The space is small (files x faults), so every case runs every time."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import ROOT
from specee.config import register
from specee.errors import SpeceeError, one_line
from specee.launch import check_config, compose_and_check, explain

FAST_TIER_SAMPLE = 6  # the fast tier runs one in 6 of this matrix's cases (tests/conftest.py)

ART = ROOT / "specee" / "artifacts"
register()

# kind: (committed folder, the overrides that make a run read a copy of it, the option choices)
FOLDERS = {
    "model": (ART / "tiny", lambda d: [f"model.path={d}"], ()),
    # with a reduced vocabulary, so the folder's frequency table is read too
    "draft": (ART / "tiny_draft", lambda d: [f"draft.path={d}", "draft.vocab_size=64"], ("ablation=eagle",)),
    "predictors": (ART / "tiny_predictors", lambda d: [f"early_exit.predictors_path={d}"], ("ablation=specee_t1",)),
    "svm": (ART / "tiny_adainfer", lambda d: [f"early_exit.adainfer_path={d}"], ("ablation=adainfer",)),
    "profile": (ART / "tiny_exit_profile", lambda d: [f"placement.profile_path={d}"], ("ablation=specee_t1_t2",)),
    "replay": (ART / "tiny_exit_profile", lambda d: [f"early_exit.replay={d}"], ("ablation=specee_t1",)),
    "baseline": (ROOT / "specee" / "evaluation" / "baselines",
                 lambda d: [f"experiment.baseline={d}/tiny.json", "experiment.check_baseline=true"],
                 ("experiment=accuracy",)),
}
# Files Hugging Face reads for itself and treats as optional or open-ended: their absence or
# unknown keys are legitimate (a checkpoint without a generation config, a card of notes), so
# for them only unreadable content must be refused.
OPEN_ENDED = {("model", "model_card.json"), ("model", "generation_config.json"),
              ("model", "tokenizer_config.json")}
# Faults only loading can reveal (the weights' fingerprint, a checkpoint's own tensor shapes, a
# tokenizer file's inner format, which the tokenizers library defines): refused at load time,
# still before any decoding. A foreign fingerprint beside an artifact that records the right one
# is refused earlier, by comparing the two cards.
# A folder holding files that different options read: a broken file is tested under the option
# that reads it (an SVM run never opens the CRF beside it, and must not refuse it).
OPTIONS_BY_FILE = {("svm", "adainfer_crf.json"): ("ablation=adainfer_crf",)}
AT_LOAD = {"fingerprint", "model/model.safetensors:shapes", "model/config.json:shapes",
           "model/tokenizer.json:wrong_keys"}


def _wrong_shape(kind: str, name: str, doc):
    """The same document with a value the loader sizes things by changed."""
    doc = copy.deepcopy(doc)
    if name == "config.json":
        doc["hidden_size"] += 8
    elif name == "draft_card.json":
        doc["hidden_size"] += 1
    elif name == "predictors_card.json":
        doc["num_layers"] += 1
    elif name == "adainfer_svm.json":
        doc["coef"] = doc["coef"] + [0.5]
    elif name == "adainfer_crf.json":
        doc["unary_b"] = doc["unary_b"] + [0.5]
    elif name == "exit_profile.json":
        doc["exit_counts"] = doc["exit_counts"][:-1]
    elif kind == "baseline":
        task = next(iter(doc["tasks"]))
        doc["tasks"][task] = {m: [e["accuracy"]] for m, e in doc["tasks"][task].items()}
    else:
        return None
    return doc


def faults(kind: str, path):
    """(fault, writer) pairs for one file; a writer puts the broken file at a path, or nothing."""
    raw = path.read_bytes()
    out = [("missing", None), ("truncated", raw[: len(raw) // 2]), ("empty", b"")]
    if path.suffix == ".json":
        doc = json.loads(raw)
        out.append(("corrupt", b"{ not json, " + raw[:40]))
        if isinstance(doc, dict):
            out.append(("wrong_keys", json.dumps({f"x_{k}": v for k, v in doc.items()}).encode()))
            shaped = _wrong_shape(kind, path.name, doc)
            if shaped is not None:
                out.append(("shapes", json.dumps(shaped).encode()))
            if "base_weights_fingerprint" in doc:
                out.append(("fingerprint", json.dumps({**doc, "base_weights_fingerprint": "0" * 64}).encode()))
            if kind == "baseline":
                out.append(("fingerprint", json.dumps({**doc, "model": "llama2_7b"}).encode()))
    else:  # safetensors
        out.append(("corrupt", b"\x00garbage" * 100))
        out.append(("shapes", "reshape"))
    return out


def all_cases():
    cases = []
    for kind, (folder, _, _) in FOLDERS.items():
        for f in sorted(folder.iterdir()):
            if f.suffix in (".json", ".safetensors"):
                for fault, _ in faults(kind, f):
                    cases.append((kind, f.name, fault))
    return cases


ALL = all_cases()
CASES = ALL  # small enough to run whole: every file, every fault


def _write_case(tmp_path, kind, name, fault):
    """A copy of the folder (links to the committed files) with one file broken."""
    folder = FOLDERS[kind][0]
    case = tmp_path / kind
    case.mkdir()
    for f in folder.iterdir():
        if f.name != name:
            (case / f.name).symlink_to(f)
    writer = dict(faults(kind, folder / name))[fault]
    if writer == "reshape":
        from safetensors.torch import load_file, save_file
        state = load_file(str(folder / name))
        first = sorted(state)[0]
        state[first] = state[first].reshape(-1)[:-1].clone()  # one value fewer, flattened
        save_file(state, str(case / name), metadata={"format": "pt"})
    elif writer is not None:
        (case / name).write_bytes(writer)
    return case


_BASES: dict = {}


def _config(options, overrides):
    """run.py's composition: the options by Hydra's compose, the key overrides by the step compose
    applies them with; then the project's checks (which read every file the run will)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    if options not in _BASES:
        _BASES[options] = compose_and_check(list(options))
    cfg = copy.deepcopy(_BASES[options])
    try:
        ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides(overrides), cfg)
    except Exception as err:  # noqa: BLE001
        raise SpeceeError(explain(err, overrides)) from None
    check_config(cfg)
    return cfg


def _load_and_build(cfg, tiny):
    from specee.builders import build_decoder
    from specee.models.loader import load_model
    from specee.runtime.layerwise import LayerwiseLM
    model = tiny[0] if cfg.model.path == "specee/artifacts/tiny" else load_model(cfg.model)[0]
    build_decoder(cfg, LayerwiseLM(model))


def test_the_matrix_covers_every_folder_file_and_fault():
    for kind, (folder, _, _) in FOLDERS.items():
        files = {f.name for f in folder.iterdir() if f.suffix in (".json", ".safetensors")}
        assert files and files == {n for k, n, _ in ALL if k == kind}
    assert {f for *_, f in ALL} == {"missing", "truncated", "empty", "corrupt", "wrong_keys", "shapes",
                                    "fingerprint"}


@pytest.mark.parametrize("kind,name,fault", CASES, ids=[f"{k}/{n}:{f}" for k, n, f in CASES])
def test_broken_artifact_is_one_clear_error(tiny, tmp_path, kind, name, fault):
    torch.set_num_threads(1)
    folder, overrides, options = FOLDERS[kind]
    options = OPTIONS_BY_FILE.get((kind, name), options)
    case = _write_case(tmp_path, kind, name, fault)
    stage, err = "config", None
    try:
        cfg = _config(options, overrides(case))
        stage = "load"
        _load_and_build(cfg, tiny)
        stage = "accepted"
    except SpeceeError as e:
        err = e
    if (kind, name) in OPEN_ENDED and fault in ("missing", "wrong_keys", "shapes"):
        assert err is None or len(str(err).splitlines()) == 1
        return
    assert err is not None, f"{kind}/{name} {fault}: accepted"
    msg = str(err)
    assert len(msg.splitlines()) == 1 and msg == one_line(msg), msg
    assert name in msg or str(case) in msg, msg
    late = (fault == "fingerprint" and kind != "baseline") or f"{kind}/{name}:{fault}" in AT_LOAD
    assert stage in (("config", "load") if late else ("config",)), (stage, msg)
