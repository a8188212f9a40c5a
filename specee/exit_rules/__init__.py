"""Exit rules: how a decoder that leaves the stack early decides, one registered class each.

An exit rule reads a layer's state (its hidden state, the previous layer's, and — where it says so
— that layer's full LM head) and gives one score; the token exits at the first layer below the last
whose score exceeds the rule's knob. The rule declares everything the rest of the harness needs:

- :meth:`ExitRule.layer_scores` — the one implementation of its score, called by the real decoder
  (one row per step, :class:`specee.decoding.exit_rule.ExitRuleDecoder`) and by the frontier's
  teacher-forced recording (every decode step of a request at once, ``specee/frontier/record.py``);
- :meth:`ExitRule.fires` — the decision at a knob value, called by the decoder and by replay;
- ``knob`` and ``grid`` — what the knob is and its default frontier grid, conservative end first;
- ``reads_head`` — whether a decision costs a full LM head (the cost model prices each decision as
  one ``rule_probe``, measured on the rule itself; a rule that does not read the head pays one head
  only where it exits, to emit the token);
- ``fitted_on`` — what it must be fitted on (None: nothing; else the artifact :meth:`load` reads).

Each rule becomes a decoding mode of the same name (``ablation.mode``), so ``experiment=speed``,
``experiment=accuracy`` and the frontier run it as they run any mode. Adding a rule: a module in
this package defining a subclass with a ``name`` (found by :func:`registered`, nothing to list),
its ``conf/ablation/<name>.yaml`` and its tests.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import ClassVar

import torch

from specee.errors import SpeceeError


class ExitRule:
    name: ClassVar[str] = ""  # its decoding mode (ablation.mode) and ablation name
    label: ClassVar[str] = ""  # what it is, in a few words
    knob: ClassVar[str] = "threshold"  # what the grid values are
    grid: ClassVar[tuple[float, ...]] = ()  # the frontier's default grid, most conservative first
    default: ClassVar[float] = 0.9  # the knob when a job names none (ablation.exit_value)
    reads_head: ClassVar[bool] = False  # a decision needs the layer's full LM head
    fitted_on: ClassVar[str | None] = None  # what it is fitted on (None: nothing to fit)
    source: ClassVar[str] = ""  # where the rule comes from (paper, section)

    @classmethod
    def load(cls, cfg, rt) -> "ExitRule":
        """The rule for a job (an artifact it was fitted into, where it has one)."""
        return cls()

    @classmethod
    def standin(cls, rt) -> "ExitRule":
        """model.init=random: the rule with whatever it fits replaced by fixed values (cost only)."""
        return cls()

    def to(self, device) -> "ExitRule":
        return self

    def layer_scores(self, i: int, h_prev: torch.Tensor, h: torch.Tensor,
                     logits: torch.Tensor | None) -> torch.Tensor:
        """Scores of ``T`` rows after layer ``i``: ``h`` (T, d) the layer's output, ``h_prev`` (T, d)
        its input (the embedding at layer 0), ``logits`` (T, V) the layer's full LM head where
        ``reads_head``. Returns (T,) float32."""
        raise NotImplementedError

    @staticmethod
    def fires(scores, value: float):
        """The exit decision at knob ``value`` (device tensors in the decoder, arrays in replay)."""
        return scores > value

    def trained_on(self) -> list[str]:
        """The prompt ids it was fitted on (an evaluation leaves them out)."""
        return []

    def card(self) -> dict:
        """What a result says about the rule."""
        return {"rule": self.name, "label": self.label, "knob": self.knob, "reads_head": self.reads_head,
                "fitted_on": self.fitted_on, "source": self.source}


_RULES: dict[str, type[ExitRule]] = {}


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def registered() -> dict[str, type[ExitRule]]:
    """Every rule in this package, by name: each module is imported once and its named
    :class:`ExitRule` subclasses are the registry (a test may define more)."""
    if not _RULES:
        for m in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{m.name}")
    _RULES.clear()
    _RULES.update({c.name: c for c in _subclasses(ExitRule) if c.name})
    return dict(_RULES)


def rule(name: str) -> type[ExitRule]:
    rules = registered()
    if name not in rules:
        raise SpeceeError(f"exit rule {name!r} is unknown; valid: {', '.join(rules)}")
    return rules[name]
