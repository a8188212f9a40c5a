"""The tasks shipped in ``tasks/*.yaml`` and their materialisation for one data root.

A repo YAML names its data file relative to ``paths.data_root``; lm-eval needs absolute
paths, so each run writes a one-line-per-key wrapper (``include:`` the repo YAML, then
absolute ``data_files``) into a folder that ``TaskManager(include_path=...,
include_defaults=False)`` scans — built-in and hub tasks are never consulted.
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
    return files


def write_task_configs(names, data_root: Path, out_dir: Path) -> Path:
    """Write the wrappers for ``names`` into ``out_dir``; return it (the include_path)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in check_names(names):
        files = {split: str(p) for split, p in data_files(name, data_root).items()}
        wrapper = {"include": str(TASKS_DIR / f"{name}.yaml"), "dataset_kwargs": {"data_files": files}}
        (out_dir / f"{name}.yaml").write_text(yaml.safe_dump(wrapper, sort_keys=False))
    return out_dir


def task_manager(names, data_root: Path, out_dir: Path):
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=str(write_task_configs(names, data_root, out_dir)),
                       include_defaults=False)


def primary_metric(name: str) -> str:
    """lm-eval result key (``metric,filter``) that the task reports as its accuracy."""
    return _repo_config(name)["metadata"]["primary_metric"]
