"""The generated bad-input matrix for faults a user causes or suffers, by class: storage (where results
go), non-finite artifacts, unpicklable or hostile checkpoints, degenerate model shapes, task-file
fields and text encodings. Each case is generated from its class's variants x the places the harness
meets it, so the next case of a class is covered without being named. Each must end in one
SpeceeError line naming the file or folder (or, for a byte-order mark, be read as the same text);
anything else stays a traceback and fails the test.

The fast tier runs one in SAMPLE of the cases (picked by a hash of the id, as tests/conftest.py picks
the other matrices); the slow tier (pytest --full) runs them all."""
from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from specee.errors import SpeceeError, one_line

ART = ROOT / "specee" / "artifacts"
SAMPLE = 3
MARK = "specee_payload_ran"  # a hostile pickle's payload would create this file


def _matrix(cases: list[tuple], name) -> list:
    """pytest params: every case, all but one in SAMPLE marked slow (stable across runs)."""
    out = []
    for case in cases:
        cid = name(case)
        slow = zlib.crc32(cid.encode()) % SAMPLE != 0
        out.append(pytest.param(*case, id=cid, marks=[pytest.mark.slow] if slow else []))
    return out


def _one_line(err: SpeceeError, *named: str) -> str:
    msg = str(err)
    assert msg == one_line(msg) and len(msg.splitlines()) == 1, msg
    for n in named:
        assert n in msg, (n, msg)
    return msg


# -- storage -------------------------------------------------------------------------------------
STORAGE = [(where, fault) for where in ("hydra.run.dir", "hydra.sweep.dir")
           for fault in ("parent_is_file", "ancestor_is_file", "no_room", "ENOSPC", "EROFS", "EACCES", "EDQUOT")]


@pytest.mark.parametrize("where,fault", _matrix(STORAGE, lambda c: f"{c[0]}:{c[1]}"))
def test_storage(tmp_path, monkeypatch, where, fault):
    from specee import io
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    target = tmp_path / "runs" / "job"
    if fault == "parent_is_file":
        target = blocker / "job"
    elif fault == "ancestor_is_file":
        target = blocker / "deeper" / "job"
    elif fault == "no_room":
        monkeypatch.setattr(io.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1 << 20))
    else:
        code = getattr(errno, fault)

        def refuse(fd, data):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(io.os, "write", refuse)
    argv = (["-m"] if where == "hydra.sweep.dir" else []) + [f"{where}={target}"]
    with pytest.raises(SpeceeError) as err:
        io.check_output_of_command(argv)
    msg = _one_line(err.value, where, str(target))
    assert "choose another" in msg
    assert not target.exists() and not list(tmp_path.rglob(".specee-write-probe*"))


def test_storage_check_passes_a_good_folder_and_leaves_nothing(tmp_path):
    from specee import io
    io.check_output_of_command([f"hydra.run.dir={tmp_path / 'a' / 'b'}"])
    io.check_output_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("code", ["ENOSPC", "EROFS", "EDQUOT"])
def test_a_final_write_that_fails_prints_the_metrics_and_says_so(tmp_path, monkeypatch, capfd, code):
    """The disk filled during the job: one line, and the metrics reach the terminal."""
    from specee import io
    n = getattr(errno, code)

    def full(fd):
        raise OSError(n, os.strerror(n))
    monkeypatch.setattr(io.os, "fsync", full)
    doc = {"specee_results": 1, "metrics": {"tokens_per_s": 123.456, "exit_rate": 0.25}}
    with pytest.raises(SpeceeError) as err:
        io.write_json_atomic(tmp_path / "results.json", doc)
    _one_line(err.value, str(tmp_path / "results.json"), "free space")
    out = capfd.readouterr().out
    assert "123.456" in out and "exit_rate" in out
    assert not (tmp_path / "results.json").exists() and not list(tmp_path.glob(".*.tmp"))


