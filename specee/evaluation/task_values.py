"""The values of a user's task YAML, typed before lm-eval reads them.

lm-eval builds a task from its YAML with ``TaskConfig(**yaml)``, a dataclass that checks neither
types nor ranges: ``num_fewshot: five`` or ``metric_list: 3`` end in a TypeError deep inside
``ConfigurableTask``. The types here are lm-eval's own where it declares them (``TaskConfig``'s
annotations, its ``output_type`` literals, its metric, aggregation and filter registries); what it
does not declare (ranges, the shapes of ``metric_list``, ``filter_list`` and ``generation_kwargs``,
the kinds its ``doc_to_*`` readers accept, splits of a local data file) is written here, once. Each
bad value is one SpeceeError naming the file, the key and what was expected.
"""
from __future__ import annotations

import functools
import math
import types
import typing
from pathlib import Path

from specee.errors import SpeceeError


class Function(str):
    """A ``!function module.name`` value of a task YAML: a callable lm-eval imports."""


# The kinds each doc_to_* reader of lm-eval's ConfigurableTask accepts (TaskConfig's annotations
# are narrower than the readers: an int picks a choice, a list is the targets themselves).
_DOC_TO = {"doc_to_text": (str, int, Function), "doc_to_target": (str, int, list, Function),
           "doc_to_choice": (str, list, dict, Function), "doc_to_image": (str, list, Function),
           "doc_to_audio": (str, list, Function)}
# Keys whose shape is checked by hand (lm-eval's annotation says only "int" or "list").
_OWN_SHAPE = ("num_fewshot", "repeats", "metric_list", "generation_kwargs", "filter_list")
_GEN_KWARGS = {"until": "a string or a list of strings", "max_gen_toks": "an integer >= 1",
               "do_sample": "true or false", "temperature": "a number >= 0"}


@functools.cache
def _hints() -> dict:
    """TaskConfig's field -> type, as lm-eval declares it."""
    from collections.abc import Callable

    from lm_eval.api.instance import OutputType
    from lm_eval.config.task import TaskConfig
    return typing.get_type_hints(TaskConfig, localns={"Callable": Callable, "OutputType": OutputType})


def output_types() -> tuple[str, ...]:
    from lm_eval.api.task import ALL_OUTPUT_TYPES
    return tuple(ALL_OUTPUT_TYPES)


@functools.cache
def _registry(which: str) -> frozenset:
    import lm_eval.api.metrics  # noqa: F401 - fills the metric and aggregation registries
    import lm_eval.filters  # noqa: F401 - fills the filter registry
    from lm_eval.api import registry
    return frozenset({"metric": registry.METRIC_REGISTRY, "aggregation": registry.AGGREGATION_REGISTRY,
                      "filter": registry.FILTER_REGISTRY}[which])


def _is(value, kind) -> bool:
    """``value`` is of the (typing) ``kind``; a bool is no number, a ``!function`` is a callable."""
    origin = typing.get_origin(kind)
    if kind is typing.Any:
        return True
    if kind is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_is(value, k) for k in typing.get_args(kind))
    if origin is typing.Literal:
        return value in typing.get_args(kind)
    if kind is typing.Callable or origin is not None and getattr(origin, "__name__", "") == "Callable" \
            or getattr(kind, "__name__", "") == "Callable":
        return isinstance(value, Function)
    if origin is not None:
        kind = origin
    if not isinstance(kind, type):
        return True
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    if kind.__name__ == "FewshotConfig":  # a YAML writes it as a mapping
        return isinstance(value, dict)
    return isinstance(value, kind)


def _kind_text(kind) -> str:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        parts = [_kind_text(k) for k in typing.get_args(kind)]
        return " or ".join(dict.fromkeys(p for p in parts if p))
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(kind)))
    if kind is type(None):
        return "null"
    name = getattr(origin or kind, "__name__", str(kind))
    return {"str": "a string", "int": "an integer", "bool": "true or false", "dict": "a mapping",
            "list": "a list", "Callable": "a !function", "Function": "a !function",
            "FewshotConfig": ""}.get(name, name)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


class _Bad(Exception):
    """(key, what was expected) of the first bad value."""


def _expect(ok: bool, key: str, value, expected: str) -> None:
    if not ok:
        raise _Bad(key, f"{key} is {_shown(value)}; expected {expected}")


