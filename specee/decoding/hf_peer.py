"""Peer baselines run by transformers' own ``generate``: reference implementations no one here wrote.

* ``hf_pld``: prompt lookup decoding, ``generate(prompt_lookup_num_tokens=N,
  max_matching_ngram_size=n)``;
* ``hf_self_spec``: early-exit self-speculation (LayerSkip-style), ``generate(assistant_early_exit=k)``:
  the model's first k layers and its own LM head draft, the whole stack verifies;
* ``hf_plain``: plain greedy ``generate``, the peers' own baseline.

They are timed beside the harness's decoders through the same :class:`Generation` record. A
streamer marks each step's end: transformers hands it the tokens a step accepted (after the
prompt, the first token alone: the prefill), so the first mark ends the prefill and each later
one a verification step, whose time is shared equally by its tokens — as the harness's own
multi-token steps are. The mean accepted tokens per step (Spec-Bench's tau) counts those marks.
The marks read the tokens on the host, a sync; plain generate pays the same per step.
"""
from __future__ import annotations

import torch

from specee.decoding.base import Clock, Generation, PhaseTimer
from specee.errors import SpeceeError


def greedy_generate_args(prompt_ids: torch.Tensor, max_new_tokens: int, eos_id: int | None) -> dict:
    """transformers' ``generate`` arguments for plain greedy decoding of one prompt (every HF call
    the harness times uses them)."""
    return {"attention_mask": torch.ones_like(prompt_ids), "max_new_tokens": max_new_tokens, "do_sample": False,
            "eos_token_id": eos_id, "pad_token_id": eos_id if eos_id is not None else 0,
            "temperature": None, "top_p": None, "top_k": None}

# Each peer: what it is, and generate's keyword arguments from (num_tokens, ngram_size, exit_layer).
PEERS = {"hf_pld": "transformers' prompt lookup, generate(prompt_lookup_num_tokens=N)",
         "hf_self_spec": "transformers' early-exit self-speculation, generate(assistant_early_exit=k)",
         "hf_plain": "transformers' plain greedy generate"}
_KWARGS = {"hf_pld": lambda n, g, k: {"prompt_lookup_num_tokens": int(n), "max_matching_ngram_size": int(g)},
           "hf_self_spec": lambda n, g, k: {"assistant_early_exit": int(k)},
           "hf_plain": lambda n, g, k: {}}
NEEDS_EXIT_LAYER = ("hf_self_spec",)  # its draft depth: ablation.exit_layer (auto: chosen here)


class _StepMarks:
    """A generate streamer that records the time and size of every put (the first is the prompt)."""

    def __init__(self, clock: Clock):
        self.clock, self.times, self.sizes = clock, [], []

    def put(self, value) -> None:
        self.sizes.append(int(value.numel()))
        self.times.append(self.clock())

    def end(self) -> None:
        pass


class HFGenerateDecoder:
    """``generate(prompt_ids, max_new_tokens, eos_id) -> Generation`` through ``model.generate``
    with the peer's keyword arguments. Not a step decoder: a request runs whole (it cannot take
    turns step by step with the harness's decoders)."""
    multi_token = True
    profile_phases = False

    def __init__(self, model, rt, name: str, **generate_kwargs):
        if name not in PEERS:
            raise SpeceeError(f"unknown transformers peer {name!r}; valid: {', '.join(PEERS)}")
        self.model, self.rt, self.name, self.kwargs = model, rt, name, generate_kwargs
        self.source = PEERS[name]

    def timer(self) -> PhaseTimer:
        return PhaseTimer(self.rt.device)

    def describe(self) -> dict:
        return {"implementation": self.source, "generate_kwargs": dict(self.kwargs)}

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int, eos_id: int | None = None, stop=None) -> Generation:
        if stop is not None:  # a warm-up's early stop: transformers' generate takes a budget instead
            max_new_tokens = min(max_new_tokens, 8)
        clock = Clock(prompt_ids.device)
        marks = _StepMarks(clock)
        t0 = clock()
        out = self.model.generate(prompt_ids, **greedy_generate_args(prompt_ids, max_new_tokens, eos_id),
                                  streamer=marks, **self.kwargs)
        t_end = clock()
        tokens = out[0, prompt_ids.shape[1]:].tolist()
        times, sizes = marks.times[1:], marks.sizes[1:]  # the first put is the prompt itself
        if not tokens or not times or sum(sizes) != len(tokens):
            raise SpeceeError(f"{self.name}: transformers' generate streamed {sum(sizes)} tokens but returned "
                              f"{len(tokens)}; its step times cannot be read")
        # Self-speculation verifies its first draft inside the prefill forward (a first put of
        # several tokens): those tokens share that forward's time.
        token_s, trace = [(times[0] - t0) / sizes[0]] * sizes[0], []
        ends = times[1:-1] + [t_end] if len(times) > 1 else []
        for start, end, n in zip(times, ends, sizes[1:]):
            token_s += [(end - start) / n] * n
            trace.append({"accepted": n, "emitted": n, "exit_layer": self.rt.num_layers - 1, "layers": self.rt.num_layers,
                          "pred_calls": 0, "verify_calls": 0})
        L = self.rt.num_layers
        return Generation(tokens, token_s[0], token_s, [L] * len(tokens), trace)


def peer_kwargs(peer: str, num_tokens: int, ngram_size: int, exit_layer: int | None) -> dict:
    """transformers' generate arguments for a peer."""
    return _KWARGS[peer](num_tokens, ngram_size, exit_layer)


def build_peer(cfg, rt, peer: str, eos_id=None, num_tokens: int | None = None, *, tuning):
    """A transformers ``generate`` peer (hf_pld, hf_self_spec, or hf_plain: the peers' own baseline)
    at the ablation's settings (``exit_layer=auto`` chosen by ``tuning``, specee/tuning/, recorded
    as ``choice``)."""
    a, choice, k = cfg.ablation, None, None
    if peer in NEEDS_EXIT_LAYER:
        k, choice = tuning.exit_layer(cfg, rt, eos_id)
    if num_tokens is None:
        num_tokens = a.num_tokens if a.num_tokens != "auto" else 10
    decoder = HFGenerateDecoder(rt.model, rt, peer, **peer_kwargs(peer, num_tokens, a.ngram_size, k))
    decoder.choice = choice
    return decoder


def not_applicable(decoder: HFGenerateDecoder, prompt_ids, eos_id) -> str | None:
    """Why transformers cannot run this peer on this model (one line), or None when it can: a short
    generation is tried, and transformers' own refusal is the reason."""
    try:
        decoder.generate(prompt_ids, 2, eos_id)
    except SpeceeError as err:
        return str(err)
    except (ValueError, TypeError, AttributeError, NotImplementedError, RuntimeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return f"transformers cannot run {decoder.name} on this model: {type(err).__name__}: {first[:300]}"
    return None
