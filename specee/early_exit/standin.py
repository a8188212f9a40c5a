"""What stands in for a model's exit profile on ``model.init=random`` shapes.

A random-weight run measures cost on a real shape; its predictors are random stand-ins, so no
profile measured on it would mean anything. Where the model has no exit profile of its own
(``placement.profile_path`` holds none), the shipped paper-like profile stands in
(specee/artifacts/paper_like_32l_exit_profile: the paper's mean depth, an assumed shape; its
README says which is which), and every result says so under ``synthetic``. A synthetic profile
is rescaled to the model's depth (a 40-layer 13B, a layer cut), keeping each exit's share of the
depth; a measured one never is.
"""
from __future__ import annotations

from pathlib import Path

from specee.io import project_path

PAPER_LIKE = "specee/artifacts/paper_like_32l_exit_profile"
PROFILE = "exit_profile.json"


def fit_depth(prof: dict, num_layers: int) -> list[int]:
    """``prof["exit_counts"]`` for a model of ``num_layers`` layers: unchanged when the depth
    matches or the profile was measured (a measured profile of another depth is refused by its
    caller); a synthetic one (``"synthetic": true``) rescaled, an exit after i+1 of n layers
    moved to the layer at the same share of the new depth, the last entry (no exit) kept last."""
    counts = list(prof["exit_counts"])
    n = len(counts)
    if n == num_layers or not prof.get("synthetic") or n < 1 or num_layers < 1:
        return counts
    out = [0] * num_layers
    for i, c in enumerate(counts[:-1]):
        j = min(max(round((i + 1) * num_layers / n) - 1, 0), num_layers - 2)
        out[max(j, 0) if num_layers > 1 else 0] += c
    out[-1] += counts[-1]
    return out


def profile_dir(cfg, placement) -> Path:
    """The exit-profile folder a run's schedule reads: ``placement.profile_path``, or on
    ``model.init=random`` without a profile there, the paper-like stand-in."""
    folder = project_path(placement.profile_path)
    if cfg.model.get("init", "pretrained") == "random" and not (folder / PROFILE).is_file():
        return project_path(PAPER_LIKE)
    return folder


def profile_label(cfg) -> str | None:
    """What ``synthetic.exit_profile`` says for this run, or None where its schedule reads a
    measured profile (or none)."""
    import json
    if not cfg.placement.get("offline"):
        return None
    folder = profile_dir(cfg, cfg.placement)
    try:
        prof = json.loads((folder / PROFILE).read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return None  # preflight refuses a missing or broken profile before any result is written
    if not isinstance(prof, dict) or not prof.get("synthetic"):
        return None
    why = (f"the model has none at placement.profile_path={cfg.placement.profile_path}"
           if folder != project_path(cfg.placement.profile_path) else "placement.profile_path names it")
    return (f"{PAPER_LIKE if folder == project_path(PAPER_LIKE) else cfg.placement.profile_path} (synthetic, "
            f"paper-like: the paper's mean depth, an assumed shape; {why}), its offline layers rescaled to the "
            "model's depth where that is not its own")
