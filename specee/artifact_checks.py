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
    problems += _ranges(conf, whole("vocab_size"))
    if problems:
        raise SpeceeError(f"{path} describes a model that cannot be built: {'; '.join(problems)}; {fix}")
    typed_by_transformers(conf, path, fix)  # after the shape: a config class divides by the heads


def typed_by_transformers(conf: dict, path: str | Path, fix: str) -> None:
    """The types of a config.json's fields, checked by transformers' own config class (a strict
    dataclass: ``num_hidden_layers: "32"`` or ``tie_word_embeddings: "yes"`` is refused there) without
    building the model. A model_type transformers does not know (remote code) is left to the load."""
    model_type = conf.get("model_type")
    if not isinstance(model_type, str):
        return
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if model_type not in CONFIG_MAPPING:
        return
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older hub library: no strict configs, the ranges below still apply
        StrictDataclassError = ()  # noqa: N806
    values = {k: v for k, v in conf.items() if not str(k).startswith("_")}
    try:
        AutoConfig.for_model(**values)
    except StrictDataclassError as err:
        why = " ".join(str(err.__cause__ or err).split()).split(". Errors:")[0]
        raise SpeceeError(f"{path}: {why[:300]}; {fix}") from None
    except (TypeError, ValueError, KeyError, ArithmeticError, AttributeError) as err:  # transformers' own checks
        raise SpeceeError(f"{path}: transformers refuses this config ({' '.join(str(err).split())[:200]}); "
                          f"{fix}") from None


def _ranges(conf: dict, vocab: int | None) -> list[str]:
    """Ranges transformers' config classes do not check, of the fields the runtime reads."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    out = []
    for key in ("max_position_embeddings", "intermediate_size", "head_dim", "sliding_window"):
        v = conf.get(key)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            out.append(f"{key}={v!r} (must be a whole number >= 1)")
    for key in ("rms_norm_eps", "layer_norm_eps"):
        v = conf.get(key)
        if v is not None and not (number(v) and v > 0):
            out.append(f"{key}={v!r} (must be a number > 0)")
    for key in ("attention_dropout", "hidden_dropout"):
        v = conf.get(key)
        if v is not None and not (number(v) and 0 <= v <= 1):
            out.append(f"{key}={v!r} (must be a number in [0, 1])")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = conf.get(key)
        ids = v if isinstance(v, list) else [v] if v is not None else []
        bad = [i for i in ids if not (isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                      and (vocab is None or i < vocab))]
        if bad:
            out.append(f"{key}={v!r} (token ids must be whole numbers in 0..{vocab - 1 if vocab else 'vocab_size-1'})")
    return out


def _whole_at_least(v, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _probability(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v <= 1


# The kinds of a card's values: (what it must be, test; layer tests take the model's layer count).
CARD_KINDS = {
    "count": ("a whole number >= 0", lambda v, n: _whole_at_least(v, 0)),
    "positive": ("a whole number >= 1", lambda v, n: _whole_at_least(v, 1)),
    "probability": ("a number in [0, 1]", lambda v, n: _probability(v)),
    "text": ("a string", lambda v, n: isinstance(v, str)),
    "ids": ("a list of prompt ids (strings or whole numbers)",
            lambda v, n: isinstance(v, list) and all(isinstance(i, str) or _whole_at_least(i, 0) for i in v)),
    "layers": ("a list of layer indices inside the model (0..layers-1)",
               lambda v, n: isinstance(v, list) and all(_whole_at_least(i, 0) and (n is None or i < n) for i in v)),
    "layer_rows": ("a list of per-layer records, each with a `layer` inside the model (0..layers-1) and a "
                   "`threshold` (when given) in [0, 1]",
                   lambda v, n: isinstance(v, list) and all(
                       isinstance(r, dict) and _whole_at_least(r.get("layer"), 0) and (n is None or r["layer"] < n)
                       and ("threshold" not in r or r["threshold"] is None or _probability(r["threshold"]))
                       for r in v)),
}


def check_card_values(card: dict, path: str | Path, what: str, fields: dict[str, str], fix: str,
                      num_layers: int | None = None) -> None:
    """The values of a card's optional fields, each of its kind in CARD_KINDS (layer indices inside
    a model of ``num_layers`` layers, when known): a card edited by hand or written by another tool
    is refused naming the file and the key, before anything reads it."""
    for key, kind in fields.items():
        if key not in card:
            continue
        expected, ok = CARD_KINDS[kind]
        if not ok(card[key], num_layers):
            shown = repr(card[key]) if len(repr(card[key])) <= 40 else repr(card[key])[:37] + "..."
            layers = f" (the model has {num_layers} layers)" if num_layers is not None and "layer" in kind else ""
            raise SpeceeError(f"{path} is not a {what}: {key!r} holds {shown}; expected {expected}{layers}; {fix}")
