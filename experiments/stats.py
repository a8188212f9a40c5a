"""Recipe: exit-layer statistics and predictor placements side by side (SpecEE §5).

    python run.py experiment=stats model=tiny dataset.count=2

On the same evaluation prompts, in one run, interleaved per prompt: dense, then SpecEE with each
placement in ``experiment.placements``. From the all-layers run: the exit-layer distribution and
its skew, and the context-similarity hit rate for N = 1..max_n beside two chance levels, per
Spec-Bench category and overall. A final untimed pass of the scheduled decoder in shadow mode
counts exits missed because their layer was not scheduled.
"""
from __future__ import annotations

from collections import defaultdict

from omegaconf import OmegaConf
from tqdm import tqdm

from specee.bench.exit_metrics import early_exit_metrics
from specee.bench.inputs import check_disjoint_from_calibration, generation_eos, load_prompts
from specee import results
from specee.bench.exit_stats import context_similarity, distribution
from specee.bench.oracle import layer_predictions, oracle_layers, oracle_summary
from specee.bench.speed import match_rate, speed_metrics
from specee.builders import build_decoder
from specee.decoding import modes
from specee.decoding.dense import DenseDecoder
from specee.early_exit.schedule import default_window
from specee.errors import SpeceeError
from specee.io import PROJECT_ROOT
from specee.models.loader import load_model
from specee.prompts import PromptEncoder
from specee.runtime.build import build_runtime


def placement_node(cfg, name: str):
    path = PROJECT_ROOT / "conf" / "placement" / f"{name}.yaml"
    if not path.is_file():
        raise SpeceeError(f"experiment.placements has unknown {name!r}; valid: "
                          f"{sorted(p.stem for p in path.parent.glob('*.yaml'))}")
    preset = OmegaConf.load(path)
    preset.pop("defaults", None)
    return OmegaConf.merge(cfg.placement, preset)


