"""Recipe: will SpecEE pay off on this model and machine? One command, minutes, before any training.

    python run.py experiment=potential model=smollm2_135m
    python run.py -m experiment=potential model=tiny,smollm2_135m   # one row per model in the report

Needs no draft head and no predictors (uses the draft when its folder exists). It measures:

* the **exit potential**: dense greedy continuations of the shipped prompts, and per generated
  token each layer's argmax (teacher-forced once): the share of tokens each layer already gets
  right (``agreement_by_layer``, per category) and the oracle floor — the first layer that is right
  (``first``) and the one from which it stays right (``stable``) — with a bootstrap interval over
  prompts;
* **unit costs** on this machine and runtime: one decoder layer, the LM head, a predictor call
  (probe + 12->512->1 MLP), a draft step (EAGLE-1: one decoder layer + LM head, measured when a
  draft exists, else priced as that), and the block cost c(n) of a verification forward — and
  the same units priced for a named GPU (analytic, labelled);
* **ceilings** — upper bounds, each assuming everything but the cost is perfect:
  ``specee_ar_perfect``: a predictor that is never wrong and costs nothing exits every token at its
  oracle floor; verification is one LM head, the draft step is paid every token;
  ``specee_ar_paper_predictors``: the same with the predictor calls SpecEE's schedule makes
  (one per layer up to the exit for T1; a third of them for T1+T2, the ratio measured on tiny);
  ``eagle_chain_best``: a draft whose every proposal is accepted, over chain lengths 1..16, at the
  measured c(n) (the best length is reported); ``specee_tree_best``: the same with exits at the floor
  inside the block (an upper bound for T1+T2+T3). Each "here" and "on the named GPU";
* **break-even**: the draft coverage (share of tokens whose final token is in the draft's top-k)
  at which SpecEE AR with perfect predictors matches dense, and the highest average exit layer at
  which it still does with full coverage;
* a **verdict** in plain words.

The suitability metric of arXiv 2603.23701 is not computed: its definition was not available to
this harness offline; the agreement curve and the oracle floor are the quantities it is built on.
"""
from __future__ import annotations

import random
import statistics
import time

import torch

from specee import data, results
from specee.cost_model import priced_work as cm
from specee.cost_model.block_costs import cost_of, measure_block_costs
from specee.bench.oracle import layer_predictions, oracle_layers
from specee.decoding.dense import DenseDecoder
from specee.errors import SpeceeError
from specee.io import project_path
from specee.models.loader import load_model
from specee.prompts import format_conversation
from specee.runtime.layerwise import LayerwiseLM

GPU = {"name": "analytic A100-80GB", "bandwidth_gb_s": 2039.0, "kernel_us": 4.0, "sync_us": 10.0}
T2_CALL_SHARE = 1 / 3  # predictor calls of T1+T2 per call of T1 (tiny: 10.4 / 27.1 per token)


def _time_us(fn, rounds: int, calls: int = 5) -> list[float]:
    fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append(1e6 * (time.perf_counter() - t0) / calls)
    return out


@torch.inference_mode()
def unit_costs(rt, context_ids, draft, rounds: int, k: int) -> dict:
    """Median us of the units a SpecEE step is made of, at ``context_ids``' context."""
    from specee.early_exit.predictor import PredictorBank
    cache = rt.new_cache(context_ids.shape[1] + 4)
    rt.forward(context_ids, cache)
    token = context_ids[:, -1:]
    pos = rt.positions(cache, 1)
    h = rt.embed(token)
    rope = rt.rope(h, pos)
    n0 = list(cache.lengths)

    def layer():
        rt.run_layer(0, h, rope, cache, None, pos)
        cache.lengths[0] = n0[0]

    def head():
        rt.lm_head(rt.norm(h)[0, 0]).argmax().item()
    with torch.inference_mode(False):  # the bank caches a transposed weight by version: normal tensors
        bank = PredictorBank.random(rt.num_layers, k, seed=0)
    spec = torch.arange(k, device=rt.device)
    w = rt.lm_head.weight[spec]

    def predictor():
        z = rt.norm(h)[0, 0] @ w.T
        p = torch.softmax(z.float(), -1)
        bool(bank.fires(0, torch.cat([z.float(), p, p - 1 / k])))
    units = {"layer": _time_us(layer, rounds), "lm_head": _time_us(head, rounds),
             "predictor": _time_us(predictor, rounds)}
    if draft is not None:
        dcache = draft.new_cache(context_ids.shape[1] + 8)
        f = rt.norm(h)

        def draft_step():
            draft.topk(draft(token, f, dcache), k).tolist()
            dcache.crop(0)
        units["draft_step"] = _time_us(draft_step, rounds)
        draft_source = "measured (the draft head's own step)"
    else:
        units["draft_step"] = [a + b for a, b in zip(units["layer"], units["lm_head"])]
        draft_source = "priced as one decoder layer + the LM head (an EAGLE-1 head; no draft here)"
    med = {u: statistics.median(v) for u, v in units.items()}
    return {"median_us": {u: round(v, 2) for u, v in med.items()}, "rounds": rounds, "draft_step": draft_source,
            "lm_head_over_layer": med["lm_head"] / med["layer"]}


