"""Warming up before the clock, the graphs a request needs, and energy in long windows."""
from __future__ import annotations


WARMUP_TOKENS = 8  # tokens per untimed warm-up generation (the cache is still sized for the timed run)


def warm_up(decoders, prompt_ids, max_new_tokens: int, eos, hf=None, tokens: int = WARMUP_TOKENS) -> None:
    """Untimed generations of every decoder on each prompt, at the timed capacity: decoders size
    their caches from ``max_new_tokens`` (and a compiled runtime with cache_bucket compiles one
    graph per capacity), so the warm-up asks for the timed budget and stops after ``tokens``.
    ``hf(ids)``: HF generate's own warm-up, before its first timed call."""
    def stop(toks):
        return len(toks) >= tokens
    for ids in prompt_ids:
        for dec in decoders:
            if dec is not None:
                dec.generate(ids, max_new_tokens, eos, stop)
        if hf is not None:
            hf(ids)


def warm_key(rt, prompt_tokens: int):
    """What decides the compiled graphs a request needs beyond its block lengths: the prompt
    length under cache_bucket (capacity buckets), nothing otherwise."""
    return prompt_tokens if rt.kind == "compiled" and getattr(rt, "cache_bucket", 0) else None


def energy_pass(sides: dict, meters: dict, prompt_ids, max_new_tokens: int, eos, rounds: int = 1) -> dict:
    """Energy per side in long windows: one window per side over all prompts (NVML's counter
    advances about every 100 ms, so a window per generation would be quantised), sides in
    alternating order over rounds. Untimed: throughput comes from the interleaved pass. Returns
    the tokens each side generated inside its windows."""
    names = [k for k, dec in sides.items() if dec is not None and meters[k].available]
    tokens = {k: 0 for k in names}
    for r in range(rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            with meters[k].region():
                for ids in prompt_ids:
                    tokens[k] += len(sides[k].generate(ids, max_new_tokens, eos).tokens)
    return tokens
