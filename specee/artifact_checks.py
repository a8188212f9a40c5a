"""What an artifact must hold, checked where it loads: finite weights and values, a checkpoint that
torch unpickles safely (never retried unsafely), and a model shape that can be built. Each failure
is one SpeceeError naming the file and the fix; anything else is a bug and keeps its traceback."""
from __future__ import annotations

import math
from pathlib import Path

from specee.errors import SpeceeError


def check_finite(tensors: dict, path: str | Path, fix: str) -> None:
    """Refuse a state dict holding NaN or infinite values: a predictor with NaN weights never
    fires and a draft head with them proposes garbage, so the run would report a result that is
    silently wrong instead of failing."""
    import torch
    bad = []
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
            n = int((~torch.isfinite(value)).sum())
            if n:
                bad.append(f"{name} ({n} of {value.numel()})")
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise SpeceeError(f"{path} holds non-finite (NaN or infinite) weights in {shown}; {fix}")


def check_finite_numbers(values, path: str | Path, what: str, fix: str) -> None:
    """The same for a list of numbers read from a JSON card (json reads NaN and Infinity)."""
    bad = [i for i, v in enumerate(values) if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise SpeceeError(f"{path}: {what} holds non-finite values (NaN or infinite) at {bad[:4]}; {fix}")


def safe_torch_load(path: str | Path, fix: str) -> dict:
    """A pickled checkpoint (pytorch_model.bin) read by torch's weights-only unpickler. A file it
    refuses (a pickle that calls code, or objects beyond plain tensors) is refused here in one line;
    it is never loaded again with weights_only=False, since that would run whatever it carries."""
    import pickle
    import warnings
    import zipfile

    import torch
    path = Path(path)
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols before it refuses
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        why = _first_reason(err)
        raise SpeceeError(f"{path}: torch refused to unpickle it safely ({why}); it was not loaded, and is "
                          "never loaded unsafely. Convert a trusted copy to safetensors, or get the "
                          f"checkpoint from its source again; {fix}") from None
    except (EOFError, RuntimeError, zipfile.BadZipFile, OSError, ValueError) as err:
        raise SpeceeError(f"{path} is corrupt (not a readable torch checkpoint: {type(err).__name__}: "
                          f"{_first_reason(err)}); {fix}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SpeceeError(f"{path} is not a state dict of tensors (it holds a {type(state).__name__}); {fix}")
    return state


def _first_reason(err) -> str:
    """torch's refusal is a page of advice; its first sentence names what the pickle asked for."""
    advice = ("Weights only load failed", "Check the documentation", "Please file an issue", "In PyTorch")
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    reasons = [ln for ln in lines if not ln.startswith(advice)]
    return ((reasons or lines or [type(err).__name__])[0]).rstrip(".")[:200]


def check_model_shape(conf: dict, path: str | Path, fix: str) -> None:
    """A Hugging Face config whose shape cannot make a model (0 layers, 0 heads, a hidden size the
    heads do not divide, an empty vocabulary) is refused before the model is built: the build would
    otherwise end in a ZeroDivisionError or an empty model that "runs"."""
    def whole(key):
        v = conf.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    problems = []
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads"):
        v = whole(key)
        if key in conf and (v is None or v < 1):
            problems.append(f"{key}={conf.get(key)!r} (must be a whole number >= 1)")
    heads, hidden, kv = whole("num_attention_heads"), whole("hidden_size"), whole("num_key_value_heads")
    if heads and heads >= 1 and hidden and hidden >= 1 and not whole("head_dim") and hidden % heads:
        problems.append(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}")
    if "num_key_value_heads" in conf and conf["num_key_value_heads"] is not None:
        if kv is None or kv < 1:
            problems.append(f"num_key_value_heads={conf['num_key_value_heads']!r} (must be a whole number >= 1)")
        elif heads and heads >= 1 and heads % kv:
            problems.append(f"num_attention_heads={heads} is not divisible by num_key_value_heads={kv}")
    if problems:
        raise SpeceeError(f"{path} describes a model that cannot be built: {'; '.join(problems)}; {fix}")
