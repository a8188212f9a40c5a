import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from conftest import ROOT, run_cli
from specee.config import register

register()


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_default_config_composes_and_instantiates():
    cfg = _compose()
    obj = OmegaConf.to_object(cfg)
    assert obj.model.name == "tiny" and obj.ablation.mode == "dense"


@pytest.mark.parametrize("name", ["tiny", "llama2_7b", "llama2_13b", "llama2_70b", "vicuna_7b"])
def test_every_model_option_composes(name):
    assert _compose(f"model={name}").model.name == name


def test_unknown_option_lists_the_valid_choices():
    with pytest.raises(ConfigCompositionException) as err:
        _compose("model=llama9")
    msg = str(err.value)
    assert "model" in msg and "llama2_7b" in msg and "tiny" in msg


def test_unknown_key_fails_at_compose_time():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as err:
        _compose("model.flavour=x")
    assert "flavour" in str(err.value)


def test_wrong_type_fails_at_compose_time():
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose("dataset.count=many")


def test_cli_missing_checkpoint_names_model_path(tmp_path):
    res = run_cli("model=llama2_7b", "model.device=cpu", "model.dtype=float32", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 2
    assert "model.path" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "results.json").exists()


def test_cli_missing_data_root_is_one_clear_error(tmp_path):
    res = run_cli(f"paths.data_root={tmp_path / 'nope'}", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 2
    assert "paths.data_root" in res.stderr and "Traceback" not in res.stderr


def test_cli_gpu_device_without_gpu_fails_clearly(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    res = run_cli("model.device=cuda", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 2 and "no CUDA GPU" in res.stderr and "Traceback" not in res.stderr
