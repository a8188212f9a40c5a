"""The generic checking engine: every field of every schema against its declared range, allowed
values and text rule, in one walk (so a field added later is checked without a new rule), and
the discovery of each group's options. Allowed values that a module owns are read from it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from specee.config.schemas import (SCHEMAS, AblationConfig, AccuracyExperiment, CalibrationConfig, Config,
                                    FrontierExperiment,
                                   DatasetConfig, DraftVocabExperiment, EarlyExitConfig, ModelConfig,
                                   PlacementConfig, PotentialExperiment, ReproduceExperiment, RuntimeConfig,
                                   SpeedExperiment, StatsExperiment, TrainBaseExperiment, TrainDraftExperiment,
                                   TrainPredictorsExperiment)
from specee.errors import SpeceeError

# Ranges and choices are declared here, per schema; an int defaults to [0, INT_MAX], a float to a
# finite [0, FLOAT_MAX], a str to non-empty one-line text.
INT_MAX = 2**31 - 1  # beyond it torch/numpy sizes and seeds overflow
FLOAT_MAX = 1e6


@dataclass(frozen=True)
class Options:
    """A list field whose items are option names of a config group (e.g. ablations to sweep)."""
    group: str


_DTYPES = ("float32", "bfloat16", "float16")
LIMITS: dict[type, dict[str, tuple]] = {
    ModelConfig: {"num_layers": (1, INT_MAX)},
    EarlyExitConfig: {"k": (1, INT_MAX), "threshold": (0.0, 1.0), "operating_budget": (0.0, 1.0)},
    PlacementConfig: {"m": (1, INT_MAX), "coverage": (0.0, 1.0), "n_history": (1, INT_MAX)},
    RuntimeConfig: {"max_block": (1, INT_MAX)},
    AblationConfig: {"tree_max_nodes": (1, 63), "tree_calibration_prompts": (1, 200), "ngram_size": (1, 16),
                     "lookup_calibration_prompts": (1, 200), "exit_value": (-1.0, 1.0)},
    DatasetConfig: {"max_new_tokens": (1, INT_MAX), "turns": (1, INT_MAX)},
    SpeedExperiment: {"repeats": (1, INT_MAX), "cost_rounds": (0, 10_000)},
    TrainBaseExperiment: {**{k: (1, INT_MAX) for k in (
        "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "batch_size", "steps",
        "eval_stories", "final_eval_stories", "log_every")},  # eval_every=0: no evaluation during training
        "vocab_size": (2, INT_MAX), "seq_len": (2, INT_MAX), "lr": (0.0, 1.0), "min_lr_ratio": (0.0, 1.0),
        "weight_decay": (0.0, 1.0), "tinystories_share": (0.0, 1.0)},
    TrainDraftExperiment: {**{k: (1, INT_MAX) for k in ("max_tokens", "extract_batch", "steps", "batch_size", "k")},
                           "seq_len": (2, INT_MAX), "eval_share": (0.0, 1.0), "lr": (0.0, 1.0)},
    CalibrationConfig: {"max_new_tokens": (1, INT_MAX)},
    TrainPredictorsExperiment: {**{k: (1, INT_MAX) for k in ("hidden", "epochs", "batch_size", "svm_max_samples")},
                                "lr": (0.0, 1.0), "held_out_share": (0.0, 1.0), "target_precision": (0.0, 1.0),
                                "threshold_min_fires": (1, INT_MAX)},
    StatsExperiment: {"max_n": (1, INT_MAX)},
    PotentialExperiment: {"rounds": (3, 10_000)},
    DraftVocabExperiment: {"held_out_share": (0.0, 0.5)},
    ReproduceExperiment: {k: (1, INT_MAX) for k in ("count", "max_new_tokens", "accuracy_limit",
                                                               "perplexity_limit", "stats_count")},
    AccuracyExperiment: {k: (1, INT_MAX) for k in ("limit", "max_gen_tokens", "max_length")},
    FrontierExperiment: {"delta": (0.0, 1.0), "epsilon": (0.0, 1.0), "measured_points": (0, 100),
                         "timed_prompts": (2, INT_MAX), "count": (1, INT_MAX), "max_new_tokens": (1, INT_MAX), "task_limit": (2, INT_MAX), "document_limit": (2, INT_MAX), "cost_rounds": (3, 10_000),
                         "real_only_grid": (0.0, 1.0), "threshold_grid": (0.0, 1.0), "precision_grid": (0.0, 1.0),
                         "p_stop_grid": (0.0, 1.0), "oracle_budgets": (0.0, 1.0), "extra_deltas": (0.0, 1.0),
                         "calibration_share": (0.0, 1.0), "fit_share": (0.0, 1.0), "max_gen_tokens": (1, INT_MAX)},
    Config: {"threads": (1, INT_MAX)},
}


def owned(module: str, name: str):
    """Allowed values a module owns (``module.name``), read when a value is checked: the module is
    the one place they are written."""
    def read() -> tuple:
        return tuple(getattr(importlib.import_module(module), name))
    read.__name__ = f"{module}.{name}"
    return read


def _modes() -> tuple:
    from specee.decoding import modes
    return modes.names()


@dataclass(frozen=True)
class Pattern:
    """A str field whose values follow a pattern (e.g. cuda:N)."""
    regex: str
    text: str


CHOICES: dict[type, dict[str, Any]] = {
    ModelConfig: {"dtype": _DTYPES, "init": ("pretrained", "random"), "chat_template": owned("specee.prompts", "TEMPLATES"),
                  "device": Pattern(r"cpu|cuda|cuda:\d+|auto", "cpu, cuda, cuda:N, auto")},
    DatasetConfig: {"source": owned("specee.data", "SOURCES")},
    EarlyExitConfig: {"kv_policy": owned("specee.early_exit.kv_policy", "POLICIES"),
                      "delta_from": owned("specee.early_exit.features", "DELTA_FROM"),
                      "calibration": ("global", "per_layer")},
    AblationConfig: {"tree_select": ("fixed", "auto"),
                     "mode": _modes, "decoding": ("autoregressive", "tree"),
                     "speculation": ("draft", "prompt_lookup"),
                     "classifier": owned("specee.decoding.adainfer", "CLASSIFIERS"),
                     "mapping": owned("specee.decoding.tree", "MAPPINGS"),
                     "tree_exit_rule": owned("specee.decoding.tree", "EXIT_RULES"),
                     "role": owned("specee.ablations", "ROLES"), "bank": owned("specee.ablations", "BANKS")},
    RuntimeConfig: {"kind": ("eager", "compiled"), "exit_control": ("host", "lookahead", "device"),
                    "compile_mode": ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")},
    TrainBaseExperiment: {"save_dtype": _DTYPES, "autocast_dtype": ("bfloat16", "float16")},
    TrainDraftExperiment: {"targets": ("dataset", "self")},
    SpeedExperiment: {"interleave": ("step", "request")},
    TrainPredictorsExperiment: {"pos_weight": ("none", "balanced"), "label": ("final", "verified", "unnormed"),
                                "recipe": ("harness", "paper")},
    StatsExperiment: {"placements": Options("placement")},
    ReproduceExperiment: {"ablations": Options("ablation"), "kv_policy_variants": Options("ablation"),
                          "stats_placements": Options("placement"),
                          "hf_generate_ablations": Options("ablation"),
                          "mapping_variants": Options("ablation"), "runtime_variants": Options("ablation"),
                          "accuracy_ablations": Options("ablation"), "dataset": Options("dataset")},
    FrontierExperiment: {"policies": Options("ablation"), "real_only": Options("ablation"),
                         "kv_policies": owned("specee.early_exit.kv_policy", "POLICIES"),
                         "lossless_peers": Options("ablation"), "task_source": ("shipped", "lm_eval")},
    AccuracyExperiment: {"on_overflow": ("truncate", "error"), "drift_gate": ("auto", "exact", "interval"),
                         "task_source": ("shipped", "lm_eval")},
}


def options(group: str) -> list[str]:
    """The selectable options of a config group: its YAML files and any stored config that is not
    a ``*_schema`` entry (a schema is what options start from, not an option)."""
    from specee.io import PROJECT_ROOT
    names = {p.stem for p in (PROJECT_ROOT / "conf" / group).glob("*.yaml")}
    repo = ConfigStore.instance().repo.get(group, {})
    names |= {n[:-5] for n in repo if n.endswith(".yaml")}
    return sorted(n for n in names if (group, n) not in SCHEMAS)


def option_schema(group: str, option: str) -> type | None:
    """The schema an option of ``group`` starts from (its defaults list), else the type the root
    Config declares for the group (options in the global package, e.g. ablation=specee_t1)."""
    import yaml
    from specee.io import PROJECT_ROOT
    if (group, option) in SCHEMAS:
        return SCHEMAS[group, option]
    path = PROJECT_ROOT / "conf" / group / f"{option}.yaml"
    if path.is_file():
        for entry in (yaml.safe_load(path.read_text()) or {}).get("defaults") or []:
            if isinstance(entry, str) and (group, entry) in SCHEMAS:
                return SCHEMAS[group, entry]
    declared = Config.__dataclass_fields__.get(group)
    return declared.type if declared is not None and isinstance(declared.type, type) else None


def check_choices(choices) -> None:
    """Refuse a ``*_schema`` entry selected as an option (``model=model_schema``): it composes to
    a config whose mandatory values are missing; the user meant one of the options."""
    for group, choice in dict(choices).items():
        if (group, choice) in SCHEMAS:
            raise SpeceeError(f"{group}={choice} is the schema the {group} options start from, not an "
                              f"option; valid: {', '.join(options(group))}")


def schema_of(node, declared) -> type | None:
    import dataclasses
    t = OmegaConf.get_type(node) if OmegaConf.is_config(node) else None
    if t is not None and dataclasses.is_dataclass(t):
        return t
    return declared if isinstance(declared, type) and dataclasses.is_dataclass(declared) else None


def _fields(cls) -> dict:
    import dataclasses
    import typing
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def check_declared_keys(cfg, cls: type = None, prefix: str = "") -> None:
    """Struct mode however a key got in: a key the schema does not declare (added with ``+key=`` or
    ``++key=``, which Hydra's struct flag lets through) or a declared key removed (``~key``) is
    one error naming the key and the keys that exist there."""
    cls = cls or Config
    fields = _fields(cls)
    where = prefix.rstrip(".") or "the top level"
    for key in cfg.keys():
        if key not in fields:
            raise SpeceeError(f"{prefix}{key} is not a setting of {where} ({cls.__name__}); valid keys: "
                              f"{', '.join(fields)} (check the spelling; `+` adds only keys a schema declares)")
    for name, hint in fields.items():
        if name not in cfg:
            raise SpeceeError(f"{prefix}{name} was removed; every setting of {where} must stay "
                              "(set it to null where that is allowed)")
        node = cfg._get_node(name)
        if OmegaConf.is_dict(node) and not node._is_missing() and not node._is_none():
            sub = schema_of(node, hint)
            if sub is not None:
                check_declared_keys(node, sub, f"{prefix}{name}.")


def _type_args(hint):
    import typing
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union and type(None) in args:
        return _type_args(next(a for a in args if a is not type(None)))[0], True
    return hint, False


def _bad_text(value: str) -> bool:
    return not value.strip() or any(ord(c) < 32 for c in value)


def _check_value(key: str, value, hint, limits, choices) -> None:
    import math
    import typing
    base, _ = _type_args(hint)
    if value is None:
        return  # a None where the schema forbids it fails at compose time (not Optional)
    if isinstance(choices, Options):
        allowed = options(choices.group)
        items = value if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else [value]
        bad = [v for v in items if v not in allowed]
        if bad:
            raise SpeceeError(f"{key} has {bad[0]!r}, not an option of {choices.group}; valid: {', '.join(allowed)}")
        return
    if isinstance(choices, Pattern):
        import re
        if not isinstance(value, str) or not re.fullmatch(choices.regex, value):
            raise SpeceeError(f"{key}={value!r} is unknown; valid: {choices.text}")
        return
    if callable(choices):
        choices = choices()
    if choices is not None:
        if isinstance(value, (list, tuple)) or OmegaConf.is_list(value):  # each item one of the choices
            bad = [v for v in value if v not in choices]
            if bad or not len(value):
                raise SpeceeError(f"{key} has {bad[0]!r}, which is unknown; valid: {', '.join(choices)}" if bad else
                                  f"{key} is empty; name at least one of: {', '.join(choices)}")
        elif value not in choices:
            raise SpeceeError(f"{key}={value!r} is unknown; valid: {', '.join(choices)}")
        return
    if base is bool:
        return
    if base is int:
        lo, hi = limits or (0, INT_MAX)
        if not lo <= value <= hi:
            raise SpeceeError(f"{key}={value} must lie in [{lo}, {hi}]" if value > hi else f"{key}={value} must be >= {lo}")
    elif base is float:
        lo, hi = limits or (0.0, FLOAT_MAX)
        if not (math.isfinite(value) and lo <= value <= hi):
            raise SpeceeError(f"{key}={value} must lie in [{lo:g}, {hi:g}]")
    elif base is str:
        if _bad_text(value):
            raise SpeceeError(f"{key}={value!r} must be non-empty one-line text"
                              + (" (null for none)" if _type_args(hint)[1] else ""))
    elif typing.get_origin(base) is list:
        kind = (typing.get_args(base) or (Any,))[0]
        for i, item in enumerate(value):
            # a merged override can slip a nested list past OmegaConf's element type (key=[[a]])
            if kind in (str, int, float, bool) and not isinstance(item, kind):
                raise SpeceeError(f"{key}[{i}]={item!r} is not a {kind.__name__}; give a flat list, e.g. {key}=[a,b]")
            if isinstance(item, str) and _bad_text(item):
                raise SpeceeError(f"{key}[{i}]={item!r} must be non-empty one-line text")


def check_fields(cfg, cls: type = None, prefix: str = "") -> None:
    """Every field of every schema against its declared (or default) range, choices and text rule."""
    from omegaconf.errors import OmegaConfBaseException
    cls = cls or Config
    for name, hint in _fields(cls).items():
        key = f"{prefix}{name}"
        node = cfg._get_node(name)
        if OmegaConf.is_dict(node) and not node._is_none():
            sub = schema_of(node, hint)
            if sub is not None:
                check_fields(node, sub, key + ".")
            continue
        try:
            value = cfg[name]
        except OmegaConfBaseException as err:  # an interpolation that does not resolve
            raise SpeceeError(f"{key}: {str(err).splitlines()[0]}") from None
        if name == "_target_":
            continue  # fixed by the option (_check_target)
        if OmegaConf.is_list(value):
            value = OmegaConf.to_container(value)
        try:
            _check_value(key, value, hint, LIMITS.get(cls, {}).get(name), CHOICES.get(cls, {}).get(name))
        except SpeceeError as err:
            if not OmegaConf.is_interpolation(cfg, name):
                raise
            # a value taken from another setting (e.g. ${paths.artifacts}): name where it was set
            raise SpeceeError(f"{err} ({key} is {node._value()}: fix it there)") from None