def test_a_write_that_fails_for_another_reason_keeps_its_traceback(tmp_path, monkeypatch):
    from specee import io

    def bug(fd):
        raise OSError(errno.EBADF, "Bad file descriptor")
    monkeypatch.setattr(io.os, "fsync", bug)
    with pytest.raises(OSError):
        io.write_json_atomic(tmp_path / "x.json", {"metrics": {}})


def test_run_log_stops_quietly_when_its_disk_fills(tmp_path, capfd):
    from specee.io import RunLog
    log = RunLog(tmp_path / "run.log")

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")
        flush = close = lambda self: None
    log._f = Full()
    log.write("line\n")
    log.write("more\n")
    log.flush()
    assert capfd.readouterr().err.count("run.log stopped") == 1


# -- non-finite artifacts ------------------------------------------------------------------------
def _nan_predictors(case: Path, key: str, value: float):
    from safetensors.torch import load_file, save_file
    state = load_file(str(case / "predictors.safetensors"))
    state[key].view(-1)[0] = value
    save_file(state, str(case / "predictors.safetensors"))
    return lambda: __import__("specee.early_exit.predictor", fromlist=["x"]).PredictorBank.load(case, 32, 4, 0.5)


def _nan_draft(case: Path, key: str, value: float):
    from safetensors.torch import load_file, save_file
    state = load_file(str(case / "draft.safetensors"))
    state[key].view(-1)[-1] = value
    save_file(state, str(case / "draft.safetensors"), metadata={"format": "pt"})

    def load():
        from specee.models.draft import load_draft
        from specee.runtime.layerwise import LayerwiseLM
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(ART / "tiny", dtype=torch.float32)
        load_draft(case, LayerwiseLM(model))
    return load


def _nan_json(file: str, edit):
    def make(case: Path, key, value):
        doc = json.loads((case / file).read_text())
        edit(doc, key, value)
        (case / file).write_text(json.dumps(doc))  # json writes NaN / Infinity, and reads them back
        return {"adainfer_svm.json": lambda: __import__("specee.decoding.adainfer", fromlist=["x"]).AdaInferSVM.load(case),
                "exit_profile.json": lambda: _profile_and_replay(case)}[file]
    return make


def _profile_and_replay(case):
    from specee.early_exit.replayed_exits import load_replay
    from specee.early_exit.schedule import load_profile
    with pytest.raises(SpeceeError):
        load_replay(str(case), 32)
    load_profile(case, 32)


def _set_index(doc, key, value):
    name, i = key
    doc[name][i] = value


def _set_key(doc, key, value):
    doc[key] = value


NON_FINITE_KINDS = {
    "predictors": (ART / "tiny_predictors", _nan_predictors, ["w1", "b1", "w2", "b2"], "predictors.safetensors"),
    "draft": (ART / "tiny_draft", _nan_draft, ["fc.weight", "fc.bias", "layer.mlp.down_proj.weight"], "draft.safetensors"),
    "adainfer": (ART / "tiny_adainfer", _nan_json("adainfer_svm.json", lambda d, k, v: _set_index(d, k, v)
                                                  if isinstance(k, tuple) else _set_key(d, k, v)),
                 [("coef", 0), ("coef", 1), "intercept"], "adainfer_svm.json"),
    "profile_and_replay": (ART / "tiny_exit_profile", _nan_json("exit_profile.json", _set_index),
                           [("exit_counts", 0), ("exit_counts", 31)], "exit_profile.json"),
}
NON_FINITE = [(kind, key, value) for kind, (_, _, keys, _) in NON_FINITE_KINDS.items() for key in keys
              for value in ("nan", "inf", "-inf")]


@pytest.mark.parametrize("kind,key,value", _matrix(NON_FINITE, lambda c: f"{c[0]}:{c[1]}:{c[2]}"))
def test_non_finite_artifact_is_refused_at_load(tmp_path, kind, key, value):
    folder, make, _, file = NON_FINITE_KINDS[kind]
    case = tmp_path / kind
    shutil.copytree(folder, case)
    load = make(case, key, float(value))
    with pytest.raises(SpeceeError) as err:
        load()
    msg = _one_line(err.value, file)
    assert any(w in msg for w in ("non-finite", "finite", "non-negative integers")), msg