def check_values(cfg: dict, own_code: bool = False) -> None:
    """The first bad value of one YAML's own keys, as _Bad(key, text). ``own_code``: Python modules
    lie beside the YAML, and may register metrics and filters lm-eval does not ship (their names
    are then not checked against lm-eval's registries)."""
    hints = _hints()
    for key, value in cfg.items():
        key = str(key)
        if key in _OWN_SHAPE:
            continue  # checked below, with the shape lm-eval reads
        if key in _DOC_TO:
            kinds = _DOC_TO[key]
            _expect(value is None or (isinstance(value, kinds) and not isinstance(value, bool)), key, value,
                    " or ".join(_kind_text(k) for k in kinds) + " (or null)")
        elif key == "output_type":
            _expect(value in output_types(), key, value, "one of lm-eval's output types: " + ", ".join(output_types()))
        elif key in hints:
            _expect(_is(value, hints[key]), key, value, _kind_text(hints[key]))
    if "num_fewshot" in cfg:
        _expect(cfg["num_fewshot"] is None or _whole(cfg["num_fewshot"], 0), "num_fewshot", cfg["num_fewshot"],
                "a whole number >= 0 (or null: none)")
    if "repeats" in cfg:
        _expect(_whole(cfg["repeats"], 1), "repeats", cfg["repeats"], "a whole number >= 1")
    if cfg.get("metric_list") is not None:  # null: the output type's default metrics
        _metric_list(cfg["metric_list"], free_names=own_code or "process_results" in cfg)
    if cfg.get("generation_kwargs") is not None:
        _generation_kwargs(cfg["generation_kwargs"])
    if cfg.get("filter_list") is not None:
        _filter_list(cfg["filter_list"], free_names=own_code)
    if isinstance(cfg.get("dataset_kwargs"), dict) and "data_files" in cfg["dataset_kwargs"]:
        files = cfg["dataset_kwargs"]["data_files"]
        _expect(_data_files(files), "dataset_kwargs.data_files", files,
                "a path, a list of paths, or a mapping of split name -> path(s)")
    if isinstance(cfg.get("fewshot_config"), dict):
        for key in ("doc_to_text", "doc_to_target", "doc_to_choice"):
            if key in cfg["fewshot_config"]:
                value, kinds = cfg["fewshot_config"][key], _DOC_TO[key]
                _expect(value is None or (isinstance(value, kinds) and not isinstance(value, bool)),
                        f"fewshot_config.{key}", value, " or ".join(_kind_text(k) for k in kinds))
    if isinstance(cfg.get("metadata"), dict) and "chance" in cfg["metadata"]:
        c = cfg["metadata"]["chance"]
        _expect(c is None or (_is(c, float) and math.isfinite(c) and 0 <= c <= 1), "metadata.chance", c,
                "a number in [0, 1] (the accuracy of guessing)")


def _data_files(files) -> bool:
    if isinstance(files, str):
        return bool(files)
    if isinstance(files, list):
        return bool(files) and all(isinstance(f, str) and f for f in files)
    if isinstance(files, dict):
        return bool(files) and all(isinstance(k, str) and _data_files(v) for k, v in files.items())
    return False


def _metric_list(value, free_names: bool) -> None:
    _expect(isinstance(value, list) and value, "metric_list", value,
            "a non-empty list of mappings, each with a `metric` (e.g. - metric: acc)")
    known = _registry("metric")
    for i, m in enumerate(value):
        where = f"metric_list[{i}]"
        _expect(isinstance(m, dict) and "metric" in m, where, m, "a mapping with a `metric` (e.g. metric: acc)")
        name = m["metric"]
        _expect(isinstance(name, str) and name, f"{where}.metric", name, "a metric name or a !function")
        if not (free_names or isinstance(name, Function) or m.get("hf_evaluate") is True):
            _expect(name in known, f"{where}.metric", name,
                    "one of lm-eval's metrics (" + ", ".join(sorted(known)) + "), a !function, or "
                    "hf_evaluate: true for a Hugging Face evaluate metric")
        if "aggregation" in m:
            agg = m["aggregation"]
            _expect(isinstance(agg, Function) or agg in _registry("aggregation") or free_names and isinstance(agg, str),
                    f"{where}.aggregation", agg,
                    "one of lm-eval's aggregations (" + ", ".join(sorted(_registry("aggregation"))) + ") or a !function")
        if "higher_is_better" in m:
            _expect(isinstance(m["higher_is_better"], bool), f"{where}.higher_is_better", m["higher_is_better"],
                    "true or false")


