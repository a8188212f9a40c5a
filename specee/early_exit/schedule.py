"""Which layers run a predictor for the next token (SpecEE §5: two-level scheduling).

- offline: the top-M layers of a per-model exit profile (``profile_exits`` recipe), M either
  given, or the paper's M = 8 of 32 layers scaled with depth (``round(L/4)``), or — with
  ``placement.coverage`` set — the smallest M whose layers hold that share of the profiled exits;
- online: per request, a circular queue of the last N exit layers and a per-layer count array;
  each recorded exit x adds 1 to layers x-w..x+w, and layers with count > 0 form the online set;
- the active set for a token is online ∪ offline (either part may be disabled).

Warm-up: until N exits are in the queue, *all* layers are active — the first tokens then exit
where they truly can, so the queue starts from unbiased exit layers (costs predictor calls on
N tokens per request only).

``reference_variant=True`` reproduces the reference code instead: history shared across
requests (never reset) and only the offsets {-w, 0, +w} counted.

A schedule is stateless; per-request state comes from ``new_request()`` and is passed back to
``active(state)`` (one bool per layer) and ``record(state, exit_layer)``.
"""
from __future__ import annotations

from collections import deque
from pathlib import Path

from specee import cards
from specee.cards import read_card
from specee.errors import SpeceeError

PROFILE = "exit_profile.json"


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


def offline_set(counts: list[int], m: int | None, coverage: float) -> list[int]:
    """Top-M layers by exit count (ties: lower layer first). With m=None, the smallest M whose
    layers hold at least ``coverage`` of all exits."""
    order = sorted(range(len(counts)), key=lambda i: (-counts[i], i))
    order = [i for i in order if counts[i] > 0]
    if m is None:
        total, acc, m = sum(counts), 0, 0
        for i in order:
            if total and acc / total >= coverage:
                break
            acc += counts[i]
            m += 1
    return sorted(order[:m])


def offline_rule(placement, num_layers: int) -> tuple[int | None, float, str]:
    """(m, coverage, description) for offline_set from a placement node."""
    if placement.m is not None:
        return placement.m, 1.0, f"top M={placement.m} layers by exit count (placement.m)"
    if placement.get("coverage") is not None:
        c = placement.coverage
        return None, c, f"smallest M whose layers hold >= {c:.0%} of exits (placement.coverage)"
    m = max(1, round(num_layers / 4))
    return m, 1.0, f"top M={m} layers by exit count: the paper's 8 of 32 layers, scaled with depth (round(L/4))"


def window_offsets(w: int, reference_variant: bool) -> list[int]:
    return [-w, 0, w] if reference_variant else list(range(-w, w + 1))


class OnlineState:
    def __init__(self, num_layers: int, n: int):
        self.queue: deque[int] = deque(maxlen=n)
        self.counts = [0] * num_layers


class TwoLevelSchedule:
    def __init__(self, num_layers: int, offline: list[int] | None, online: bool, n: int, w: int,
                 reference_variant: bool = False):
        self.num_layers, self.n, self.w = num_layers, n, w
        self.use_online = online
        self.offsets = window_offsets(w, reference_variant)
        self.reference_variant = reference_variant
        self.offline_mask = [False] * num_layers
        for i in offline or []:
            self.offline_mask[i] = True
        self.all_mask = [True] * num_layers
        self._shared = OnlineState(num_layers, n) if reference_variant else None
        self.name = "+".join(p for p, on in (("offline", offline is not None), ("online", online)) if on)

    def new_request(self) -> OnlineState:
        return self._shared if self.reference_variant else OnlineState(self.num_layers, self.n)

    def active(self, state: OnlineState) -> list[bool]:
        if not self.use_online:
            return self.offline_mask
        if len(state.queue) < self.n:
            return self.all_mask  # warm-up (see module docstring)
        return [o or c > 0 for o, c in zip(self.offline_mask, state.counts)]

    def _add(self, state: OnlineState, x: int, sign: int) -> None:
        for off in self.offsets:
            j = x + off
            if 0 <= j < self.num_layers:
                state.counts[j] += sign

    def record(self, state: OnlineState, exit_layer: int) -> None:
        if not self.use_online:
            return
        if len(state.queue) == state.queue.maxlen:
            self._add(state, state.queue[0], -1)  # the oldest exit leaves the window
        state.queue.append(exit_layer)
        self._add(state, exit_layer, +1)

    def online_set(self, state: OnlineState) -> list[int]:
        return [i for i, c in enumerate(state.counts) if c > 0]


def default_window(num_layers: int) -> int:
    """The paper's w=2 on 32 layers, scaled with depth (at least 1)."""
    return max(1, round(2 * num_layers / 32))


def load_profile(folder: str | Path, num_layers: int) -> dict:
    path = Path(folder) / PROFILE
    fix = "rerun experiment=profile_exits for this model (or point placement.profile_path at its profile)"
    if not path.is_file():
        raise SpeceeError(f"no exit profile at placement.profile_path={folder}; create it with "
                          "`python run.py experiment=profile_exits`")
    prof = read_card(path, fix, {"exit_counts": list}, "exit profile")
    counts = prof["exit_counts"]
    if not cards.counts(counts):
        raise SpeceeError(f"{path} is corrupt: exit_counts must be non-negative integers, one per layer; {fix}")
    from specee.artifact_checks import check_card_values  # indices of the profile's own layers
    check_card_values(prof, path, "exit profile", {"num_layers": "positive", "k": "positive", "threshold": "probability",
                                                  "tokens": "count", "tokens_without_exit": "count",
                                                  "default_offline_set": "layers", "calibration_prompt_ids": "ids"},
                      fix, len(counts))
    from specee.early_exit.standin import fit_depth
    prof["exit_counts"] = counts = fit_depth(prof, num_layers)  # a synthetic profile rescales to any depth
    if len(counts) != num_layers:
        raise SpeceeError(f"the exit profile at {folder} has {len(counts)} layers, the model {num_layers}; {fix}")
    return prof


def build_schedule(placement, num_layers: int, profile_dir: Path | None):
    """placement: the `placement` config node."""
    if placement.name == "all_layers":
        return AllLayers(num_layers)
    offline = None
    if placement.offline:
        prof = load_profile(profile_dir, num_layers)
        m, coverage, _ = offline_rule(placement, num_layers)
        offline = offline_set(prof["exit_counts"][: num_layers - 1], m, coverage)
    w = placement.window if placement.window is not None else default_window(num_layers)
    return TwoLevelSchedule(num_layers, offline, placement.online, placement.n_history, w,
                            placement.reference_variant)
