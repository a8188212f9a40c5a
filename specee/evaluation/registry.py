"""The tasks shipped in ``tasks/*.yaml``, the user's own task YAMLs, and lm-eval's registry.

A repo YAML names its data file relative to ``paths.data_root``; lm-eval needs absolute
paths, so each run writes a one-line-per-key wrapper (``include:`` the repo YAML, then
absolute ``data_files``) into a folder that lm-eval's ``TaskManager`` scans. By default
(``experiment.task_source=shipped``) only those and the user's ``experiment.include_path``
YAMLs are visible; ``task_source=lm_eval`` adds lm-eval's own registry (its tasks download
their datasets unless the HF cache already holds them).
"""
from __future__ import annotations

from pathlib import Path

import yaml

from specee.errors import SpeceeError
from specee.evaluation import task_values

TASKS_DIR = Path(__file__).resolve().parent / "tasks"


def available() -> list[str]:
    return sorted(p.stem for p in TASKS_DIR.glob("*.yaml") if not p.name.startswith("_"))


def check_names(names) -> list[str]:
    names = list(names)
    unknown = [n for n in names if n not in available()]
    if unknown or not names:
        raise SpeceeError(f"experiment.tasks has unknown task(s) {unknown or '[] (empty)'}; "
                          f"valid: {', '.join(available())}")
    return names


def _repo_config(name: str) -> dict:
    from lm_eval.tasks._yaml_loader import load_yaml
    return load_yaml(TASKS_DIR / f"{name}.yaml", resolve_func=False)


def data_files(name: str, data_root: Path) -> dict[str, Path]:
    """Absolute data file per split; a missing or empty file is one clear error."""
    files = {split: data_root / rel for split, rel in _repo_config(name)["dataset_kwargs"]["data_files"].items()}
    for path in set(files.values()):
        if not path.is_file():
            raise SpeceeError(f"task {name}: missing data file {path}; check paths.data_root")
        with open(path, "rb") as f:
            if not any(line.strip() for line in f):
                raise SpeceeError(f"task {name}: data file {path} is empty")
        if path.suffix == ".jsonl":
            from specee.data import read_jsonl
            read_jsonl(path)  # a bad line is one error with its line number, not a datasets traceback
    return files


