"""An ablation's identity, declared once: the fields of its ``conf/ablation/<name>.yaml``.

What the report, the verdicts, the paper-figure page, the main job's presets and the folder
checks need to know about an ablation beyond how it decodes — its label, the paper's step it
measures, whether it is a bar of the staircase, its role, the predictor bank it reads and its
place in the report's order — are fields of :class:`specee.config.AblationConfig`, set in its
YAML. They are read from the config each result stored, so a report needs nothing but the results;
a result written before these fields existed takes them from the ablation file of the same name
(and, where there is none, from its mode's spec). No module outside ``conf/`` lists ablations.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# What an ablation is for in the report: the baseline every other row is compared against, a
# method a user would pick instead of SpecEE (no training, or transformers' own), a decoder that
# leaves the stack early, or a lossless speculative decoder.
ROLES = ("reference", "peer", "early_exit", "lossless")
# The predictor bank variant an ablation reads, and how a table names it.
BANKS = {"trained": "harness-default bank", "paper": "paper-recipe bank", "tuned": "tuned bank",
         "authors": "the authors' released bank"}
LAST = 1000  # the order of an ablation that declares none: after every declared one
FIELDS = ("label", "step", "staircase", "role", "bank", "order")


@dataclass(frozen=True)
class Identity:
    name: str
    label: str  # how a staircase bar and a figure name it
    step: str | None  # the paper's step it measures (dense, T1, T1+T2, T1+T2+T3, EAGLE, ...), else None
    staircase: bool  # a bar of the report's ablation staircase
    role: str  # one of ROLES
    bank: str  # one of BANKS
    order: int  # lower first in every table and figure

    @property
    def reference(self) -> bool:
        return self.role == "reference"

    @property
    def peer(self) -> bool:
        return self.role == "peer"


def _get(node, key: str):
    try:
        return node.get(key)
    except AttributeError:
        return getattr(node, key, None)


def conf_root() -> Path:
    from specee.io import PROJECT_ROOT
    return PROJECT_ROOT / "conf" / "ablation"


@lru_cache(maxsize=None)
def _declared(folder: Path) -> dict[str, dict]:
    """name -> the identity fields each ablation file in ``folder`` sets (plain YAML: an option in
    the global package keeps its fields under ``ablation:``)."""
    import yaml
    out = {}
    for path in sorted(folder.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        node = doc.get("ablation", doc) if isinstance(doc, dict) else {}
        if isinstance(node, dict):
            out[str(node.get("name", path.stem))] = {k: node[k] for k in (*FIELDS, "mode") if k in node}
    return out


def declared(folder: Path | None = None) -> dict[str, dict]:
    """The identity fields of every ablation file (conf/ablation/ unless ``folder``), by name."""
    return _declared(Path(folder) if folder else conf_root())


def of(ablation, folder: Path | None = None) -> Identity:
    """The identity of an ablation config: a run's ``cfg.ablation`` or a result's stored
    ``config.ablation``. Fields it lacks (a result older than them) come from the ablation file of
    the same name, else from its mode's spec."""
    from specee.decoding import modes
    name = str(_get(ablation, "name") or "?")
    stored = {k: _get(ablation, k) for k in FIELDS}
    if stored["order"] is None:  # a result written before the fields existed (every config has an order)
        stored = {k: declared(folder).get(name, {}).get(k) for k in FIELDS}
    role = stored["role"]
    if role is None:
        spec = modes.of(ablation)
        role = "reference" if spec.reference else "early_exit" if spec.early_exit or not spec.lossless else "lossless"
    return Identity(name=name, label=str(stored["label"] or name), step=stored["step"],
                    staircase=bool(stored["staircase"]), role=str(role), bank=str(stored["bank"] or "trained"),
                    order=int(LAST if stored["order"] is None else stored["order"]))


def of_doc(doc: dict) -> Identity:
    """The identity of the ablation a result (or per-item record) ran."""
    return of(doc["config"]["ablation"])


def variant(name: str, bank: str, folder: Path | None = None) -> str:
    """The ablation that runs the step ``name`` measures with predictor bank ``bank`` in place of
    the bank trained here (``name`` itself where it reads another bank already, measures no step,
    or where no ablation file declares that pairing)."""
    table = declared(folder)
    me = table.get(name, {})
    if me.get("bank", "trained") != "trained" or me.get("step") is None:
        return name
    twins = [n for n, f in table.items() if f.get("step") == me.get("step") and f.get("bank", "trained") == bank
             and f.get("mode") == me.get("mode") and bool(f.get("staircase")) == bool(me.get("staircase"))]
    return min(twins, key=lambda n: (table[n].get("order", LAST), n)) if twins else name


def with_step(step: str, bank: str = "trained", folder: Path | None = None) -> str | None:
    """The first ablation (in report order) that measures the paper's ``step`` with ``bank``."""
    table = declared(folder)
    hits = [n for n, f in table.items() if f.get("step") == step and f.get("bank", "trained") == bank]
    return min(hits, key=lambda n: (table[n].get("order", LAST), n)) if hits else None


def reference_name(folder: Path | None = None) -> str | None:
    """The ablation file that declares itself the reference (role: reference)."""
    table = declared(folder)
    hits = [n for n, f in table.items() if f.get("role") == "reference"]
    return min(hits, key=lambda n: (table[n].get("order", LAST), n)) if hits else None
