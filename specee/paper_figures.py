"""The SpecEE paper's own figures, for the report page that sets them beside the measured rows.

Only figures the harness can source are recorded; each says where it comes from. The paper's
per-dataset bars (its speed figures per prompt set, its accuracy table's per-task values) are not
digitised here: those cells read "not digitised" rather than a number nobody checked.

Source: Xu et al., "SpecEE: Accelerating Large Language Model Inference with Speculative Early
Exiting", ISCA 2025 (arXiv 2504.08850).
"""
from __future__ import annotations

SOURCE = "SpecEE (ISCA 2025, arXiv 2504.08850)"
NOT_DIGITISED = "not digitised"

# The models the paper reports on, by this harness's model names.
MODELS = ("llama2_7b",)

# Each step of the paper's staircase and its peers: what the paper states for Llama-2-7B.
SPEED = {
    "dense": "1.00× (the baseline)",
    "T1": NOT_DIGITISED,
    "T1+T2": NOT_DIGITISED,
    "T1+T2+T3": "up to 2.25× end to end (cloud GPU), 2.43× (PC) (abstract); T1+T2+T3 at 1.05× of EAGLE",
    "EAGLE": NOT_DIGITISED,
    "AdaInfer (SVM)": NOT_DIGITISED,
    "AdaInfer (CRF)": NOT_DIGITISED,
}
# Mean layers per token under SpecEE on Llama-2-7B (32 layers).
LAYERS = {"T1+T2": "≈ 23 of 32", "T1+T2+T3": "≈ 23 of 32"}
# Accuracy: the claim of its accuracy table, per task and early-exit step.
ACCURACY_CLAIM = "within 1 point of dense (accuracy table)"
SKEW = "≤ 0.20 of exits in the lower-probability half of the layers (Fig. 10)"


def step(identity) -> str:
    """The paper's name for what a harness ablation measures: the ``step`` its config declares
    (:mod:`specee.ablations`), else its own name."""
    return identity.step or identity.name


def speed_figure(identity) -> str:
    return SPEED.get(step(identity), "–")


def layers_figure(identity) -> str:
    return LAYERS.get(step(identity), "–")


def accuracy_figure(identity) -> str:
    if identity.reference:
        return NOT_DIGITISED
    return ACCURACY_CLAIM if identity.step and identity.step.startswith("T1") else "–"