def test_a_whole_artifact_still_loads(tmp_path):
    """The checks refuse only the broken: the committed artifacts load."""
    from specee.decoding.adainfer import AdaInferSVM
    from specee.early_exit.predictor import PredictorBank
    PredictorBank.load(ART / "tiny_predictors", 32, 4, 0.5)
    AdaInferSVM.load(ART / "tiny_adainfer")


# -- unpicklable or hostile checkpoints ----------------------------------------------------------
class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _EvalPayload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w').close()",))


def _hostile(kind: str, path: Path, marker: Path):
    if kind == "os_system_in_zip":
        torch.save({"fc.weight": torch.zeros(2, 2), "x": _Payload(marker)}, path)
    elif kind == "eval_in_zip":
        torch.save({"fc.weight": _EvalPayload(marker)}, path)
    elif kind == "legacy_pickle":
        with open(path, "wb") as f:
            pickle.dump({"fc.weight": _Payload(marker)}, f)
    elif kind == "not_a_checkpoint":
        path.write_bytes(b"\x80\x04garbage" * 50)
    elif kind == "empty":
        path.write_bytes(b"")


def _draft_folder(tmp_path):
    folder = tmp_path / "eagle"
    folder.mkdir(parents=True)
    return folder, folder / "pytorch_model.bin"


