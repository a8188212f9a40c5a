"""Settings chosen from what is measured on this machine rather than fixed: prompt lookup's proposal
length, the self-speculation draft depth (auto_settings.py) and the draft tree (tree_select.py).

They time decoders and read the block-cost table (specee/bench/), so they sit above both the
decoders and the benchmarks; the decoder registry never imports them. A mode's builder that takes
an ``auto`` setting is handed this package by :func:`specee.builders.build_decoder` (above both).
"""
from __future__ import annotations

from specee.tuning.auto_settings import auto_exit_layer, auto_num_tokens, exit_layer
from specee.tuning.tree_select import auto_tree

__all__ = ["auto_exit_layer", "auto_num_tokens", "auto_tree", "exit_layer"]