def _generation_kwargs(value) -> None:
    _expect(isinstance(value, dict), "generation_kwargs", value, "a mapping (e.g. {until: [\"\\n\"], max_gen_toks: 32})")
    checks = {"until": lambda v: isinstance(v, str) or isinstance(v, list) and all(isinstance(s, str) for s in v),
              "max_gen_toks": lambda v: _whole(v, 1),
              "do_sample": lambda v: isinstance(v, bool),
              "temperature": lambda v: _is(v, float) and math.isfinite(v) and v >= 0}
    for key, ok in checks.items():
        if key in value:
            _expect(ok(value[key]), f"generation_kwargs.{key}", value[key], _GEN_KWARGS[key])


def _filter_list(value, free_names: bool) -> None:
    shape = "a list of mappings, each with a `name` and a `filter` list of {function: ...} steps"
    _expect(isinstance(value, list) and value, "filter_list", value, shape)
    known = _registry("filter")
    for i, f in enumerate(value):
        where = f"filter_list[{i}]"
        _expect(isinstance(f, dict) and "name" in f and "filter" in f, where, f, "a mapping with `name` and `filter`")
        _expect(isinstance(f["name"], str) and f["name"], f"{where}.name", f["name"], "a string")
        steps = f["filter"]
        _expect(isinstance(steps, list) and steps, f"{where}.filter", steps, "a non-empty list of {function: ...} steps")
        for j, step in enumerate(steps):
            _expect(isinstance(step, dict) and "function" in step, f"{where}.filter[{j}]", step,
                    "a mapping with a `function`")
            fn = step["function"]
            _expect(isinstance(fn, Function) or fn in known or free_names and isinstance(fn, str) and fn,
                    f"{where}.filter[{j}].function", fn,
                    "one of lm-eval's filters (" + ", ".join(sorted(known)) + ") or a !function")


# Split keys of a task and the local-file loaders whose splits are the data_files' keys.
_SPLITS = ("training_split", "validation_split", "test_split", "fewshot_split")
_LOCAL_LOADERS = ("json", "jsonl", "csv", "text", "parquet", "arrow")


def check_merged(cfg: dict) -> tuple[str, str] | None:
    """Rules over a task's merged YAML (its includes first): the splits it names exist in its local
    data files, a multiple-choice task has its choices, a task has a split to evaluate. Returns
    (key, text) of the first broken one."""
    try:
        files = (cfg.get("dataset_kwargs") or {}).get("data_files")
        if cfg.get("dataset_path") in _LOCAL_LOADERS and files is not None and _data_files(files):
            have = sorted(files) if isinstance(files, dict) else ["train"]  # datasets names a bare file's split train
            for key in _SPLITS:
                split = cfg.get(key)
                if split is not None:
                    _expect(split in have, key, split, f"a split of its data files: {', '.join(have)}")
            if all(cfg.get(k) is None for k in ("test_split", "validation_split")):
                raise _Bad("test_split", "neither test_split nor validation_split is set; name the split to "
                                         f"evaluate, one of {', '.join(have)}")
        if cfg.get("output_type") == "multiple_choice" and cfg.get("doc_to_choice") is None:
            raise _Bad("doc_to_choice", "a multiple_choice task needs doc_to_choice (a field, a template, a list "
                                        "or a !function giving its choices)")
    except _Bad as bad:
        return bad.args
    return None


def refuse(yml: Path, key: str, text: str, task: str | None) -> SpeceeError:
    named = f" (task {task})" if task else ""
    return SpeceeError(f"task YAML {yml}{named}: {text}; fix that key")


def check_file(yml: Path, cfg: dict) -> None:
    """One YAML's own values; SpeceeError naming ``yml`` and the key on the first bad one."""
    try:
        check_values(cfg, own_code=any(yml.parent.glob("*.py")))
    except _Bad as bad:
        raise refuse(yml, bad.args[0], bad.args[1], cfg.get("task") if isinstance(cfg.get("task"), str) else None) \
            from None