def _model_folder(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(ART / "tiny", folder)  # makes tmp_path too
    for f in folder.glob("*.safetensors"):
        f.unlink()
    return folder, folder / "pytorch_model.bin"


def _load_draft(folder):
    from transformers import AutoModelForCausalLM
    from specee.models.draft import load_draft
    from specee.runtime.layerwise import LayerwiseLM
    load_draft(folder, LayerwiseLM(AutoModelForCausalLM.from_pretrained(ART / "tiny", dtype=torch.float32)))


def _load_model(folder):
    from omegaconf import OmegaConf
    from specee.models.loader import load_model
    load_model(OmegaConf.create({"name": "own", "path": str(folder), "init": "pretrained", "num_layers": None,
                                 "device": "cpu", "dtype": "float32", "allow_hub": False,
                                 "trust_remote_code": False}))


HOSTILE_PLACES = {"draft": (_draft_folder, _load_draft), "model": (_model_folder, _load_model)}
HOSTILE = [(place, kind) for place in HOSTILE_PLACES
           for kind in ("os_system_in_zip", "eval_in_zip", "legacy_pickle", "not_a_checkpoint", "empty")]


@pytest.mark.parametrize("place,kind", _matrix(HOSTILE, lambda c: f"{c[0]}:{c[1]}"))
def test_hostile_or_unpicklable_checkpoint(tmp_path, place, kind):
    make_folder, load = HOSTILE_PLACES[place]
    folder, file = make_folder(tmp_path)
    marker = tmp_path / MARK
    _hostile(kind, file, marker)
    with pytest.raises(SpeceeError) as err:
        load(folder)
    msg = _one_line(err.value, str(folder))
    if kind in ("os_system_in_zip", "eval_in_zip", "legacy_pickle"):
        assert "refused to unpickle it safely" in msg and "never loaded unsafely" in msg, msg
    assert not marker.exists()  # the payload never ran


def test_a_hostile_payload_runs_on_no_load_path(tmp_path):
    """Every loader the harness has for a file a user brings, given a pickle with a payload: the
    model folder, the draft head (EAGLE and specee formats), the predictor bank, the AdaInfer card,
    the features cache. None may run it."""
    import numpy as np
    marker = tmp_path / MARK
    for place, (make_folder, load) in HOSTILE_PLACES.items():
        folder, file = make_folder(tmp_path / place)
        _hostile("os_system_in_zip", file, marker)
        with pytest.raises(SpeceeError):
            load(folder)
    pred = tmp_path / "pred"
    shutil.copytree(ART / "tiny_predictors", pred)
    _hostile("os_system_in_zip", pred / "predictors.safetensors", marker)
    from specee.early_exit.predictor import PredictorBank
    with pytest.raises(SpeceeError):
        PredictorBank.load(pred, 32, 4, 0.5)
    draft = tmp_path / "specee_draft"
    shutil.copytree(ART / "tiny_draft", draft)
    _hostile("os_system_in_zip", draft / "draft.safetensors", marker)
    with pytest.raises(SpeceeError):
        _load_draft(draft)
    cache = tmp_path / "features.npz"
    np.savez(cache, key=np.array([_Payload(marker)], dtype=object))
    with np.load(cache, allow_pickle=False) as z, pytest.raises(ValueError):
        z["key"]  # how experiments/train_predictors.py reads its features cache
    assert not marker.exists()


# -- degenerate shapes ---------------------------------------------------------------------------
SHAPE_FAULTS = {
    "zero_layers": {"num_hidden_layers": 0},
    "negative_layers": {"num_hidden_layers": -2},
    "zero_heads": {"num_attention_heads": 0},
    "hidden_not_divisible": {"hidden_size": 190, "head_dim": None},
    "zero_hidden": {"hidden_size": 0},
    "zero_vocab": {"vocab_size": 0},
    "zero_kv_heads": {"num_key_value_heads": 0},
    "kv_not_dividing_heads": {"num_key_value_heads": 5},
    "layers_not_a_number": {"num_hidden_layers": 3.5},
}
SHAPE_PLACES = ("pretrained", "random_init")
SHAPES = [(place, fault) for place in SHAPE_PLACES for fault in SHAPE_FAULTS]


@pytest.mark.parametrize("place,fault", _matrix(SHAPES, lambda c: f"{c[0]}:{c[1]}"))
def test_degenerate_model_shape_is_refused_before_the_build(tmp_path, monkeypatch, place, fault):
    from omegaconf import OmegaConf
    from specee.preflight import model_shape
    folder = tmp_path / "model"
    shutil.copytree(ART / "tiny", folder)
    conf = json.loads((folder / "config.json").read_text())
    for k, v in SHAPE_FAULTS[fault].items():
        if v is None:
            conf.pop(k, None)
        else:
            conf[k] = v
    (folder / "config.json").write_text(json.dumps(conf))
    import transformers

    def no_build(*a, **k):
        raise AssertionError("the model was built")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_build)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", no_build)
    cfg = OmegaConf.create({"name": "own", "path": str(folder), "init": place.split("_")[0], "num_layers": None,
                            "device": "cpu", "dtype": "float32", "allow_hub": False, "trust_remote_code": False})
    with pytest.raises(SpeceeError) as err:
        model_shape(cfg)
    # a value that is not a whole number is refused by the config reader, in its own words
    _one_line(err.value, "config.json", "cannot be built" if fault != "layers_not_a_number" else "num_hidden_layers")
    from specee.models.loader import load_model
    with pytest.raises(SpeceeError) as err:  # the loader refuses it too, whoever calls it
        load_model(cfg)
    _one_line(err.value, "config.json", "cannot be built")


def test_the_shipped_shapes_pass_the_shape_check():
    from specee.artifact_checks import check_model_shape
    for f in [ART / "tiny" / "config.json", *sorted((ROOT / "specee" / "models" / "shapes").glob("*.json"))]:
        check_model_shape(json.loads(f.read_text()), f, "")


# -- task-file fields ----------------------------------------------------------------------------
GOOD_TASK = ("task: own\noutput_type: generate_until\ndataset_path: json\n"
             "dataset_kwargs:\n  data_files: {{test: {data}}}\ntest_split: test\n"
             "doc_to_text: \"{{{{q}}}}\"\ndoc_to_target: \"{{{{a}}}}\"\n")
