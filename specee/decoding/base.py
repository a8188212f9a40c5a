"""The decoder interface, the one generation loop, and the clocks it is timed with.

Every decoding mode implements two verbs (gpt-fast's split): ``prefill(prompt_ids, max_new_tokens)``
returns a per-request session and the first token; ``step(session)`` advances one decoding step and
returns a :class:`Step` (the tokens it emits, the layer they exited at, its trace). :func:`generate`
owns everything else — the clock, EOS, the token budget, per-token times and the trace — once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, TypedDict

import torch

from specee.phases import PHASES, Clock, PhaseTimer  # noqa: F401 - the decoders' clocks, imported from here


class StepTrace(TypedDict, total=False):
    """What a step records (early-exit, tree and lookup modes): the keys every reader of a trace
    may rely on, and what each means. Counts are per step; times in seconds (PhaseTimer.trace)."""
    exit_layer: int  # 0-based layer the step's tokens left the stack at (L-1: the full stack)
    layers: int  # layers run (exit_layer + 1)
    pred_calls: int  # predictor evaluations
    verify_calls: int  # full LM-head verifications (fired predictors)
    delta_probes: int  # reduced-head probes computed only as the next predictor's p_prev
    walk_syncs: int  # host round trips inside the layer walk (0 with exits decided on the device)
    wasted_layers: int  # exit_control=lookahead: layers queued behind a decision that exited
    syncs: int  # host reads of device values in the whole step
    spec: list  # the speculative token ids (autoregressive SpecEE)
    spec_source: str  # prompt | draft (SpecEE with prompt-lookup speculation)
    draft_calls: int  # draft-head proposals this step (prompt lookup: 0 when the prompt served)
    replay_target: int  # early_exit.replay: the layer the replay asked for
    shadow_exit_layer: int  # shadow mode: where the all-layers policy would have exited
    nodes: int  # tree / block: tokens verified in this step's forward
    accepted: int  # tokens a verification accepted, bonus included (tau)
    walk_ranks: list  # tree: the draft rank of each accepted node below the root
    emitted: int  # tokens the step emitted within the budget (multi-token modes)
    head_rows: int  # LM-head rows computed (tree verification)
    proposed: int  # prompt lookup: tokens proposed
    matched: bool  # prompt lookup: an n-gram matched
    t_layers: float
    t_pred: float
    t_verify: float
    t_draft: float
    t_other: float


@dataclass
class Step:
    tokens: list[int]  # emitted by this step, in order (autoregressive: one; tree: walk + bonus)
    exit_layer: int  # 0-based layer the step's tokens left the stack at (L-1: the full stack)
    trace: StepTrace | None = None  # early-exit modes: counters and phase times


class Decoder(Protocol):
    name: str
    multi_token: bool  # a step may emit several tokens (tree decoding)

    def prefill(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> tuple[Any, int]: ...

    def step(self, session) -> Step: ...


@dataclass
class Generation:
    tokens: list[int]
    prefill_s: float
    token_s: list[float]  # wall time of each generated token (the first one comes from prefill)
    layers_run: list[int]  # decoder layers run for each generated token (dense: all; a step's exit_layer + 1)
    trace: list[StepTrace] = field(default_factory=list)  # per-step details of early-exit modes

    @property
    def decode_s(self) -> float:
        return sum(self.token_s[1:])


class Request:
    """One generation in flight: ``start()`` runs the prefill, each ``advance()`` one decoding
    step, each timed on its own. :func:`generate` drives one request to its end;
    :func:`generate_lockstep` drives several decoders' requests on the same prompt step by step
    in turn, so that a slow spell of the machine falls on every side alike."""

    def __init__(self, decoder: "Decoder", prompt_ids: torch.Tensor, max_new_tokens: int,
                 eos_id: int | None = None, stop: Callable[[list[int]], bool] | None = None):
        self.decoder, self.prompt_ids, self.max_new_tokens = decoder, prompt_ids, max_new_tokens
        self.eos_id, self.stop = eos_id, stop
        self.clock = Clock(decoder.rt.device)
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.layers: list[int] = []
        self.trace: list[dict] = []

    @torch.inference_mode()
    def start(self) -> None:
        t0 = self.clock()
        self.session, first = self.decoder.prefill(self.prompt_ids, self.max_new_tokens)
        self.tokens, self.times, self.layers = [first], [self.clock() - t0], [self.decoder.rt.num_layers]

    def done(self) -> bool:
        t = self.tokens
        return (len(t) >= self.max_new_tokens or t[-1] == self.eos_id
                or (self.stop is not None and self.stop(t)))

    @torch.inference_mode()
    def advance(self) -> None:
        """One step. A multi-token step stops exactly where dense would (tokens past the end are
        dropped) and its time is shared equally by the tokens it emitted."""
        t0 = self.clock()
        step = self.decoder.step(self.session)
        emitted = 0
        for tok in step.tokens:
            if self.done():
                break
            self.tokens.append(tok)
            emitted += 1
        dt = self.clock() - t0
        self.times += [dt / emitted] * emitted
        self.layers += [step.exit_layer + 1] * emitted
        if step.trace is not None:
            self.trace.append(step.trace | ({"emitted": emitted} if self.decoder.multi_token else {}))

    def result(self) -> "Generation":
        return Generation(self.tokens, self.times[0], self.times, self.layers, self.trace)


def generate(decoder: Decoder, prompt_ids: torch.Tensor, max_new_tokens: int,
             eos_id: int | None = None, stop: Callable[[list[int]], bool] | None = None) -> Generation:
    """Greedy generation with any decoder: prefill, then steps until EOS, the token budget or
    ``stop(tokens)`` (e.g. a stop string in the text so far), checked after every token."""
    req = Request(decoder, prompt_ids, max_new_tokens, eos_id, stop)
    req.start()
    while not req.done():
        req.advance()
    return req.result()


def generate_lockstep(decoders: list, prompt_ids: torch.Tensor, max_new_tokens: int,
                      eos_id: int | None = None, flip: bool = False, seed: int = 0) -> list[Generation]:
    """The same prompt through several decoders, step by step in turn (prefills too): paired
    timings whose ratio is not moved by the machine's drift. The order changes every round so no
    side always follows another: two sides alternate (A B | B A | A B ..., from B A with ``flip``),
    each running twice in a row equally often; more sides take a seeded shuffle per round (a fixed
    reversal would leave the middle one never running back to back, which biases it). Each
    generation is the one ``generate`` gives (each decoder has its own session and cache); a
    decoder that finished drops out of the rounds."""
    import random
    rng = random.Random(seed)
    reqs = [Request(d, prompt_ids, max_new_tokens, eos_id) for d in decoders]

    def rounds():
        order = reqs[::-1] if flip else list(reqs)
        while True:
            yield order
            if len(reqs) == 2:
                order = order[::-1]
            else:
                order = list(reqs)
                rng.shuffle(order)
    schedule = rounds()
    for r in next(schedule):
        r.start()
    for order in schedule:
        live = [r for r in order if not r.done()]
        if not live:
            return [r.result() for r in reqs]
        for r in live:
            r.advance()


class LoopDecoder:
    """Gives a decoder ``generate`` through the one loop, and a phase timer."""
    multi_token = False
    profile_phases = False  # CUDA: synchronized phase reads (a profiling pass)

    def timer(self) -> PhaseTimer:
        return PhaseTimer(self.rt.device, self.profile_phases)

    def generate(self, prompt_ids, max_new_tokens: int, eos_id: int | None = None,
                 stop: Callable[[list[int]], bool] | None = None) -> Generation:
        return generate(self, prompt_ids, max_new_tokens, eos_id, stop)


@dataclass
class TokenSession:
    cache: Any  # the runtime's per-layer K/V cache
    token: torch.Tensor  # last emitted token (on the runtime's device)


class DecidesAfterEachLayer:
    """``prefill``, ``step`` and ``score`` for a decoder that decides after each layer on its own,
    with no draft (AdaInfer, the exit rules): it supplies ``decode_one_token(token, cache, timer)``
    returning (token, exit layer, the exit layer's logits, trace). ``score`` is teacher forcing, each
    position's log-probs from the layer it exited at (``exit_at_context_end``: the context's last
    token is a decision too, as in SpecEEDecoder.score)."""

    @torch.inference_mode()
    def prefill(self, prompt_ids, max_new_tokens: int):
        rt = self.rt
        cache = rt.new_cache(prompt_ids.shape[1] + max_new_tokens)
        token = rt.logits(rt.forward(prompt_ids, cache)[:, -1:])[0, -1].argmax()
        return TokenSession(cache, token), int(token)

    @torch.inference_mode()
    def step(self, s: TokenSession) -> "Step":
        timer = self.timer()
        timer.start()
        s.token, exit_layer, _, trace = self.decode_one_token(s.token, s.cache, timer)
        return Step([timer.host_int(s.token)], exit_layer, trace | timer.trace())

    @torch.inference_mode()
    def score(self, context_ids: torch.Tensor, continuation: list[int],
              exit_at_context_end: bool = True) -> "Score":
        rt = self.rt
        cache = rt.new_cache(context_ids.shape[1] + len(continuation))
        steps = list(continuation[:-1])
        rows, layers = [], []
        if exit_at_context_end and context_ids.shape[1] > 1:
            rt.forward(context_ids[:, :-1], cache)
            steps = [int(context_ids[0, -1])] + steps
        else:
            rows, layers = [rt.logits(rt.forward(context_ids, cache)[:, -1:])[0, -1]], [rt.num_layers]
        timer = self.timer()
        ids = torch.tensor(steps, device=rt.device)
        for j in range(len(steps)):
            _, exit_layer, logits, _ = self.decode_one_token(ids[j], cache, timer)
            rows.append(logits)
            layers.append(exit_layer + 1)
        return score_from_logits(torch.stack(rows), continuation, layers)


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
