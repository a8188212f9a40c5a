"""Accuracy evaluation through lm-eval: the model adapter (lm), the local task configs
(registry, tasks/*.yaml) and the drift check against a committed baseline (drift)."""