def ceilings(L: int, floor: float, u: dict, block_us, k_calls_t1: float, top1: float | None = None) -> dict:
    """Upper bounds on speedup against dense from the per-token floor and unit costs ``u`` (us);
    ``block_us(n)``: one verification forward of n tokens (whole stack + head); ``block_us(1)`` is
    the dense step, and a layer-unit is (c(1) - LM head) / L."""
    # The whole dense step as measured (c(1)): a layer alone, timed in a loop, misses the per-step
    # work around it (embedding, positions, mask, the host read), so the layer-unit is taken from it.
    dense = block_us(1)
    u = {**u, "layer": (dense - u["lm_head"]) / L}
    ar = floor * u["layer"] + u["lm_head"] + u["draft_step"]
    out = {"layer_skip_only": {"speedup": L / floor, "assumes": "exits at the oracle floor, no draft, "
                                                               "predictor or verification cost"},
           "specee_ar_perfect": {"speedup": dense / ar, "assumes": "a free, never-wrong predictor; one "
                                                                   "verification head and one draft step per token"}}
    for name, share in (("t1", 1.0), ("t1_t2", T2_CALL_SHARE)):
        t = ar + share * k_calls_t1 * u["predictor"]
        out[f"specee_ar_paper_predictors_{name}"] = {
            "speedup": dense / t, "assumes": f"as specee_ar_perfect plus {share * k_calls_t1:.1f} predictor calls per token"}
    chains = {}
    for d in range(1, 17):  # a chain of d drafted tokens, all accepted: d + 1 tokens per step
        t = block_us(d + 1) + d * u["draft_step"]
        chains[d] = dense * (d + 1) / t
    best = max(chains, key=chains.get)
    lookup = {d: dense * (d + 1) / block_us(d + 1) for d in range(1, 17)}  # proposals that cost nothing
    lb = max(lookup, key=lookup.get)
    out["prompt_lookup_best"] = {"speedup": lookup[lb], "proposal_length": lb,
                                 "assumes": "every proposed token accepted, proposals free; c(n) per verification"}
    out["eagle_chain_best"] = {"speedup": chains[best], "draft_length": best,
                               "assumes": "every drafted token accepted; c(n) per verification",
                               "by_draft_length": {str(d): round(v, 4) for d, v in chains.items()}}
    if top1 is not None:  # the draft's own top-1 acceptance: a chain of d accepts 1 + p + ... + p^d tokens
        at = {d: dense * sum(top1 ** i for i in range(d + 1)) / (block_us(d + 1) + d * u["draft_step"])
              for d in range(1, 17)}
        b = max(at, key=at.get)
        out["eagle_chain_at_draft_acceptance"] = {
            "speedup": at[b], "draft_length": b, "assumes": f"each drafted token accepted with the draft's top-1 "
                                                          f"rate {top1:.3f}, independently; c(n) per verification"}
    tree = {d: dense * (d + 1) / (block_us(d + 1) * (floor / L) + d * u["draft_step"]) for d in range(1, 17)}
    tbest = max(tree, key=tree.get)
    out["specee_tree_best"] = {"speedup": tree[tbest], "draft_length": tbest,
                               "assumes": "eagle_chain_best with the block leaving the stack at the floor"}
    # break-even: coverage p of the draft, and the exit layer, at which SpecEE AR matches dense
    # (a token outside the draft's set runs the whole stack and pays the draft anyway)
    full = dense + u["draft_step"]
    gain = full - ar  # us saved per covered token
    out["break_even"] = {
        "draft_coverage": (u["draft_step"] / gain) if gain > 0 else None,
        "exit_layer_at_full_coverage": (dense - u["lm_head"] - u["draft_step"]) / u["layer"],
        "note": "coverage: share of tokens whose final token is in the draft's top-k; None: no coverage suffices"}
    return out


