import pytest
from omegaconf import OmegaConf

from conftest import random_lm
from specee.config import ModelConfig
from specee.errors import SpeceeError
from specee.models.loader import load_model


def cfg(path, **kw):
    return OmegaConf.structured(ModelConfig(name="x", path=str(path) if path else None, **kw))


def test_missing_path_value():
    with pytest.raises(SpeceeError, match="model.path"):
        load_model(cfg(None))


def test_path_that_does_not_exist(tmp_path):
    with pytest.raises(SpeceeError, match="model.path"):
        load_model(cfg(tmp_path / "absent"))


def test_folder_without_config(tmp_path):
    with pytest.raises(SpeceeError, match="config.json"):
        load_model(cfg(tmp_path))


def test_corrupt_weights(tmp_path):
    from transformers import AutoTokenizer  # noqa: F401
    model = random_lm("llama", layers=2)
    model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SpeceeError, match="model.path"):
        load_model(cfg(tmp_path))


def test_local_checkpoint_loads_through_the_same_path(tiny):
    from conftest import TINY
    model, tok = load_model(cfg(TINY))
    assert model.config.num_hidden_layers >= 24 and tok.eos_token_id is not None


def test_concurrent_holders_of_one_lock_take_turns(tmp_path):
    """Two processes fetching one model folder (two test workers) must not interleave their writes."""
    import subprocess
    import sys
    log, lock = tmp_path / "log", tmp_path / ".model.lock"
    code = ("import sys, time; from specee.io import exclusive_lock\n"
            f"with exclusive_lock({str(lock)!r}):\n"
            f"    open({str(log)!r}, 'a').write('start ' + sys.argv[1] + '\\n'); time.sleep(0.4)\n"
            f"    open({str(log)!r}, 'a').write('end ' + sys.argv[1] + '\\n')\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)]) for i in range(2)]
    assert all(p.wait(timeout=60) == 0 for p in procs)
    lines = log.read_text().split("\n")[:-1]
    assert len(lines) == 4 and all(a.split()[1] == b.split()[1] and a.startswith("start") and b.startswith("end")
                                   for a, b in (lines[:2], lines[2:])), lines


def test_a_checkpoint_loads_without_hub_kernels(tiny):
    """transformers 5.2x kernelizes by default, which on CUDA needs the `kernels` package and a
    download at load time (the GPU check's tiny steps failed on it): the harness turns it off."""
    from conftest import TINY
    model, _ = load_model(cfg(TINY))
    assert model.use_kernels is False
