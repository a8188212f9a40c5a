"""Load a causal LM + tokenizer from a local directory (or, only if asked, from the hub)."""
from __future__ import annotations

import importlib.util

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specee.errors import SpeceeError
from specee.io import project_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> str:
    if device.startswith("cuda") or device == "auto":
        if not torch.cuda.is_available():
            raise SpeceeError(
                f"model.device={device} but no CUDA GPU is visible to torch; "
                "run on a GPU machine or set model.device=cpu (and model.dtype=float32)")
        if device == "auto" and importlib.util.find_spec("accelerate") is None:
            raise SpeceeError("model.device=auto (device_map='auto') needs accelerate: pip install accelerate")
    elif device != "cpu":
        raise SpeceeError(f"model.device={device!r} is unknown; valid: cpu, cuda, cuda:N, auto")
    return device


def checkpoint_dir(model_cfg) -> str:
    """Validate model.path before any work; return what from_pretrained should receive."""
    if not model_cfg.path:
        raise SpeceeError(
            f"model={model_cfg.name} needs model.path=/local/dir/with/checkpoint "
            "(config.json + weights + tokenizer); nothing is downloaded unless model.allow_hub=true")
    path = project_path(model_cfg.path)
    if not path.is_dir():
        if model_cfg.allow_hub:
            return str(model_cfg.path)  # a hub id, by explicit opt-in
        raise SpeceeError(f"model.path={model_cfg.path} is not a directory ({path} does not exist); "
                          "point model.path at a local Hugging Face checkpoint")
    if not (path / "config.json").is_file():
        raise SpeceeError(f"model.path={path} has no config.json; is it a Hugging Face checkpoint folder?")
    weights = list(path.glob("*.safetensors")) + list(path.glob("pytorch_model*.bin"))
    if not weights:
        raise SpeceeError(f"model.path={path} holds no *.safetensors or pytorch_model*.bin weights")
    return str(path)


def load_model(model_cfg):
    """Return (model, tokenizer) in eval mode, dtype and device from the config."""
    device = resolve_device(model_cfg.device)
    src = checkpoint_dir(model_cfg)
    dtype = DTYPES[model_cfg.dtype]
    local_only = not model_cfg.allow_hub
    kwargs = dict(dtype=dtype, local_files_only=local_only, trust_remote_code=model_cfg.trust_remote_code)
    if device == "auto":
        kwargs["device_map"] = "auto"
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(src, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise SpeceeError(f"could not load the checkpoint at model.path={src}: {err}. "
                          "Is the folder complete and uncorrupted?") from err
    if device != "auto":
        model = model.to(device)
    return model.eval(), tokenizer
