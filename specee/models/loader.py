"""Load a causal LM + tokenizer from a local directory (or, only if asked, from the hub), or build
one with random weights from a shipped architecture config (``model.init=random``)."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specee.errors import SpeceeError
from specee.io import project_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHAPES = Path(__file__).resolve().parent / "shapes"
# Random-weight models read prompts through tiny's tokenizer: its ids are a valid subset of any
# of the shipped vocabularies; generated ids beyond it decode to nothing (never shown to a reader).
RANDOM_INIT_TOKENIZER = "specee/artifacts/tiny"


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
        from specee.models.folders import missing_model_text
        raise SpeceeError(missing_model_text(model_cfg, path))
    if not (path / "config.json").is_file():
        raise SpeceeError(f"model.path={path} has no config.json; is it a Hugging Face checkpoint folder?")
    weights = list(path.glob("*.safetensors")) + list(path.glob("pytorch_model*.bin"))
    if not weights:
        raise SpeceeError(f"model.path={path} holds no *.safetensors or pytorch_model*.bin weights")
    return str(path)


def load_model(model_cfg):
    """Return (model, tokenizer) in eval mode, dtype and device from the config."""
    if model_cfg.init == "random":
        return random_model(model_cfg)
    if model_cfg.num_layers is not None:
        raise SpeceeError("model.num_layers cuts the layer count of a model.init=random shape only; "
                          "a pretrained checkpoint keeps all its layers")
    device = resolve_device(model_cfg.device)
    src = checkpoint_dir(model_cfg)
    dtype = DTYPES[model_cfg.dtype]
    local_only = not model_cfg.allow_hub
    # use_kernels=False: transformers (5.2x) otherwise swaps layers for hub kernels on CUDA, which
    # needs the `kernels` package and a download at load time, and would time other layers than
    # the ones the harness walks.
    kwargs = dict(dtype=dtype, local_files_only=local_only, trust_remote_code=model_cfg.trust_remote_code,
                  use_kernels=False)
    if device == "auto":
        kwargs["device_map"] = "auto"
    if Path(src).is_dir():  # a degenerate shape fails inside the build with a ZeroDivisionError
        check_config_shape(Path(src) / "config.json")
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(src, **kwargs)
    except Exception as err:  # noqa: BLE001 - safetensors, tokenizers and HF raise many types
        _refused_pickle(err, src)
        raise SpeceeError(f"could not load the checkpoint at model.path={src} ({type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}); is the folder complete and "
                          "uncorrupted?") from None
    if device != "auto":
        model = model.to(device)
    return model.eval(), _without_bom(tokenizer)


_MODEL_FIX = "fix the checkpoint's config.json (or copy the checkpoint folder again)"


def check_config_shape(path: Path) -> None:
    """Refuse a config.json whose shape cannot make a model, before anything is built."""
    from specee.artifact_checks import check_model_shape
    from specee.cards import read_json
    conf = read_json(path, _MODEL_FIX)
    if isinstance(conf, dict):
        check_model_shape(conf, path, _MODEL_FIX)


def _refused_pickle(err: Exception, src) -> None:
    """A pytorch_model*.bin that torch's weights-only unpickler refuses (transformers loads it with
    weights_only=True) is one line saying so; it is never retried unsafely."""
    import pickle
    from specee.artifact_checks import _first_reason
    chain, e = [], err
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(isinstance(e, pickle.UnpicklingError) or "Weights only load failed" in str(e) for e in chain):
        found = next(e for e in chain if isinstance(e, pickle.UnpicklingError) or "Weights only load failed" in str(e))
        raise SpeceeError(f"a weights file at model.path={src}: torch refused to unpickle it safely "
                          f"({_first_reason(found)}); it was not loaded, and is never loaded unsafely. Convert a "
                          "trusted copy to safetensors, or get the checkpoint from its source again") from None


def _without_bom(tokenizer):
    """A chat template saved with a UTF-8 byte-order mark (what several editors write) would put an
    invisible U+FEFF before every prompt; it is text, read as UTF-8 without the mark."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template.startswith("\ufeff"):
        tokenizer.chat_template = template.lstrip("\ufeff")
    return tokenizer


def load_tokenizer(model_cfg):
    """The model's tokenizer alone (prompt formatting before the weights load)."""
    if model_cfg.init == "random":
        return AutoTokenizer.from_pretrained(project_path(RANDOM_INIT_TOKENIZER))
    src = checkpoint_dir(model_cfg)
    try:
        return _without_bom(AutoTokenizer.from_pretrained(src, local_files_only=not model_cfg.allow_hub))
    except Exception as err:  # noqa: BLE001 - tokenizers and HF raise many types
        raise SpeceeError(f"could not load the tokenizer at model.path={src} ({type(err).__name__}); is the "
                          "folder complete and uncorrupted?") from None


