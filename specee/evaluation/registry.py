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
