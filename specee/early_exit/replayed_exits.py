"""Replayed exit decisions: measure a SpecEE runtime's cost on a real shape without a trained model.

``early_exit.replay=PATH`` makes the decoder exit where a recorded or modelled exit distribution
says, while it does exactly the work of the real mode: the draft step, every scheduled predictor
(its output computed, read and ignored), the verification LM head at the exit, the KV policy.
A token whose target is layer t exits at the first scheduled layer >= t, as a real predictor
would; target L-1 means no exit.

PATH is either
- an exit-profile folder (``exit_profile.json`` with ``exit_counts`` per layer, the last entry =
  no exit): targets are drawn, seeded, from that distribution; or
- a speed ``results.json``: the per-token exit layers it recorded, looked up by the prompt's
  token ids (``prompt_sha``) — replaying a mode's own trace reproduces its tokens exactly.
"""
from __future__ import annotations

import hashlib
import json
import random

import torch

from specee import cards
from specee.cards import read_card
from specee.errors import SpeceeError
from specee.io import project_path

PROFILE = "exit_profile.json"


def prompt_sha(ids: torch.Tensor) -> str:
    return hashlib.sha256(json.dumps(ids.reshape(-1).tolist()).encode()).hexdigest()[:16]


class ExitReplay:
    def __init__(self, path: str, num_layers: int, seed: int = 0):
        src = project_path(path)
        self.source, self.num_layers = str(path), num_layers
        self.rng = random.Random(seed)
        self.weights = self.traces = None
        if src.is_dir():
            src = src / PROFILE
        if not src.is_file():
            raise SpeceeError(f"early_exit.replay={path}: no exit profile ({PROFILE}) or results.json there")
        fix = f"point early_exit.replay at an exit profile folder or a speed results.json (it is {path})"
        doc = read_card(src, fix, what="exit profile or speed results.json")
        if "exit_counts" in doc:
            counts = doc["exit_counts"]
            if cards.counts(counts):  # a synthetic profile (paper-like) rescales to any depth
                from specee.early_exit.standin import fit_depth
                counts = fit_depth(doc, num_layers)
            if not cards.counts(counts) or len(counts) != num_layers or sum(counts) <= 0:
                n = len(counts) if isinstance(counts, list) else "no list of"
                raise SpeceeError(f"early_exit.replay={path}: the profile has {n} layers and "
                                  f"{sum(counts) if cards.counts(counts) else 'no'} exits; this model has "
                                  f"{num_layers} layers (a profile needs one non-negative count per layer)")
            self.kind, self.weights = "profile", counts
            self.target_avg_layers = sum((i + 1) * c for i, c in enumerate(counts)) / sum(counts)
        elif isinstance(doc.get("prompts"), list) and all(isinstance(r, dict) and "prompt_sha" in r
                                                          for r in doc["prompts"]):
            self.kind, self.traces = "trace", {}
            for r in doc["prompts"]:
                if not isinstance(r["prompt_sha"], str):
                    raise SpeceeError(f"early_exit.replay={path}: a prompt's prompt_sha holds "
                                      f"{str(r['prompt_sha'])[:40]!r}, not a hash (text); {fix}")
                layers = r.get("exit_layers")
                if not cards.counts(layers) or any(x < 1 or x > num_layers for x in layers):
                    raise SpeceeError(f"early_exit.replay={path}: prompt {r['prompt_sha']} has no exit_layers "
                                      f"in 1..{num_layers} (layers used per token); {fix}")
                self.traces.setdefault(r["prompt_sha"], [x - 1 for x in layers[1:]])
            self.target_avg_layers = None
        else:
            raise SpeceeError(f"early_exit.replay={path}: {src.name} is neither an exit profile "
                              "(exit_counts) nor a speed results.json with per-prompt exit layers")

    def new_request(self, prompt_ids: torch.Tensor):
        if self.traces is None:
            return None
        key = prompt_sha(prompt_ids)
        if key not in self.traces:
            raise SpeceeError(f"early_exit.replay={self.source} holds no trace for this prompt; replay a "
                              "results.json of the same prompts, model and settings")
        return iter(self.traces[key])

    def target(self, state) -> int:
        """The next token's exit layer (0-based; num_layers-1 = no exit)."""
        if state is None:
            return self.rng.choices(range(self.num_layers), weights=self.weights)[0]
        return next(state, self.num_layers - 1)


def load_replay(path: str | None, num_layers: int, seed: int = 0) -> ExitReplay | None:
    return ExitReplay(path, num_layers, seed) if path else None