def write_task_configs(names, data_root: Path, out_dir: Path) -> Path:
    """Write the wrappers for ``names`` into ``out_dir``; return it (the include_path)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in check_names(names):
        files = {split: str(p) for split, p in data_files(name, data_root).items()}
        kwargs = {**_repo_config(name).get("dataset_kwargs", {}), "data_files": files}  # e.g. sample_by
        wrapper = {"include": str(TASKS_DIR / f"{name}.yaml"), "dataset_kwargs": kwargs}
        (out_dir / f"{name}.yaml").write_text(yaml.safe_dump(wrapper, sort_keys=False))
    return out_dir


def _data_paths(files, base: Path) -> list[Path]:
    if isinstance(files, dict):
        return [p for v in files.values() for p in _data_paths(v, base)]
    if isinstance(files, (list, tuple)):
        return [p for v in files for p in _data_paths(v, base)]
    path = Path(str(files))
    return [path if path.is_absolute() else base / path]


def check_user_tasks(names, include_path: Path) -> None:
    """The data files of the user's task YAMLs named in ``names``, read before lm-eval does: a
    missing, empty, non-UTF-8 or non-JSON-object file is one error naming the file and its task
    (the datasets library would end in a traceback). Only local json/jsonl files are checked."""
    from specee.data import iter_jsonl
    wanted = set(names)
    for yml in sorted(include_path.rglob("*.yaml")):
        try:
            cfg = yaml.load(yml.read_text(encoding="utf-8-sig"), Loader=_Lenient)  # a BOM is UTF-8 too
        except (UnicodeDecodeError, yaml.YAMLError, OSError):
            continue  # lm-eval reports it as a task it cannot find
        if isinstance(cfg, dict) and "task" in cfg and not isinstance(cfg["task"], str):
            raise SpeceeError(f"task YAML {yml}: `task` must be one name, not {cfg['task']!r}")
        if not isinstance(cfg, dict) or cfg.get("task") not in wanted:
            continue
        merged = check_task_fields(yml, cfg)
        if merged is not None and (broken := task_values.check_merged(merged)):
            raise task_values.refuse(yml, *broken, cfg["task"])
        files = (cfg.get("dataset_kwargs") or {}).get("data_files")
        if cfg.get("dataset_path") not in ("json", "jsonl") or not files:
            continue
        for path in _data_paths(files, yml.parent):
            what = f"task {cfg['task']} ({yml.name}): data file {path}"
            if not path.is_file():
                raise SpeceeError(f"{what} does not exist or is not a file")
            rows = [row for _, row in iter_jsonl(path)] if path.suffix == ".jsonl" else None
            if rows is None:
                continue
            if not rows:
                raise SpeceeError(f"{what} is empty")
            bad = next((i for i, r in enumerate(rows, 1) if not isinstance(r, dict)), None)
            if bad is not None:
                raise SpeceeError(f"{what}: row {bad} is not a JSON object (one object per line)")


# Top-level keys lm-eval reads from a task YAML besides its TaskConfig fields.
_TASK_KEYS_EXTRA = ("include", "class", "group", "task_list")


def task_fields() -> set[str]:
    import dataclasses
    from lm_eval.api.task import TaskConfig
    return {f.name for f in dataclasses.fields(TaskConfig)} | set(_TASK_KEYS_EXTRA)


def check_task_fields(yml: Path, cfg: dict, _seen: tuple = ()) -> dict | None:
    """Every top-level key of a task YAML (and of the YAMLs it includes) is a field lm-eval knows:
    an unknown or misspelled one (or a YAML anchor's holder key, which lm-eval passes on as a field)
    would end in a TypeError traceback from TaskConfig; every value is of the type and range lm-eval
    reads (:mod:`specee.evaluation.task_values`), each named with the file that holds it. Returns
    the task's merged config (includes first, as lm-eval merges them); a task with its own
    ``class`` takes any field and is not checked (None)."""
    import difflib
    if "class" in cfg:
        return None
    known = task_fields()
    unknown = [k for k in cfg if str(k) not in known]
    if unknown:
        names = [str(k) for k in unknown]
        hints = [f"{k!r} -> {near[0]!r}" for k in names if (near := difflib.get_close_matches(k, sorted(known), n=1))]
        raise SpeceeError(f"task YAML {yml}: unknown field{'s' if len(names) > 1 else ''} "
                          f"{', '.join(repr(k) for k in names[:6])}{' ...' if len(names) > 6 else ''}; "
                          + (f"did you mean {', '.join(hints[:3])}? " if hints else "")
                          + "remove or rename them (a YAML anchor belongs under a field lm-eval reads, e.g. "
                          "metadata); the fields are lm-eval's TaskConfig's")
    task_values.check_file(yml, cfg)
    inc = cfg.get("include")
    merged = {}
    for one in inc if isinstance(inc, list) else [inc] if inc is not None else []:
        if not isinstance(one, str) or not one:
            raise task_values.refuse(yml, "include", f"include is {one!r}; expected the path of a task YAML "
                                     "(or a list of them)", cfg.get("task") if isinstance(cfg.get("task"), str) else None)
        path = Path(one) if Path(one).is_absolute() else yml.parent / one
        if not path.is_file() or path in _seen:
            return None  # lm-eval reports a missing or circular include; the merged task is unknown here
        try:
            base = yaml.load(path.read_text(encoding="utf-8-sig"), Loader=_Lenient)
        except (UnicodeDecodeError, yaml.YAMLError, OSError):
            return None  # lm-eval reports an unreadable include itself
        if not isinstance(base, dict):
            return None
        below = check_task_fields(path, base, (*_seen, yml))
        if below is None:
            return None
        below.pop("task_list", None)
        merged.update(below)
    merged.update({k: v for k, v in cfg.items() if k != "include"})  # local keys win
    return merged


class _Lenient(yaml.SafeLoader):
    """YAML with lm-eval's ``!function`` tags read as their names (lm-eval imports them later)."""


_Lenient.add_multi_constructor(
    "!", lambda loader, suffix, node: task_values.Function(node.value if isinstance(node, yaml.ScalarNode) else ""))


def task_manager(names, data_root: Path, out_dir: Path, include_path: Path | None = None,
                 task_source: str = "shipped"):
    """A TaskManager that sees the shipped tasks among ``names`` (made absolute for ``data_root``),
    the YAMLs under ``include_path`` and, with ``task_source=lm_eval``, lm-eval's own tasks.
    Every name must resolve: unknown ones are one error listing what is available."""
    from lm_eval.tasks import TaskManager
    names = list(names)
    if not names:
        raise SpeceeError("experiment.tasks is empty; name at least one task")
    # With task_source=lm_eval every name means lm-eval's task (its hellaswag, not the shipped one).
    shipped = [n for n in names if n in available()] if task_source == "shipped" else []
    out_dir.mkdir(parents=True, exist_ok=True)
    write_task_configs(shipped, data_root, out_dir) if shipped else None
    paths = [str(out_dir)]
    if include_path is not None:
        if not include_path.is_dir():
            raise SpeceeError(f"experiment.include_path={include_path} is not a folder of task YAMLs")
        check_user_tasks(names, include_path)
        paths.append(str(include_path))
    tm = TaskManager(include_path=paths, include_defaults=(task_source == "lm_eval"))
    unknown = [n for n in names if n not in tm.all_tasks]
    if unknown:
        user = sorted(set(tm.all_tasks) - set(available()))
        hint = ("" if task_source == "lm_eval" else
                "; lm-eval's own tasks (hellaswag, mmlu, ...) need experiment.task_source=lm_eval")
        raise SpeceeError(f"experiment.tasks has unknown task(s) {unknown}; valid: {', '.join(available())} (shipped)"
                          + (f"; from experiment.include_path: {', '.join(user[:20])}" if include_path and user else "")
                          + hint)
    return tm


def check_fewshot(names, num_fewshot: int, task_source: str = "shipped") -> None:
    """A task whose prompt already holds its shots (the paper-protocol tasks) takes no more."""
    if task_source != "shipped" or not num_fewshot:
        return
    fixed = [n for n in names if n in available() and _repo_config(n).get("metadata", {}).get("shots_in_prompt")]
    if fixed:
        raise SpeceeError(f"task(s) {fixed} carry their own fixed shots in the prompt (the authors' protocol); "
                          f"run them with experiment.num_fewshot=0, not {num_fewshot}")


def primary_metric(name: str, results: dict | None = None, task_source: str = "shipped") -> str:
    """lm-eval result key (``metric,filter``) that the task reports as its accuracy: the shipped
    YAML's ``metadata.primary_metric``; for other tasks ``acc``, ``exact_match``, else the first."""
    if task_source == "shipped" and name in available():
        return _repo_config(name)["metadata"]["primary_metric"]
    keys = [k for k in (results or {}) if "," in k and "_stderr" not in k]
    for prefer in ("acc,", "exact_match,"):
        for k in keys:
            if k.startswith(prefer):
                return k
    if not keys:
        raise SpeceeError(f"task {name} reported no metric")
    return keys[0]


_LOWER_IS_BETTER = ("perplexity", "bits_per_byte")


def lower_is_better(name: str, primary: str, task_source: str = "shipped") -> bool:
    """Perplexity-like primary metrics improve downwards (the shipped YAML says so too)."""
    if task_source == "shipped" and name in available():
        meta = _repo_config(name).get("metadata", {})
        if "lower_is_better" in meta:
            return bool(meta["lower_is_better"])
    return any(k in primary for k in _LOWER_IS_BETTER)
