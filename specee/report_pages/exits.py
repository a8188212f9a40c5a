"""The pages drawn from exit statistics and the exit potential: where tokens exit (cf. the paper's
Fig. 10), how similar neighbouring exits are (Fig. 11), and whether SpecEE can pay off on a model."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from specee.report_pages.catalogue import Skip, by_kind, stamp  # noqa: E402


def fig_exit_distribution(docs):
    stats = by_kind(docs, "stats")
    if not stats:
        raise Skip("no stats results (experiment=stats)")
    fig, ax = plt.subplots(figsize=(10, 4.5))
    md = ("| model | tokens | bottom half by exit probability (paper: <= 0.20) | shallower half by depth | "
          "layers below uniform | no exit | oracle floor, layers (first right / stays right) | "
          "ideal speedup |\n|---|---|---|---|---|---|---|---|\n")
    for d in stats:
        dist = d["metrics"]["exit_distribution"]["all"]
        share = dist["share_per_layer"]
        ax.bar(np.arange(len(share)) + 1, np.asarray(share) * 100, alpha=0.7, label=d["config"]["model"]["name"])
        ax.axhline(100 / len(share), color="k", ls="--", lw=0.8)
        by_prob = dist.get("skew_bottom_half_by_probability")
        by_depth = dist.get("share_of_exits_in_shallower_half_by_depth", dist.get("share_of_exits_in_bottom_half"))
        md += (f"| {d['config']['model']['name']} | {dist['tokens']} | "
               f"{'–' if by_prob is None else f'{by_prob:.3f}'} | {by_depth:.3f} | "
               f"{dist['share_of_layers_below_uniform']:.3f} | {dist['share_without_exit']:.3f} | "
               + (f"{o['oracle_avg_layers']:.2f} / {o['oracle_stable_avg_layers']:.2f} | {o['ideal_speedup']:.2f}× |\n"
                  if (o := d["metrics"].get("oracle", {})).get("tokens") else "– | – |\n"))
    ax.set_xlabel("exit layer (1 = first decoder layer; last = no early exit)")
    ax.set_ylabel("share of tokens (%)")
    ax.set_title(f"Exit-layer distribution, predictors at all layers (cf. paper Fig. 10); dashed: uniform\n"
                 f"{stamp(stats)}", fontsize=10)
    ax.legend()
    return fig, md


def fig_context_similarity(docs):
    stats = by_kind(docs, "stats")
    if not stats:
        raise Skip("no stats results (experiment=stats)")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    md = "| model | N | hit rate | shuffled chance | analytic coverage |\n|---|---|---|---|---|\n"
    for d in stats:
        rows = d["metrics"]["context_similarity"]["per_category"]["all"]
        n = [r["n"] for r in rows]
        name = d["config"]["model"]["name"]
        ax.plot(n, [100 * r["hit_rate"] for r in rows], "o-", label=f"{name}: hit rate")
        ax.plot(n, [100 * r["shuffled_chance"] for r in rows], "s--", label=f"{name}: shuffled chance")
        ax.plot(n, [100 * r["analytic_coverage"] for r in rows], ":", label=f"{name}: window coverage (random-layer chance)")
        md += "".join(f"| {name} | {r['n']} | {r['hit_rate']:.3f} | {r['shuffled_chance']:.3f} | "
                      f"{r['analytic_coverage']:.3f} |\n" for r in rows)
    w = stats[0]["metrics"]["context_similarity"]["window"]
    ax.set_xlabel("N (previous tokens' exit layers considered)")
    ax.set_ylabel(f"P(exit layer within ±{w} of one of them) (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"Context similarity of exit layers (cf. paper Fig. 11)\n{stamp(stats)}", fontsize=10)
    ax.legend(fontsize=8)
    return fig, md


def fig_potential(docs):
    """experiment=potential: per model, the share of tokens each layer already predicts, and the
    ceilings on SpecEE's speedup here and on a named GPU (one row per model of a sweep)."""
    pots = by_kind(docs, "potential")
    if not pots:
        raise Skip("no potential results (experiment=potential)")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    md = ("| model | layers | vocabulary | LM head / layer (params; time here) | tokens | oracle floor [95% CI] "
          "(stays right) | SpecEE T1+T2 ceiling here / GPU | draft chain at its acceptance here / GPU | "
          "break-even draft coverage | verdict |\n|---|---|---|---|---|---|---|---|---|---|\n")
    for d in sorted(pots, key=lambda d: d["metrics"]["model"]):
        m = d["metrics"]
        L, agree = m["num_layers"], m["agreement_by_layer"]["all"]
        ax.plot(np.arange(1, L + 1) / L, np.asarray(agree) * 100, "o-", ms=3,
                label=f"{m['model']} ({L} layers)" + (" SYNTHETIC" if m.get("synthetic") else ""))
        o, h, g = m["oracle_floor"], m["ceilings"]["here"], m["ceilings"]["gpu"]
        lo, hi = o["interval_95"]["first"]
        chain = "eagle_chain_at_draft_acceptance"
        ch = f"{h[chain]['speedup']:.2f}× / {g[chain]['speedup']:.2f}×" if chain in h else "– (no draft)"
        cov = h["break_even"]["draft_coverage"]
        md += (f"| {m['model']} | {L} | {m['vocab_size']} | {m['lm_head_over_layer_by_params']:.2f}; "
               f"{m['lm_head_over_layer_by_time']:.2f} | {m['tokens']} | {o['first']:.2f} [{lo:.2f}, {hi:.2f}] "
               f"({o['stable']:.2f}) | {h['specee_ar_paper_predictors_t1_t2']['speedup']:.2f}× / "
               f"{g['specee_ar_paper_predictors_t1_t2']['speedup']:.2f}× | {ch} | "
               f"{'none suffices' if cov is None or cov > 1 else f'{100 * cov:.0f} %'} | {m['verdict']} |\n")
    ax.set_xlabel("layer / number of layers")
    ax.set_ylabel("tokens this layer already predicts (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"Exit potential: agreement of each layer with the final token\n{stamp(pots)}", fontsize=10)
    ax.legend(fontsize=8)
    md += ("\nCeilings assume exits at the oracle floor with no wrong exit (T1+T2: plus a third of T1's predictor "
           "calls, and one draft step per token); the GPU column prices the same work analytically "
           f"({pots[0]['metrics']['unit_costs']['gpu']['method']}).\n")
    return fig, md