def run(cfg) -> dict:
    out = results.output_dir()
    e = cfg.experiment
    prompts = load_prompts(cfg)
    model, tokenizer = load_model(cfg.model)
    rt = build_runtime(cfg.runtime, model)
    L, eos, n_new = rt.num_layers, generation_eos(cfg, tokenizer), cfg.dataset.max_new_tokens
    # The statistics are about per-token exit layers under each placement: they always run the
    # autoregressive SpecEE decoder, whatever the ablation (tree ablations included), and say so.
    specee_cfg = modes.as_specee_ar(cfg)
    if not modes.is_specee_ar(cfg.ablation):
        print(f"note: stats measure the autoregressive SpecEE decoder; ablation={cfg.ablation.name} "
              "contributes only its early_exit settings")
    check_disjoint_from_calibration(specee_cfg, prompts)
    decoders = {name: build_decoder(specee_cfg, rt, placement=placement_node(cfg, name))
                for name in e.placements}
    dense = DenseDecoder(rt)
    encode = PromptEncoder.for_runtime(tokenizer, rt, n_new)
    encoded = [encode(p["text"], p["id"]) for p in prompts]
    if encode.note():
        print(f"note: {encode.note()}")
    for ids in encoded[: e.warmup]:
        dense.generate(ids, 8, eos)
        for d in decoders.values():
            d.generate(ids, 8, eos)

    gens = defaultdict(list)
    for ids in tqdm(encoded, desc="stats: dense + placements"):
        gens["dense"].append(dense.generate(ids, n_new, eos))
        for name, d in decoders.items():
            gens[name].append(d.generate(ids, n_new, eos))

    d_metrics = speed_metrics(gens["dense"], L)
    rows = {}
    for name in decoders:
        m = speed_metrics(gens[name], L)
        m["speedup_vs_dense"] = m["decode_tokens_per_s"] / d_metrics["decode_tokens_per_s"]
        m["match_rate_vs_dense"] = match_rate([g.tokens for g in gens["dense"]], [g.tokens for g in gens[name]])
        m.update(early_exit_metrics(gens[name], m))
        rows[name] = m

    # The floor under every placement's avg_layers: the earliest layer that already predicts the
    # dense token (untimed, after the timed passes).
    first, stable = [], []
    for ids, g in zip(encoded, gens["dense"]):
        f, st = oracle_layers(layer_predictions(rt, ids, g.tokens), g.tokens[1:])
        first += f
        stable += st
    oracle = oracle_summary(first, stable, L)
    for m in rows.values():
        m["avg_layers_over_oracle"] = m["avg_layers"] / oracle["oracle_avg_layers"] if first else None

    metrics = {"placements": rows, "dense": d_metrics, "oracle": oracle,
               "oracle_avg_layers": oracle.get("oracle_avg_layers"),
               "stats_decoder": "specee autoregressive (per-token exit layers; tree ablations are "
                                "studied through it)"}
    reference = "all_layers" if "all_layers" in gens else next(iter(decoders))
    w = cfg.placement.window if cfg.placement.window is not None else default_window(L)
    by_cat = defaultdict(list)
    for p, g in zip(prompts, gens[reference]):
        by_cat[p["category"]].append([t["exit_layer"] for t in g.trace])
    by_cat["all"] = [s for c in list(by_cat) for s in by_cat[c]]
    metrics["exit_distribution"] = {c: distribution([x for s in seqs for x in s], L) for c, seqs in by_cat.items()}
    metrics["skew_bottom_half_by_probability"] = metrics["exit_distribution"]["all"]["skew_bottom_half_by_probability"]
    metrics["context_similarity"] = {"window": w, "from": reference, "per_category": {
        c: context_similarity(seqs, w, L, e.max_n) for c, seqs in by_cat.items()}}

    scheduled = [n for n in decoders if n != "all_layers"]
    if scheduled and "all_layers" in rows:
        base = rows["all_layers"]["predictor_calls_per_token"]
        metrics["predictor_calls_reduction"] = {
            n: 1 - rows[n]["predictor_calls_per_token"] / base for n in scheduled}
        metrics["avg_layers_vs_all_layers"] = {n: rows[n]["avg_layers"] - rows["all_layers"]["avg_layers"]
                                               for n in scheduled}
    missed = {}
    for name in scheduled:
        shadow = build_decoder(specee_cfg, rt, placement=placement_node(cfg, name), shadow=True)
        trace = [t for ids in tqdm(encoded, desc=f"shadow {name}")
                 for t in shadow.generate(ids, n_new, eos).trace]
        late = [t["exit_layer"] - t["shadow_exit_layer"] for t in trace if t["shadow_exit_layer"] < t["exit_layer"]]
        missed[name] = {"tokens": len(trace), "missed_exit_share": len(late) / max(1, len(trace)),
                        "extra_layers_per_token": sum(late) / max(1, len(trace))}
    metrics["missed_exits"] = missed
    metrics["truncated_prompts"] = len(encode.truncated)
    metrics["truncated"] = encode.record()
    path = results.save(out, cfg, metrics, {"prompts": [{"id": p["id"], "category": p["category"]} for p in prompts]})
    _print_summary(metrics, rows)
    print(f"wrote {path}")
    return metrics


def _print_summary(metrics: dict, rows: dict) -> None:
    d = metrics["exit_distribution"]["all"]
    print(f"exit layers: {d['tokens']} tokens, bottom half by exit probability "
          f"{d['skew_bottom_half_by_probability']:.2f} (paper: <= 0.20), shallower half by depth "
          f"{d['share_of_exits_in_shallower_half_by_depth']:.2f}, layers below uniform "
          f"{d['share_of_layers_below_uniform']:.2f}, no exit {d['share_without_exit']:.2f}")
    o = metrics["oracle"]
    if o.get("tokens"):
        print(f"oracle: first-correct layer {o['oracle_avg_layers']:.2f} (ideal speedup {o['ideal_speedup']:.2f}x), "
              f"stays-correct layer {o['oracle_stable_avg_layers']:.2f} ({o['ideal_speedup_stable']:.2f}x)")
    print("context similarity: hit rate; chance with the same exit layers shuffled within each request; "
          "chance for a uniformly random layer (the windows' coverage of the stack)")
    for r in metrics["context_similarity"]["per_category"]["all"]:
        print(f"  N={r['n']:2d}: hit {r['hit_rate']:.3f}  shuffled {r['shuffled_chance']:.3f}  "
              f"coverage {r['analytic_coverage']:.3f}")
    for name, m in rows.items():
        print(f"{name:>14}: speedup {m['speedup_vs_dense']:.3f}  avg_layers {m['avg_layers']:.2f}  "
              f"(oracle x{m['avg_layers_over_oracle'] or float('nan'):.2f})  "
              f"pred/token {m['predictor_calls_per_token']:.2f}  overhead {m['overhead_share']:.3f}  "
              f"match {m['match_rate_vs_dense']:.3f}")