TASK_FAULTS = {
    "unknown_field": ("colour: blue\n", "colour"),
    "misspelled_field": ("doc_to_txt: \"{{q}}\"\n", "doc_to_txt"),
    "anchor_holder": ("defaults: &d\n  num_fewshot: 0\n", "defaults"),
    "anchor_merged": ("shared: &s {until_x: 1}\n<<: *s\n", "shared"),
    "field_in_included_file": (None, "colour"),
}
TASKS = [(fault,) for fault in TASK_FAULTS]


@pytest.mark.parametrize("fault", _matrix(TASKS, lambda c: c[0]))
def test_task_yaml_with_an_unknown_field_names_it_and_the_file(tmp_path, fault):
    from specee.evaluation.registry import check_user_tasks
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tmp_path / "own.jsonl"
    data.write_text(json.dumps({"q": "1+1=", "a": "2"}) + "\n")
    extra, named = TASK_FAULTS[fault]
    good = GOOD_TASK.format(data=data)
    if extra is None:
        (tasks / "_base.yaml").write_text("colour: blue\noutput_type: generate_until\n")
        (tasks / "own.yaml").write_text("include: _base.yaml\n" + good)
        where = "_base.yaml"
    else:
        (tasks / "own.yaml").write_text(good + extra)
        where = "own.yaml"
    with pytest.raises(SpeceeError) as err:
        check_user_tasks(["own"], tasks)
    _one_line(err.value, repr(named), where)


def test_a_task_yaml_of_known_fields_passes(tmp_path):
    from specee.evaluation.registry import check_user_tasks
    data = tmp_path / "own.jsonl"
    data.write_text(json.dumps({"q": "1+1=", "a": "2"}) + "\n")
    (tmp_path / "own.yaml").write_text(GOOD_TASK.format(data=data) + "metadata: {version: 1}\n")
    check_user_tasks(["own"], tmp_path)


# -- text encodings ------------------------------------------------------------------------------
BOM = b"\xef\xbb\xbf"


def _prompts(path):
    from specee.data import iter_jsonl
    return [row for _, row in iter_jsonl(path)]


def _card(path):
    from specee.cards import read_json
    return read_json(path, "fix")


def _task_yaml(path):
    """A task YAML with a BOM is still checked (an unknown field in it is still found)."""
    from specee.evaluation.registry import check_user_tasks
    with pytest.raises(SpeceeError, match="colour"):
        check_user_tasks(["own"], path.parent)
    return path.read_bytes()[len(BOM):] if path.read_bytes().startswith(BOM) else path.read_bytes()


def _instructions(path):
    import specee.data as data
    root = path.parent.parent
    return data.instruction_pairs(root, ["alpaca_gpt4_demo"])[0]


ENCODING_PLACES = {
    "prompt_jsonl": ("prompts.jsonl", b'{"prompt": "caf\xc3\xa9 time"}\n{"prompt": "two"}\n', _prompts),
    "task_data_jsonl": ("own.jsonl", b'{"q": "1+1=", "a": "2"}\n', _prompts),
    "artifact_card": ("card.json", b'{"k": 4, "name": "caf\xc3\xa9"}', _card),
    "task_yaml": ("own.yaml", b"task: own\ncolour: blue\n", _task_yaml),
    "instruction_json": ("alpaca_gpt4_demo/alpaca_en_demo.json",
                         b'[{"instruction": "Say hi", "input": "", "output": "hi"}]', _instructions),
}
ENCODINGS = [(place, variant) for place in ENCODING_PLACES for variant in ("bom", "bom_crlf")]


@pytest.mark.parametrize("place,variant", _matrix(ENCODINGS, lambda c: f"{c[0]}:{c[1]}"))
def test_utf8_with_a_byte_order_mark_reads_as_the_same_text(tmp_path, place, variant):
    name, good, read = ENCODING_PLACES[place]
    plain, marked = tmp_path / "plain" / name, tmp_path / "marked" / name
    plain.parent.mkdir(parents=True)
    marked.parent.mkdir(parents=True)
    body = good.replace(b"\n", b"\r\n") if variant == "bom_crlf" else good
    plain.write_bytes(body)
    marked.write_bytes(BOM + body)
    assert read(marked) == read(plain)
