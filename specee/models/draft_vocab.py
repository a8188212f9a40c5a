"""A reduced draft vocabulary (FR-Spec, arXiv 2502.14856): the draft head scores only the N
tokens the base model itself writes most often.

A draft step's cost is one decoder layer plus a full LM head; with a large vocabulary the head
dominates (SmolLM2-135M: 49,152 x 576, 3.5 layers by time). The draft only has to *propose*
tokens; the base model still verifies them over its full vocabulary (EAGLE's tree verification,
SpecEE's "full-head argmax in the speculative set"), so restricting the draft's head to the most
frequent tokens changes what is proposed, never what is accepted: lossless decoding stays
lossless, and a final token outside the reduced set simply cannot be drafted (the coverage
below says how often).

The frequency table is counted on the base model's own greedy continuations of the calibration
prompts (disjoint from evaluation), split by prompt into a counting part and a held-out part on
which the coverage of each N is reported. It lives in the draft folder as ``draft_vocab.json``.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from specee.errors import SpeceeError

VOCAB_FILE = "draft_vocab.json"
FORMAT = 1
_FIX = "build it with `python run.py experiment=draft_vocab model=<model>` or set draft.vocab_size=0"


def frequency_table(count_seqs: list[list[int]], held_out_seqs: list[list[int]], vocab_size: int,
                    prompt_seqs: list[list[int]] = (), sizes=(256, 512, 1024, 2048, 4096, 8192, 16384)) -> dict:
    """Token ids ordered by how often the model wrote them in ``count_seqs``; ids it never wrote
    follow in order of their count in ``prompt_seqs`` (the prompts' own tokens), then by id, so
    every N up to the vocabulary is defined. Coverage of N = share of held-out generated tokens
    among the first N ids."""
    gen = Counter(t for s in count_seqs for t in s)
    prm = Counter(t for s in prompt_seqs for t in s)
    order = sorted(range(vocab_size), key=lambda t: (-gen[t], -prm[t], t))
    held = [t for s in held_out_seqs for t in s]
    rank = {t: i for i, t in enumerate(order)}
    sizes = sorted({n for n in sizes if n < vocab_size} | {vocab_size})
    coverage = {str(n): (sum(rank[t] < n for t in held) / len(held)) if held else None for n in sizes}
    return {"format": FORMAT, "vocab_size": vocab_size, "order": order,
            "generated_tokens_counted": sum(gen.values()), "distinct_generated": len(gen),
            "held_out_tokens": len(held), "held_out_coverage": coverage,
            "counts": {str(t): gen[t] for t in order[: len(gen)]}}


def read_table(folder: str | Path, vocab_size: int) -> dict:
    """The draft folder's frequency table, checked against the base model's vocabulary."""
    path = Path(folder) / VOCAB_FILE
    if not path.is_file():
        raise SpeceeError(f"draft.vocab_size needs a frequency table {path}, which is missing; {_FIX}")
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SpeceeError(f"{path} is not a readable frequency table ({type(err).__name__}); {_FIX}") from None
    if not isinstance(table, dict) or table.get("format") != FORMAT:
        raise SpeceeError(f"{path} is not a draft vocabulary table of format {FORMAT}; {_FIX}")
    order = table.get("order")
    if isinstance(order, list) and not all(isinstance(i, int) and not isinstance(i, bool) for i in order):
        raise SpeceeError(f"{path}: 'order' must list token ids (whole numbers), not "
                          f"{next(repr(i) for i in order if not isinstance(i, int) or isinstance(i, bool))[:40]}; {_FIX}")
    cov = table.get("held_out_coverage", {})
    if not isinstance(cov, dict) or not all(
            str(k).isdigit() and (v is None or isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1)
            for k, v in cov.items()):
        raise SpeceeError(f"{path}: 'held_out_coverage' must map vocabulary sizes (whole numbers) to shares in "
                          f"[0, 1], not {str(cov)[:40]!r}; {_FIX}")
    if (not isinstance(order, list) or table.get("vocab_size") != vocab_size or len(order) != vocab_size
            or sorted(order) != list(range(vocab_size))):
        raise SpeceeError(f"{path} was built for another vocabulary (this model has {vocab_size} tokens); {_FIX}")
    return table


def reduced_ids(table: dict, n: int) -> list[int]:
    if not 1 <= n <= table["vocab_size"]:
        raise SpeceeError(f"draft.vocab_size={n} must lie in [1, {table['vocab_size']}] (the model's "
                          "vocabulary), or 0 for the full vocabulary")
    return table["order"][:n]


def coverage_of(table: dict, n: int) -> float | None:
    """Held-out coverage of the first ``n`` ids, interpolated between the measured sizes."""
    cov = {int(k): v for k, v in table.get("held_out_coverage", {}).items() if v is not None}
    if not cov:
        return None
    if n in cov:
        return cov[n]
    lo = max((k for k in cov if k < n), default=None)
    hi = min((k for k in cov if k > n), default=None)
    if lo is None or hi is None:
        return cov[lo if hi is None else hi]
    return cov[lo] + (cov[hi] - cov[lo]) * (n - lo) / (hi - lo)


class ReducedHead:
    """The base LM head's rows for a token subset, as one contiguous matrix (a gather of the full
    head per call would read every row again), and the map from its columns back to token ids."""

    def __init__(self, lm_head: torch.nn.Linear, ids: list[int]):
        dev = lm_head.weight.device
        self.ids = torch.tensor(ids, dtype=torch.long, device=dev)
        self.weight = lm_head.weight.detach()[self.ids].contiguous()
        bias = getattr(lm_head, "bias", None)
        self.bias = bias.detach()[self.ids].contiguous() if bias is not None else None

    def __len__(self) -> int:
        return int(self.ids.numel())

    def topk(self, f_hat: torch.Tensor, k: int) -> torch.Tensor:
        logits = torch.nn.functional.linear(f_hat, self.weight, self.bias)
        return self.ids[logits.topk(min(k, len(self)), -1).indices]