def weights_fingerprint(model) -> str:
    """sha256 over the first 1024 values of every tensor of the state dict, each rounded through
    float16: what the draft head, predictors and AdaInfer SVM record as the base model they were
    trained for. The rounding makes a bf16-stored checkpoint hash the same loaded in float32,
    bfloat16 or float16 (float16 alters values below its normal range)."""
    import hashlib
    return hashlib.sha256(b"".join(v.detach().reshape(-1)[:1024].half().float().cpu().numpy().tobytes()
                                   for v in model.state_dict().values())).hexdigest()


def check_trained_for(card: dict, path, model, what: str) -> None:
    """Refuse an artifact whose recorded base-model fingerprint is not this model's."""
    want = card.get("base_weights_fingerprint")
    if want and want != weights_fingerprint(model):
        raise SpeceeError(f"the {what} at {path} was trained for another base model (weights fingerprint "
                          f"{want[:12]}…, this model {weights_fingerprint(model)[:12]}…); retrain it for this model")


def shape_file(model_cfg) -> Path:
    """Where ``model.init=random`` reads its architecture: model.path's config.json when that
    folder exists (a local checkpoint's shape, weights not read), else the shipped
    ``specee/models/shapes/<name>.json`` (model.path by name, no checkpoint there)."""
    shipped = SHAPES / f"{model_cfg.name}.json"
    if model_cfg.path and (project_path(model_cfg.path).exists() or not shipped.is_file()):
        return project_path(model_cfg.path) / "config.json"
    return shipped


def shape_config(model_cfg):
    """The architecture config of ``model=<name> model.init=random``: the config.json of
    model.path when given (a local checkpoint's shape, weights not read), else the shipped
    ``specee/models/shapes/<name>.json``; ``model.num_layers`` cuts the layer count."""
    from transformers import AutoConfig
    src = shape_file(model_cfg)
    if src.name == "config.json":
        if not src.is_file():
            raise SpeceeError(f"model.init=random with model.path={model_cfg.path}: no config.json there")
    else:
        if not src.is_file():
            raise SpeceeError(f"model.init=random: no shipped shape for model={model_cfg.name}; shapes: "
                              f"{', '.join(sorted(p.stem for p in SHAPES.glob('*.json')))} (or give model.path "
                              "of a folder with its config.json)")
    check_config_shape(src)
    values = {k: v for k, v in json.loads(src.read_text(encoding="utf-8-sig")).items() if not k.startswith("_")}
    config = AutoConfig.for_model(**values)
    if model_cfg.num_layers is not None:
        if not 1 <= model_cfg.num_layers <= config.num_hidden_layers:
            raise SpeceeError(f"model.num_layers={model_cfg.num_layers} must lie in 1..{config.num_hidden_layers}")
        config.num_hidden_layers = model_cfg.num_layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[: model_cfg.num_layers]
    return config


def parameter_bytes(config, dtype: torch.dtype) -> int:
    """Weights of a Llama-family decoder of this config, in bytes (embeddings + layers + head)."""
    d, f, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    attn = d * (config.num_attention_heads * head_dim) * 2 + 2 * d * kv
    per_layer = attn + 3 * d * f + 2 * d
    total = 2 * config.vocab_size * d + n * per_layer + d
    return total * torch.tensor([], dtype=dtype).element_size()


def _available_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def random_model(model_cfg):
    """A model of the configured shape with random weights, built directly on its device in its
    dtype (no CPU copy of 7B parameters), with tiny's tokenizer. Refused up front if it cannot fit."""
    device = resolve_device(model_cfg.device)
    if device == "auto":
        raise SpeceeError("model.init=random builds on one device; set model.device=cuda or cpu")
    config = shape_config(model_cfg)
    dtype = DTYPES[model_cfg.dtype]
    need = parameter_bytes(config, dtype)
    have = _available_bytes(device)
    if need > 0.9 * have:
        raise SpeceeError(f"model={model_cfg.name} model.init=random needs {need / 2**30:.1f} GiB for its weights "
                          f"({config.num_hidden_layers} layers, {model_cfg.dtype}); {device} has "
                          f"{have / 2**30:.1f} GiB available. Cut the layers (model.num_layers=N) or use a "
                          "larger device")
    torch.manual_seed(int(os.environ.get("SPECEE_RANDOM_INIT_SEED", "0")))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(project_path(RANDOM_INIT_TOKENIZER))
    return model.eval(), tokenizer
