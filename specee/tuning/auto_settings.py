"""Settings chosen from what is measured here rather than fixed for every machine: prompt lookup's
proposal length (``ablation.num_tokens=auto``) and the self-speculation draft depth
(``ablation.exit_layer=auto``). Both read the one block-cost table c(n)
(:mod:`specee.cost_model.block_costs`) measured on this machine and runtime, and statistics measured on
calibration prompts disjoint from evaluation (Spec-Bench from the calibration offset on).

**Proposal length.** Prompt lookup is lossless, so its whole trajectory for a proposal length N
can be replayed exactly over dense greedy tokens: at each step the proposal is what
:func:`specee.decoding.pld.propose` returns for the text so far, the accepted prefix is where it
agrees with the dense tokens, the step verifies a block of len(proposal) + 1 tokens. The step
blocks priced with c(n) give the expected time per token for every N at once; the N with the
least is chosen. On a CPU c(n) is not monotone (a block of 4-5 tokens can cost less than one of
2-3), which is why no single N serves every machine.

**Self-speculation depth.** A draft of the model's first k layers and its own head proposes the
token the full stack emits with probability a(k), the share of calibration tokens whose layer-k
argmax already equals the final token (the exit statistics ``experiment=potential`` reports as
``agreement_by_layer``). A draft token costs (k + h) / (L + h) of a dense step (h: the LM head
in layers, measured), a verification of g drafted tokens c(g + 1). With independent acceptance
(Leviathan et al. 2023) a step yields (1 - a^(g+1)) / (1 - a) tokens; k and g are chosen to
maximise tokens per unit time. It is a model, reported with its prediction; transformers decides
its own draft lengths at run time (``num_assistant_tokens``), which is passed as the chosen g.
"""
from __future__ import annotations

import torch

from specee.cost_model.block_costs import cost_of, measure_block_costs

MAX_PROPOSAL = 16  # proposal lengths considered (blocks up to 17 tokens are measured)