def run(cfg) -> dict:
    e = cfg.experiment
    out_dir = results.output_dir()
    prompts = data.load_prompt_set(project_path(cfg.paths.data_root), cfg.dataset)
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    rt = LayerwiseLM(model)
    L = rt.num_layers
    synthetic = cfg.model.init == "random"
    draft = None
    if cfg.draft.name != "none" and (project_path(cfg.draft.path) / "draft_card.json").is_file() and not synthetic:
        from specee.models.draft import load_draft
        draft, _ = load_draft(project_path(cfg.draft.path), rt)
    dense = DenseDecoder(rt)
    eos = tokenizer.eos_token_id
    per_prompt, agree_cat, contexts, coverage = [], {}, [], []
    for p in prompts:
        text = format_conversation(cfg.model.chat_template, [(p.turns[0], None)], tokenizer)
        ids = tokenizer(text, return_tensors="pt").input_ids.to(rt.device)
        gen = dense.generate(ids, cfg.dataset.max_new_tokens, eos)
        preds = layer_predictions(rt, ids, gen.tokens)
        if not len(preds):
            continue
        final = gen.tokens[1:]
        first, stable = oracle_layers(preds, final)
        same = (preds == torch.tensor(final).view(-1, 1)).float().mean(0).tolist()
        agree_cat.setdefault(p.category, []).append((len(final), same))
        per_prompt.append({"id": p.id, "category": p.category, "tokens": len(final),
                           "first": sum(first) / len(first), "stable": sum(stable) / len(stable),
                           "first_sum": sum(first), "stable_sum": sum(stable)})
        contexts.append(ids.shape[1] + len(gen.tokens) // 2)
        if draft is not None:
            coverage.append(_draft_coverage(rt, draft, ids, gen.tokens, cfg.early_exit.k))
    if not per_prompt:
        raise SpeceeError("no prompt produced two or more tokens; raise dataset.max_new_tokens")
    tokens = sum(r["tokens"] for r in per_prompt)
    floor = {key: sum(r[f"{key}_sum"] for r in per_prompt) / tokens for key in ("first", "stable")}
    interval = {key: _bootstrap(per_prompt, key, cfg.seed) for key in ("first", "stable")}
    agreement = {cat: [sum(n * s[i] for n, s in rows) / sum(n for n, _ in rows) for i in range(L)]
                 for cat, rows in agree_cat.items()}
    agreement["all"] = [sum(n * s[i] for rows in agree_cat.values() for n, s in rows) / tokens for i in range(L)]

    context = int(statistics.median(contexts))
    ctx_ids = torch.randint(1, rt.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(cfg.seed)
                            ).to(rt.device)  # synthetic ids: only the context length matters for cost
    units = unit_costs(rt, ctx_ids, draft, e.rounds, cfg.early_exit.k)
    blocks = measure_block_costs(rt, ctx_ids, tuple(range(1, 18)), rounds=max(3, e.rounds // 4))
    top1 = statistics.fmean(x[0] for x in coverage) if coverage else None
    here = ceilings(L, floor["first"], units["median_us"], lambda n: cost_of(blocks, n), floor["first"], top1)
    c = rt.config
    shape = {"hidden": c.hidden_size, "heads": c.num_attention_heads,
             "kv_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
             "intermediate": c.intermediate_size, "vocab": c.vocab_size, "num_layers": L}
    gpu_units = cm.analytic_unit_costs(shape, GPU["bandwidth_gb_s"], GPU["sync_us"], GPU["kernel_us"], context)
    g = gpu_units["median_us"]
    gpu_block = lambda n: g["dense_step"]  # noqa: E731 - bandwidth-bound: flat in n
    on_gpu = ceilings(L, floor["first"], g, gpu_block, floor["first"], top1)
    params_ratio = c.vocab_size * c.hidden_size / cm.layer_params(shape)
    head_us = units["median_us"]["lm_head"]
    units["layer_unit_us"] = round((cost_of(blocks, 1) - head_us) / L, 2)  # (c(1) - head) / L
    units["lm_head_over_layer"] = head_us / units["layer_unit_us"]
    m = {
        "model": cfg.model.name, "num_layers": L, "vocab_size": c.vocab_size,
        "lm_head_over_layer_by_params": params_ratio, "lm_head_over_layer_by_time": units["lm_head_over_layer"],
        "tokens": tokens, "prompts": len(per_prompt),
        "oracle_floor": {"first": floor["first"], "stable": floor["stable"], "interval_95": interval,
                         "interval_method": "bootstrap over prompts (2000 resamples)"},
        "agreement_by_layer": agreement,
        "unit_costs": {"here": units, "block_costs": blocks,
                       "gpu": {"name": GPU["name"], "method": gpu_units["method"], "median_us": g}},
        "draft_coverage": ({"top1": statistics.fmean(x[0] for x in coverage),
                            f"top{cfg.early_exit.k}": statistics.fmean(x[1] for x in coverage)} if coverage else None),
        "ceilings": {"here": here, "gpu": on_gpu},
        "synthetic": ("random-init weights: the agreement, floor and ceilings mean nothing; only the unit "
                      "costs are real" if synthetic else None),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    m["verdict"] = verdict(m)
    path = results.save(out_dir, cfg, m, {"per_prompt": per_prompt})
    print(f"{cfg.model.name}: {L} layers, vocabulary {c.vocab_size}; LM head = {params_ratio:.2f} layers by "
          f"parameters, {units['lm_head_over_layer']:.2f} by time here")
    print(f"oracle floor {floor['first']:.2f} [{interval['first'][0]:.2f}, {interval['first'][1]:.2f}] / {L} "
          f"(stays right from {floor['stable']:.2f}), {tokens} tokens from {len(per_prompt)} prompts")
    for name, v in here.items():
        if "speedup" in v:
            print(f"  ceiling {name}: {v['speedup']:.2f}x here, {on_gpu[name]['speedup']:.2f}x on {GPU['name']}")
    print(m["verdict"])
    print(f"wrote {path} in {m['seconds']:.0f} s")
    return m


def verdict(m: dict) -> str:
    here, gpu = m["ceilings"]["here"], m["ceilings"]["gpu"]
    L, f = m["num_layers"], m["oracle_floor"]["first"]
    ar = "specee_ar_paper_predictors_t1_t2"
    be = here["break_even"]
    cov = be["draft_coverage"]
    words = (f"On this model and machine autoregressive SpecEE (T1+T2) can at best reach {here[ar]['speedup']:.2f}x "
             f"dense (every token exits at its oracle floor, {f:.1f} of {L} layers, and no exit is ever wrong); "
             f"on {m['unit_costs']['gpu']['name']} at best {gpu[ar]['speedup']:.2f}x. ")
    if "eagle_chain_at_draft_acceptance" in here:
        ch = here["eagle_chain_at_draft_acceptance"]
        words += (f"A draft chain at this draft's acceptance reaches at best {ch['speedup']:.2f}x here "
                  f"(length {ch['draft_length']}), {gpu['eagle_chain_at_draft_acceptance']['speedup']:.2f}x on the GPU. ")
    else:
        words += (f"A perfect draft chain would reach {here['eagle_chain_best']['speedup']:.2f}x here (no draft to "
                  "measure its acceptance). ")
    if cov is None or cov > 1:
        words += "Autoregressive SpecEE cannot break even here: a token's draft step costs more than its exit saves."
    else:
        words += (f"Autoregressive SpecEE breaks even only if the draft's top-k holds the final token for at least "
                  f"{100 * cov:.0f} % of tokens and the average exit stays below layer "
                  f"{be['exit_layer_at_full_coverage']:.1f}.")
    if m.get("draft_coverage"):
        words += f" The draft here covers {100 * list(m['draft_coverage'].values())[1]:.0f} % (top-k)."
    if m.get("synthetic"):
        words = "SYNTHETIC (random-init weights): " + words
    return words


def _bootstrap(rows: list[dict], key: str, seed: int, n_boot: int = 2000) -> list[float]:
    rng = random.Random(seed)
    vals = []
    for _ in range(n_boot):
        pick = [rows[rng.randrange(len(rows))] for _ in rows]
        vals.append(sum(r[f"{key}_sum"] for r in pick) / sum(r["tokens"] for r in pick))
    vals.sort()
    return [vals[int(0.025 * (n_boot - 1))], vals[int(0.975 * (n_boot - 1))]]


@torch.inference_mode()
def _draft_coverage(rt, draft, ids, tokens: list[int], k: int) -> tuple[float, float]:
    """Share of the dense tokens that are the draft's top-1 / in its top-k, teacher-forced."""
    full = torch.cat([ids, torch.tensor([tokens], device=ids.device)], 1)
    cache = rt.new_cache(full.shape[1])
    f = rt.norm(rt.forward(full[:, :-1], cache))
    dcache = draft.new_cache(full.shape[1])
    top = draft.topk(draft(full[:, 1:], f, dcache)[:, ids.shape[1] - 1:], k)  # rows predicting tokens[1:]
    top = top.view(-1, k)[:len(tokens) - 1]
    want = torch.tensor(tokens[1:], device=top.device)
    return float((top[:, 0] == want).float().mean()), float((top == want[:, None]).any(-1).float().mean())
