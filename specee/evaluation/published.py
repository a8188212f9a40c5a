"""Published accuracies of a model (its model card, other harnesses), shown beside the dense
figures this harness measures: ``specee/evaluation/published/<model>.json``.

Each task lists entries ``{source, compare_with, value[, note]}``: ``value`` in %, ``compare_with``
the metric of ours it sits beside (``acc`` or ``acc_norm``), ``source`` a key of ``sources``
whose ``differs`` says what is not the same (weights, harness, prompts, item sets)."""
from __future__ import annotations

from specee.cards import read_card
from specee.errors import SpeceeError
from specee.io import PROJECT_ROOT

FOLDER = PROJECT_ROOT / "specee" / "evaluation" / "published"


def load(model: str) -> dict | None:
    """The model's published figures, or None when none are recorded."""
    path = FOLDER / f"{model}.json"
    if not path.is_file():
        return None
    fix = "restore it from the repository"
    doc = read_card(path, fix, {"model": str, "sources": dict, "tasks": dict}, what="published figures")
    for task, entries in doc["tasks"].items():
        for e in entries if isinstance(entries, list) else [None]:
            if not (isinstance(e, dict) and e.get("source") in doc["sources"]
                    and isinstance(e.get("value"), (int, float)) and isinstance(e.get("compare_with"), str)):
                raise SpeceeError(f"{path}: task {task} has an entry without a known source, a value and "
                                  f"compare_with; {fix}")
    return doc