def calibration_inputs(cfg, rt, n_prompts: int, new_tokens: int, categories=None, stories: bool = True):
    """Encoded calibration prompts (Spec-Bench from the calibration offset on, and story openings
    unless ``stories`` is False), spread evenly over the set; with ``categories`` only those
    Spec-Bench categories. Returns (ids list, prompt ids, data files)."""
    from omegaconf import OmegaConf

    from specee import data
    from specee.config import CalibrationConfig
    from specee.io import project_path
    from specee.models.loader import load_tokenizer
    from specee.prompts import PromptEncoder, format_conversation
    c = OmegaConf.structured(CalibrationConfig)
    if categories:
        c.spec_bench_categories = list(categories)
    if not stories:
        c.story_prompts = 0
    prompts, files = data.calibration_prompts(project_path(cfg.paths.data_root), c)
    step = max(1, len(prompts) // n_prompts)
    picked = prompts[::step][:n_prompts]
    tokenizer = load_tokenizer(cfg.model)
    encode = PromptEncoder.for_runtime(tokenizer, rt, new_tokens)
    ids = [encode(format_conversation(cfg.model.chat_template, [(p.turns[0], None)], tokenizer), p.id)
           for p in picked]
    return ids, [p.id for p in picked], files


def replay_lookup_blocks(prompt: list[int], tokens: list[int], num_tokens: int, ngram_size: int,
                         eos_id: int | None = None, budget: int | None = None) -> list[int]:
    """The verification block sizes prompt lookup with ``num_tokens`` takes to emit ``tokens``
    (dense greedy, the first from the prefill) after ``prompt``: exact for a lossless method."""
    from specee.decoding.pld import propose
    budget = budget if budget is not None else len(tokens)
    max_length = len(prompt) + budget
    ids, i, blocks = list(prompt) + tokens[:1], 1, []
    while i < len(tokens):
        cand = propose(ids, num_tokens, ngram_size, eos_id, max_length)
        a = 0
        while a < len(cand) and i + a < len(tokens) and cand[a] == tokens[i + a]:
            a += 1
        emitted = min(a + 1, len(tokens) - i)
        blocks.append(len(cand) + 1)
        ids += tokens[i:i + emitted]
        i += emitted
    return blocks


def choose_num_tokens(replays: dict[int, list[list[int]]], block_us, decode_tokens: int) -> dict:
    """``replays[N]``: the block sizes of every calibration generation at proposal length N;
    ``block_us(n)``: c(n); ``decode_tokens``: the tokens those steps emit. The N with the most
    tokens per unit time, and the predicted speedup of every N against dense (c(1) per token)."""
    dense = block_us(1) * decode_tokens
    predicted, tau = {}, {}
    for n, gens in replays.items():
        steps = [b for g in gens for b in g]
        predicted[n] = dense / sum(block_us(b) for b in steps) if steps else 1.0
        tau[n] = decode_tokens / len(steps) if steps else 1.0
    best = max(predicted, key=lambda n: (round(predicted[n], 9), -n))  # ties: the shorter proposal
    return {"chosen": best, "predicted_speedup": predicted[best], "pays": predicted[best] > 1.0,
            "predicted_speedup_by_num_tokens": {str(n): round(v, 4) for n, v in predicted.items()},
            "tokens_per_step_by_num_tokens": {str(n): round(v, 4) for n, v in tau.items()}}


_CHOSEN: dict = {}  # one choice per runtime and setting: a job builds its decoder more than once


@torch.inference_mode()
def dense_calibration(cfg, rt, eos_id, new_tokens: int):
    """Dense greedy continuations of ``ablation.lookup_calibration_prompts`` calibration prompts (the
    evaluation's Spec-Bench categories when it reads Spec-Bench): (inputs, tokens, prompt ids, files)."""
    from specee.decoding.dense import DenseDecoder
    cats = cfg.dataset.categories if cfg.dataset.source == "spec_bench" else None
    inputs, ids, files = calibration_inputs(cfg, rt, cfg.ablation.lookup_calibration_prompts, new_tokens, cats,
                                            stories=False)
    dense = DenseDecoder(rt)
    return inputs, [dense.generate(x, new_tokens, eos_id).tokens for x in inputs], ids, files


@torch.inference_mode()
def auto_num_tokens(cfg, rt, eos_id) -> dict:
    """``ablation.num_tokens=auto``: dense greedy on ``ablation.lookup_calibration_prompts``
    calibration prompts (the evaluation's Spec-Bench categories when it reads Spec-Bench), replayed
    for N = 1..16, priced with c(n) measured here."""
    a = cfg.ablation
    key = ("lookup", id(rt), a.ngram_size, a.lookup_calibration_prompts, cfg.dataset.max_new_tokens, eos_id)
    if key in _CHOSEN:
        return _CHOSEN[key]
    new_tokens = min(cfg.dataset.max_new_tokens, 128)
    inputs, tokens, ids, files = dense_calibration(cfg, rt, eos_id, new_tokens)
    gens = [(x[0].tolist(), t) for x, t in zip(inputs, tokens)]
    replays = {n: [replay_lookup_blocks(p, t, n, a.ngram_size, eos_id, new_tokens) for p, t in gens]
               for n in range(1, MAX_PROPOSAL + 1)}
    decode_tokens = sum(len(t) - 1 for _, t in gens)
    context = max(inputs, key=lambda t: t.shape[1])[:, -256:]
    table = measure_block_costs(rt, context, sizes=range(1, MAX_PROPOSAL + 2), rounds=6)
    out = choose_num_tokens(replays, lambda n: cost_of(table, n), decode_tokens)
    out.update({"block_costs": table, "calibration_prompt_ids": ids, "data_files": files,
                "calibration_tokens": decode_tokens, "ngram_size": a.ngram_size,
                "method": "exact replay of prompt lookup over dense greedy tokens of calibration prompts for "
                          "N = 1..16, each step's block priced with c(n) measured here; the N with the most "
                          "tokens per unit time"})
    _CHOSEN[key] = out
    return out


def self_spec_speedup(agreement: float, k: int, L: int, head_layers: float, block_ratio, drafted: int) -> float:
    """Modelled speedup of early-exit self-speculation: drafts of ``k`` layers + head accepted with
    probability ``agreement`` each (independently), ``drafted`` per step, one verification block
    of drafted + 1 tokens (``block_ratio(n)`` = c(n) / c(1))."""
    a = min(max(agreement, 0.0), 1.0 - 1e-9)
    tokens = (1 - a ** (drafted + 1)) / (1 - a)
    draft = drafted * (k + head_layers) / (L + head_layers)
    return tokens / (draft + block_ratio(drafted + 1))


def choose_exit_layer(agreement_by_layer: list[float], head_layers: float, block_ratio, max_drafted: int = 10) -> dict:
    """The draft depth k (1..L-1) and draft length g with the highest modelled speedup."""
    L = len(agreement_by_layer)
    if L < 2:
        raise ValueError("self-speculation needs at least two layers")
    best = None
    by_layer = {}
    for k in range(1, L):
        g, s = max(((g, self_spec_speedup(agreement_by_layer[k - 1], k, L, head_layers, block_ratio, g))
                    for g in range(1, max_drafted + 1)), key=lambda x: x[1])
        by_layer[str(k)] = {"speedup": round(s, 4), "drafted": g, "agreement": round(agreement_by_layer[k - 1], 4)}
        if best is None or s > best[2]:
            best = (k, g, s)
    return {"chosen": best[0], "drafted_per_step": best[1], "predicted_speedup": best[2], "by_exit_layer": by_layer}


@torch.inference_mode()
def auto_exit_layer(cfg, rt, eos_id) -> dict:
    """``ablation.exit_layer=auto``: agreement by layer on calibration prompts (dense greedy
    tokens, every layer's argmax teacher-forced once), the LM head's cost in layers and c(n)
    measured here."""
    from specee.bench.oracle import layer_predictions
    a = cfg.ablation
    key = ("self_spec", id(rt), a.lookup_calibration_prompts, cfg.dataset.max_new_tokens, eos_id)
    if key in _CHOSEN:
        return _CHOSEN[key]
    inputs, tokens, ids, files = dense_calibration(cfg, rt, eos_id, min(cfg.dataset.max_new_tokens, 64))
    same, n = torch.zeros(rt.num_layers), 0  # on the host: layer_predictions returns CPU tensors
    for x, toks in zip(inputs, tokens):
        preds = layer_predictions(rt, x, toks)
        if len(preds):
            same += (preds == torch.tensor(toks[1:]).view(-1, 1)).float().sum(0)
            n += len(preds)
    agreement = (same / max(n, 1)).tolist()
    context = max(inputs, key=lambda t: t.shape[1])[:, -256:]
    table = measure_block_costs(rt, context, sizes=range(1, 12), rounds=6)
    head_layers = _head_in_layers(rt, context)
    out = choose_exit_layer(agreement, head_layers, lambda m: cost_of(table, m) / cost_of(table, 1))
    out.update({"agreement_by_layer": [round(x, 4) for x in agreement], "lm_head_over_layer": round(head_layers, 3),
                "calibration_tokens": n, "calibration_prompt_ids": ids, "data_files": files, "block_costs": table,
                "method": "agreement by layer (layer-k argmax == final token) on calibration prompts; a draft token "
                          "costs (k + h) / (L + h) of a dense step, a verification c(g + 1); independent acceptance; "
                          "the (k, g) with the highest modelled speedup"})
    _CHOSEN[key] = out
    return out


def _head_in_layers(rt, context_ids, rounds: int = 7) -> float:
    """The LM head's time over one decoder layer's, at this context (medians of short loops)."""
    import statistics
    import time
    cache = rt.new_cache(context_ids.shape[1] + 2)
    rt.forward(context_ids, cache)
    pos = rt.positions(cache, 1)
    h = rt.embed(context_ids[:, -1:])
    rope = rt.rope(h, pos)
    n0 = cache.lengths[0]

    def layer():
        rt.run_layer(0, h, rope, cache, None, pos)
        cache.lengths[0] = n0

    def head():
        rt.lm_head(rt.norm(h)[0, 0]).argmax().item()

    def med(fn):
        fn()
        xs = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            xs.append(time.perf_counter() - t0)
        return statistics.median(xs)
    return med(head) / med(layer)


def exit_layer(cfg, rt, eos_id) -> tuple[int, dict | None]:
    """The self-speculation draft depth ``ablation.exit_layer`` asks for, and the choice behind it:
    ``auto`` chosen here from measurements (:func:`auto_exit_layer`), a number checked against the
    model's layers."""
    from specee.config import check_exit_layer_text
    from specee.errors import SpeceeError
    k = cfg.ablation.exit_layer
    if k == "auto":
        choice = auto_exit_layer(cfg, rt, eos_id)
        return choice["chosen"], choice
    if k >= rt.num_layers:
        raise SpeceeError(check_exit_layer_text(k, rt.num_layers))
    return k, None
