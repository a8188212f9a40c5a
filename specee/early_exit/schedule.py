"""Which layers run a predictor for the next token (SpecEE §5).

A schedule is stateless across requests; per-request state comes from ``new_request()`` and is
passed back to ``active(state)`` (a list of bools, one per layer) and ``record(state, exit)``.
"""
from __future__ import annotations


class AllLayers:
    """Predictors after every layer (the paper's T1 without scheduling)."""

    name = "all_layers"

    def __init__(self, num_layers: int):
        self.mask = [True] * num_layers

    def new_request(self):
        return None

    def active(self, state) -> list[bool]:
        return self.mask

    def record(self, state, exit_layer: int) -> None:
        pass
