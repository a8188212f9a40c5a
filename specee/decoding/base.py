"""What every decoding mode returns, and the clock it is timed with."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


class Clock:
    """perf_counter that first waits for queued GPU work, so a reading covers what ran."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


@dataclass
class Generation:
    tokens: list[int]
    prefill_s: float
    token_s: list[float]  # wall time of each generated token (the first one comes from prefill)
    exit_layers: list[int]  # decoder layers executed for each generated token (dense: all)
    trace: list[dict] = field(default_factory=list)  # per-token details of early-exit modes

    @property
    def decode_s(self) -> float:
        return sum(self.token_s[1:])


@dataclass
class Score:
    """Teacher-forced scoring of a continuation: per-token log-probs from the layer that emitted."""
    logprobs: list[float]
    greedy: bool  # every continuation token was the argmax of its scoring distribution
    layers: list[int]  # decoder layers executed for each continuation position

    @property
    def total(self) -> float:
        return float(sum(self.logprobs))


def score_from_logits(logits: torch.Tensor, targets: list[int], layers: list[int]) -> Score:
    """logits: (T, V) rows predicting ``targets``."""
    logp = torch.log_softmax(logits.float(), -1)
    tgt = torch.tensor(targets, device=logits.device)
    lp = logp.gather(-1, tgt[:, None])[:, 0]
    return Score(lp.tolist(), bool((logp.argmax(-1) == tgt).all()), layers)
