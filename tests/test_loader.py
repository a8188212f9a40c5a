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
