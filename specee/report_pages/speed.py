"""The pages drawn from speed results: speedup per category, which method here, the staircase,
the cost model, GPU paths, runtimes, predictor overhead and exits against the oracle."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import seaborn as sns  # noqa: E402

from specee import ablations  # noqa: E402
from specee.decoding import modes  # noqa: E402
from specee.report_pages.catalogue import (Skip, by_kind, display_name, hardware, ordered,  # noqa: E402
                                           reference_name, runtime_kind, stamp)


def fig_speedup_per_category(docs):
    """Per Spec-Bench category: few prompts per cell, so every cell carries its n and its 95%
    interval over prompts; the staircase (all prompts together) is the page to read first."""
    speed = by_kind(docs, "speed")
    if not speed:
        raise Skip("no speed results")
    cells = {(cat, display_name(d)): cell for d in speed for cat, cell in _category_cells(d).items()}
    if not cells:
        raise Skip("speed results carry no per-prompt timings")
    cats = sorted({c for c, _ in cells})
    names = ordered({n for _, n in cells}, speed)
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        vals = [cells[(c, n)][0] if (c, n) in cells else np.nan for c in cats]
        err = np.array([[v - cells[(c, n)][1][0], cells[(c, n)][1][1] - v] if (c, n) in cells else [0, 0]
                        for v, c in zip(vals, cats)]).T
        ax.bar(np.arange(len(cats)) + i * width, vals, width, label=n, yerr=err, capsize=1.5, error_kw={"lw": 0.6})
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(np.arange(len(cats)) + width * (len(names) - 1) / 2, cats, rotation=30, ha="right")
    ax.set_ylabel("decode speedup vs dense (×), 95% CI over the category's prompts")
    ax.set_xlabel("Spec-Bench category")
    n_per = sorted({v[2] for v in cells.values()})
    ax.set_title(f"Speedup per dataset and method (cf. paper Fig. 14/15), {'/'.join(map(str, n_per))} prompt(s) "
                 f"per cell\n{stamp(speed)}", fontsize=10)
    ax.legend(fontsize=8)
    md = (f"{'/'.join(map(str, n_per))} prompt(s) per cell: read a cell with its interval (n < 3 gives no "
          "real interval); the staircase pools all prompts.\n\n"
          "| category | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n")
    for c in cats:
        md += f"| {c} | " + " | ".join(
            (lambda v: f"{v[0]:.2f} [{v[1][0]:.2f}, {v[1][1]:.2f}] n={v[2]}")(cells[(c, n)]) if (c, n) in cells else "–"
            for n in names) + " |\n"
    return fig, md


def _overall(speed):
    out = {}
    for d in speed:
        out.setdefault(display_name(d), []).append(d["metrics"])
    return out


def _ci(ms):
    cis = [m.get("speedup_vs_dense_ci") for m in ms if m.get("speedup_vs_dense_ci")]
    return (min(c[0] for c in cis), max(c[1] for c in cis)) if cis else None


def _staircase_steps(overall, docs) -> list[tuple[str, list]]:
    """The ablations that declare themselves on the staircase (``ablation.staircase``), under their
    labels and in their order, each followed by its variants that change only the draft's
    vocabulary or the tree (full vs reduced vocabulary, fixed vs cost-chosen tree, side by side)."""
    def side_by_side(d) -> bool:
        a = d["config"]["ablation"]
        return bool((d["config"].get("draft") or {}).get("vocab_size")) or a.get("tree_select") == "auto"
    bars = {}  # ablation name -> (identity, its plain run's name, its variants' names)
    for d in docs:
        ident, shown = ablations.of_doc(d), display_name(d)
        if not ident.staircase:
            continue
        _, plain, variants = bars.setdefault(ident.name, (ident, set(), set()))
        if shown == ident.name:
            plain.add(shown)
        elif side_by_side(d):
            variants.add(shown)
    steps = []
    for ident, plain, variants in sorted(bars.values(), key=lambda b: (b[0].order, b[0].name)):
        steps += [(ident.label, overall[n]) for n in plain]
        steps += [(ident.label + n[len(ident.name):], overall[n]) for n in sorted(variants)]
    return steps


def fig_staircase(docs):
    speed = by_kind(docs, "speed")
    overall = _overall(speed)
    steps = _staircase_steps(overall, speed)
    if len(steps) < 2:
        raise Skip("needs speed results for at least two ablations on the staircase (ablation.staircase=true)")
    ref = reference_name(speed)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.2 * len(steps)), 4.5))
    vals = [np.mean([m["speedup_vs_dense"] for m in ms]) for _, ms in steps]
    cis = [_ci(ms) for _, ms in steps]
    noisy = [any(m.get("noisy") for m in ms) for _, ms in steps]
    labels = [lab + (" (noisy)" if bad else "") for (lab, _), bad in zip(steps, noisy)]
    err = np.array([[v - c[0], c[1] - v] if c else [0, 0] for v, c in zip(vals, cis)]).T
    ax.bar(labels, vals, color=sns.color_palette("crest", len(steps)), yerr=err, capsize=4)
    dense = overall.get(ref)
    if dense and _ci(dense):  # dense against itself: how far apart two identical runs land
        lo, hi = _ci(dense)
        ax.axhspan(lo, hi, color="grey", alpha=0.2, label=f"noise floor (dense vs dense 95% CI {lo:.2f}–{hi:.2f})")
        ax.legend(fontsize=8, loc="upper left")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.2f}×", ha="center", va="bottom")
    ax.set_ylabel("decode speedup vs dense (×), 95% CI over prompts")
    ax.set_xlabel("technique (cumulative)")
    if len(steps) > 6 or any("(" in lab for lab in labels):
        ax.tick_params(axis="x", labelrotation=25, labelsize=8)
    ax.set_title(f"Ablation staircase (cf. paper Fig. 2d)\n{stamp(speed)}", fontsize=10)
    fmt_ci = lambda c: f"[{c[0]:.3f}, {c[1]:.3f}]" if c else "–"  # noqa: E731
    # Modes timed without HF generate beside them: their end-to-end tokens/s against dense (same
    # run) times the dense job's own dense-vs-HF generate figure, marked †.
    dense_hf = [m["dense"]["speedup_vs_hf_generate"] for m in overall.get(ref, [])
                if (m.get("dense") or {}).get("speedup_vs_hf_generate")]

    def hf(ms):
        if all(m.get("speedup_vs_hf_generate") for m in ms):
            return f"{np.mean([m['speedup_vs_hf_generate'] for m in ms]):.3f}"
        if dense_hf:
            return f"{np.mean([m['tokens_per_s'] / m['dense']['tokens_per_s'] for m in ms]) * np.mean(dense_hf):.3f}†"
        return "–"
    floor = lambda ms: (f"{np.mean([m['ms_per_token'] for m in ms]):.1f} ({np.mean([m['ms_per_token_over_limit'] for m in ms]):.1f}×)"  # noqa: E731
                        if all(m.get("ms_per_token_over_limit") for m in ms) else "–")
    def cm(ms, fmt):
        got = [m["cost_model"] for m in ms if "modelled_speedup_vs_dense" in (m.get("cost_model") or {})]
        return fmt(got) if got else "–"
    modelled = lambda g: (f"{np.mean([c['modelled_speedup_vs_dense'] for c in g]):.3f} "  # noqa: E731
                          f"[{min(c['modelled_band'][0] for c in g):.2f}, {max(c['modelled_band'][1] for c in g):.2f}]")
    agree = lambda g: ("yes" if all(c["model_in_measured_ci"] for c in g) else  # noqa: E731
                       "in band" if all(c["measured_in_model_band"] for c in g) else
                       f"no: {np.mean([c['unmodelled_share'] for c in g]):+.0%} unmodelled")
    gpu = lambda g: " / ".join(f"{np.mean([c['predicted_gpu']['speedup_vs_dense'][t] for c in g]):.2f}"  # noqa: E731
                               for t in ("llama2_7b", "llama2_13b"))
    gap = lambda g: "; ".join(f"{x['cost']} {x['layer_units_per_token']:.2f}" for x in g[0]["gap_to_layer_ratio"]) or "–"  # noqa: E731
    md = ("| step | speedup (decode, vs dense loop) | 95% CI | modelled (counted work × unit costs) [band] | "
          "model vs measured | Llama-2-7B / 13B predicted (analytic GPU) | top costs beyond the layer ratio "
          "(layer-units/token) | end-to-end vs HF generate (paper's) | "
          "decode ms/token (× bandwidth floor) | avg layers | match rate | loss at this point | noisy |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n") + "".join(
        f"| {lab} | {np.mean([m['speedup_vs_dense'] for m in ms]):.3f} | {fmt_ci(_ci(ms))} | {cm(ms, modelled)} | "
        f"{cm(ms, agree)} | {cm(ms, gpu)} | {cm(ms, gap)} | {hf(ms)} | {floor(ms)} | "
        f"{np.mean([m['avg_layers'] for m in ms]):.2f} | {np.mean([m['match_rate_vs_dense'] for m in ms]):.3f} | "
        f"{loss_cell(ms)} | {'; '.join(r for m in ms for r in m.get('noisy_reasons', [])) or 'no'} |\n"
        for lab, ms in steps)
    g = next((m["cost_model"] for _, ms in steps for m in ms
              if "modelled_speedup_vs_dense" in (m.get("cost_model") or {})), None)
    if g:
        md += ("\nModelled: each mode's counted work per token (layers, LM heads, predictor calls, draft steps, "
               "tree blocks, host syncs) priced with unit costs measured interleaved in the same job; band: "
               "2.5–97.5 % over the measurement rounds. \"model vs measured\": yes = the modelled value lies in "
               "the measured 95 % interval; otherwise the share of the measured time no counted unit explains. "
               f"Predicted: the same counts (depth rescaled) priced for Llama-2 shapes by {g['predicted_gpu']['method']}. "
               "The paper reports up to 2.25× for Llama-2-7B (cloud GPU, end to end) and SpecEE with trees at "
               "1.05× of EAGLE. †: end to end against dense in its own run × the dense job's dense against HF "
               "generate (HF generate is timed in the dense job only).\n")
    md += _machine_note(speed, overall.get(ref))
    cut = sorted({(t["id"], t["tokens"], t["kept"]) for _, ms in steps for m in ms for t in m.get("truncated", [])})
    if cut:
        md += (f"\n{len(cut)} of {max(m.get('prompts', 0) for _, ms in steps for m in ms)} prompts are longer than "
               f"the model's context allows with the generation budget and were cut to their last {cut[0][2]} tokens: "
               + ", ".join(f"prompt {i} ({n} tokens)" for i, n, _ in cut) + ".\n")
    return fig, md


def loss_cell(ms: list[dict]) -> str:
    """The loss of the point a row times: its certified budget (early_exit.operating_point), or that
    it is uncertified with its measured loss (mean per-prompt share of tokens the full stack would not
    emit at the same prefix); lossless rows (no exit) say so."""
    if not any("loss" in m or "oracle_gap" in m for m in ms):  # an early-exit mode carries both
        return "– (no exit)"
    got = [m["loss"] for m in ms if m.get("loss")]
    if len(got) < len(ms):
        return "not measured (a result from before the loss was recorded: re-run)"
    here = float(np.mean([g["own_context_disagreement"] for g in got]))
    points = [g["certified"] for g in got if g.get("certified")]
    if points and len(points) == len(got):
        p = points[0]
        return (f"certified δ = {p['delta']:g} ({p['knob']} {p['value']:g}, K/V {p['kv_policy']}; held-out "
                f"{p['held_out']['loss']:.4f}); here {here:.4f}")
    return f"uncertified: {here:.4f} measured"


def _machine_note(speed, dense) -> str:
    """Which machine the ratios come from, and what their intervals do and do not cover."""
    fps = [d["metrics"]["machine"] for d in speed if d["metrics"].get("machine")]
    hw = "; ".join(sorted({hardware(d) for d in speed}))
    ms = [m["dense"]["ms_per_token"] for m in dense or [] if (m.get("dense") or {}).get("ms_per_token")]
    ratio = [f["lm_head_over_layer_time"] for f in fps if f.get("lm_head_over_layer_time")]
    caches = fps[0]["cpu_caches"] if fps and fps[0].get("cpu_caches") else None
    return (f"\nMachine: {hw}" + (f", caches {', '.join(f'{k} {v}' for k, v in caches.items())}" if caches else "")
            + (f"; dense {np.mean(ms):.1f} ms/token" if ms else "")
            + (f"; LM head / layer by time {np.mean(ratio):.2f}" if ratio else "") + ". "
            "The 95 % intervals are over prompts, paired and interleaved on this one machine: they cover its noise, "
            "not the spread between machines. The same commit's tiny staircase read T1+T2 1.018× [0.996, 1.040] on a "
            "machine where dense ran at 43.2 ms/token and 0.965× [0.944, 0.986] on one at 17.2 ms/token: compare runs "
            "by the machine fields each result records (`metrics.machine`), not by overlapping intervals.\n")


def fig_overhead(docs):
    # transformers' peers run their own loop: no phase split measured (overhead_share None)
    speed = [d for d in by_kind(docs, "speed") if "time_split_s" in d["metrics"]
             and d["metrics"].get("overhead_share") is not None]
    if not speed:
        raise Skip("no early-exit speed results with a time split")
    names = ordered({display_name(d) for d in speed}, speed)
    parts = ["layers", "predictors", "verification", "draft"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = np.zeros(len(names))
    for part in parts:
        vals = []
        for n in names:
            ds = [d["metrics"] for d in speed if display_name(d) == n]
            vals.append(np.mean([100 * m["time_split_s"][part] / m["time_split_s"]["decode_total"] for m in ds]))
        ax1.bar(names, vals, bottom=bottom, label=part)
        bottom += vals
    ax1.set_ylabel("share of decode time (%)")
    ax1.set_title("Where decode time goes", fontsize=10)
    ax1.legend(fontsize=8)
    ax1.tick_params(axis="x", rotation=20)
    calls = [np.mean([d["metrics"]["predictor_calls_per_token"] for d in speed if display_name(d) == n]) for n in names]
    ax2.bar(names, calls, color="tab:purple")
    ax2.set_ylabel("predictor evaluations per token")
    ax2.set_title("Predictor count", fontsize=10)
    ax2.tick_params(axis="x", rotation=20)
    fig.suptitle(f"Predictor count and overhead breakdown\n{stamp(speed)}", fontsize=10)
    md = "| method | predictor calls/token | overhead share | draft share | efficiency |\n|---|---|---|---|---|\n"
    for n in names:
        ms = [d["metrics"] for d in speed if display_name(d) == n]
        md += (f"| {n} | {np.mean([m['predictor_calls_per_token'] for m in ms]):.2f} | "
               f"{np.mean([m['overhead_share'] for m in ms]):.3f} | {np.mean([m['draft_share'] for m in ms]):.3f} | "
               f"{np.mean([m['efficiency'] for m in ms]):.3f} |\n")
    return fig, md


def fig_runtime(docs):
    """Eager vs compiled runtime per mode: ms/token against the bandwidth floor, and what the
    early-exit modes keep of their speedup on the faster runtime."""
    speed = by_kind(docs, "speed")
    comp = [d for d in speed if runtime_kind(d) == "compiled"]
    if not comp:
        raise Skip("no speed results on runtime=compiled")
    rows = []
    for d in sorted(comp, key=lambda d: (ablations.of_doc(d).order, display_name(d))):
        base = display_name(d).replace(" (compiled)", "")
        eager = [e["metrics"] for e in speed if runtime_kind(e) == "eager" and display_name(e) == base]
        rows.append((base, eager[0] if eager else None, d["metrics"]))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [e["ms_per_token"] if e else np.nan for _, e, _ in rows], 0.4, label="eager runtime")
    ax.bar(x + 0.2, [c["ms_per_token"] for _, _, c in rows], 0.4, label="compiled runtime")
    floor = np.mean([c["bandwidth_bound"]["limit_ms_per_token"] for _, _, c in rows])
    ax.axhline(floor, color="k", ls="--", lw=0.8, label=f"bandwidth floor ({floor:.2f} ms/token)")
    ax.set_xticks(x, [n for n, _, _ in rows], rotation=15)
    ax.set_ylabel("decode time per token (ms)")
    ax.set_xlabel("mode (each runtime's mode run with its own dense beside it)")
    ax.set_title(f"Eager vs compiled runtime\n{stamp(comp)}", fontsize=10)
    ax.legend(fontsize=8)
    f3 = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    md = ("| mode | ms/token eager (× floor) | ms/token compiled (× floor) | compiled vs eager dense, same run | "
          "dense vs HF generate time, eager / compiled | speedup vs dense eager / compiled | efficiency eager / compiled | "
          "overhead share eager / compiled | syncs/token | compile s | graphs compiled while timed |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|\n")
    for n, e, c in rows:
        def g(k, m=e):
            return None if m is None else m.get(k)
        eager_ms = f"{e['ms_per_token']:.1f} ({e['ms_per_token_over_limit']:.1f}×)" if e else "–"
        md += (f"| {n} | {eager_ms} | {c['ms_per_token']:.1f} ({c['ms_per_token_over_limit']:.1f}×) | "
               f"{f3(c.get('speedup_vs_eager_dense'))} | {f3(g('hf_generate_ratio'))} / {f3(c.get('hf_generate_ratio'))} | "
               f"{f3(g('speedup_vs_dense'))} / {f3(c['speedup_vs_dense'])} | {f3(g('efficiency'))} / {f3(c.get('efficiency'))} | "
               f"{f3(g('overhead_share'))} / {f3(c.get('overhead_share'))} | {f3(c.get('syncs_per_token'))} | "
               f"{c['runtime']['compile_s']:.1f} | {c['runtime']['graphs_compiled_in_timed_runs']} |\n")
    return fig, md


def fig_exit_vs_oracle(docs):
    """Where each early-exit mode's exits land against the oracle (on its own tokens), and the
    per-layer precision/recall of the predictors it used (held-out calibration tokens)."""
    import json

    from specee.io import project_path
    speed = [d for d in by_kind(docs, "speed") if d["metrics"].get("oracle_gap")]
    if not speed:
        raise Skip("no speed results with the exit-vs-oracle measurement")
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    md = ("| mode | avg layers | oracle | over oracle | at oracle | +1–2 | later | never | earlier (token ≠ full stack) | "
          "fire precision | refuted fires/token | their cost (layer-units/token) | match rate |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    cards = {}
    for d in sorted(speed, key=lambda d: (ablations.of_doc(d).order, display_name(d))):
        m, g = d["metrics"], d["metrics"]["oracle_gap"]
        hist = {int(k): v for k, v in g["layers_over_oracle_histogram"].items()}
        xs = np.arange(min(hist), max(hist) + 1)
        ax.step(xs, [hist.get(int(x), 0) / g["tokens"] for x in xs], where="mid", label=display_name(d))
        units = (m.get("cost_model") or {}).get("units_us") or {}
        ratio = units["lm_head"] / units["layer"] if units.get("layer") else None
        refuted = m.get("refuted_fires_per_token")
        cost = f"{refuted * ratio:.2f}" if refuted is not None and ratio else "–"
        f = lambda x: "–" if x is None else f"{x:.3f}"  # noqa: E731
        md += (f"| {display_name(d)} | {m['avg_layers']:.2f} | {g['oracle_avg_layers']:.2f} | {g['avg_layers_over_oracle']:.3f} | "
               f"{g['share_at_oracle']:.3f} | {g['share_within_2']:.3f} | {g['share_later']:.3f} | {g['share_never']:.3f} | "
               f"{g['share_earlier']:.3f} | {f(m.get('fire_precision'))} | {f(refuted)} | {cost} | "
               f"{m['match_rate_vs_dense']:.3f} |\n")
        ee = d["config"].get("early_exit") or {}
        if modes.of(d["config"]["ablation"]).needs_bank and ee.get("predictors_path"):
            card = project_path(ee["predictors_path"]) / "predictors_card.json"
            if card.is_file():
                cards.setdefault(ee["predictors_path"], json.loads(card.read_text()))
    ax.axvline(0, color="k", lw=0.8, ls="--")
    ax.set_xlabel("layers used − oracle layer (per token; < 0: exited before the layer that knows)")
    ax.set_ylabel("share of tokens")
    ax.set_title("Exits against the oracle, on each mode's own tokens", fontsize=10)
    ax.legend(fontsize=7)
    for path, card in cards.items():
        rows = card.get("per_layer", [])
        layers = [r["layer"] for r in rows]
        for key, ls in (("held_out_precision", "-"), ("held_out_recall", ":")):
            ax2.plot(layers, [r.get(key, np.nan) for r in rows], ls=ls,
                     label=f"{key.split('_')[-1]} · {Path(path).name}")
    ax2.set_xlabel("layer (0-based)")
    ax2.set_ylabel("held-out precision / recall")
    ax2.set_ylim(0, 1.05)
    ax2.set_title("Predictors per layer (held-out calibration tokens)", fontsize=10)
    if cards:
        ax2.legend(fontsize=7)
    fig.suptitle(stamp(speed), fontsize=9)
    md += ("\nOracle: per token, the earliest layer whose argmax equals the full stack's at the mode's own "
           "context (computed untimed after the timed pass). \"earlier\": the mode exited below it, so its token "
           "differs from what the full stack would say there (a lossy exit). A refuted fire is a predictor "
           "firing whose LM-head verification failed: a full LM head bought nothing.\n")
    return fig, md


def fig_cost_model(docs):
    """Every speed result's measured speedup beside its cost model: counted work x unit costs
    measured in the same job; the two costs that separate it from the layer ratio; the same
    counts priced for Llama-2 shapes on a GPU (analytic unless a GPU-measured table was given)."""
    speed = [d for d in by_kind(docs, "speed")
             if "modelled_speedup_vs_dense" in (d["metrics"].get("cost_model") or {})]
    if not speed:
        raise Skip("no speed results with a cost model (experiment.cost_rounds=0 or older results)")
    speed = sorted(speed, key=lambda d: (ablations.of_doc(d).order, display_name(d)))
    fig, ax = plt.subplots(figsize=(7.5, 6))
    md = ("| mode | measured [95% CI] | modelled [band] | agree | unmodelled share | top costs beyond the layer "
          "ratio L/avg layers (layer-units/token) | Llama-2-7B / 13B predicted |\n|---|---|---|---|---|---|---|\n")
    for d in speed:
        m, c = d["metrics"], d["metrics"]["cost_model"]
        lo, hi = m["speedup_vs_dense_ci"]
        blo, bhi = c["modelled_band"]
        x, y = c["modelled_speedup_vs_dense"], m["speedup_vs_dense"]
        ax.errorbar(x, y, yerr=[[y - lo], [hi - y]], xerr=[[max(0, x - blo)], [max(0, bhi - x)]], fmt="o",
                    capsize=3, label=display_name(d))
        agree = "yes" if c["model_in_measured_ci"] else "in band" if c["measured_in_model_band"] else "no"
        if "block_costs" in c:  # prompt lookup: priced by the block-cost table c(n), not by units
            gap = f"blocks of {c['counts']['mean_block']:.2f} tokens, {c['counts']['steps_per_token']:.3f} steps/token"
        else:
            gap = "; ".join(f"{g['cost']} {g['layer_units_per_token']:.2f}" for g in c["gap_to_layer_ratio"]) or "–"
        gpu = (c.get("predicted_gpu") or {}).get("speedup_vs_dense")
        md += (f"| {display_name(d)} | {y:.3f} [{lo:.3f}, {hi:.3f}] | {x:.3f} [{blo:.2f}, {bhi:.2f}] | {agree} | "
               f"{c['unmodelled_share']:+.1%} | {gap} | "
               + (f"{gpu['llama2_7b']:.2f} / {gpu['llama2_13b']:.2f} |\n" if gpu else "– (not priced for a GPU) |\n"))
    lims = [min(ax.get_xlim()[0], ax.get_ylim()[0]), max(ax.get_xlim()[1], ax.get_ylim()[1])]
    ax.plot(lims, lims, "k--", lw=0.8)
    ax.set_xlabel("modelled speedup vs dense (×): counted work × unit costs, band over rounds")
    ax.set_ylabel("measured decode speedup vs dense (×), 95% CI over prompts")
    ax.set_title(f"Measured against modelled speedup\n{stamp(speed)}", fontsize=10)
    ax.legend(fontsize=6, ncol=2)
    gpu_method = next((d["metrics"]["cost_model"]["predicted_gpu"]["method"] for d in speed
                       if "predicted_gpu" in d["metrics"]["cost_model"]), "none of these results")
    md += (f"\nPredicted: {gpu_method}. A positive unmodelled "
           "share is time no counted unit explains (the early-exit loop's own bookkeeping: the layer walk, the "
           "speculative probe built per step, the schedule, traces).\n")
    return fig, md


def _category_cells(d) -> dict:
    """Per Spec-Bench category of one speed result: (speedup vs dense, paired 95% CI, prompts)."""
    from specee.bench.speed import paired_speedup_ci
    by_cat = defaultdict(list)
    for p in d.get("prompts", []):
        if "decode_s" in p:
            by_cat[p["category"]].append(p)
    cells = {}
    for cat, rows in by_cat.items():
        t, s_, dt, ds = (sum(r[k] for r in rows) for k in ("tokens", "decode_s", "dense_tokens", "dense_decode_s"))
        t, dt = t - len(rows), dt - len(rows)
        if s_ > 0 and ds > 0 and dt > 0:
            cells[cat] = ((t / s_) / (dt / ds), paired_speedup_ci(rows), len({r["id"] for r in rows}))
    return cells


def fig_which_method(docs):
    """Which method, here? Per model and category the fastest lossless method (greedy tokens
    identical to dense in that run) with its interval, beside the fastest of all; and the peer rows:
    prompt lookup in the harness and in transformers, self-speculation, SpecEE with lookup drafts."""
    speed = [d for d in by_kind(docs, "speed") if "speedup_vs_dense" in d["metrics"]]
    if not any(ablations.of_doc(d).peer for d in speed):
        raise Skip("no speed results for any of the peer methods (the ablations with role: peer)")
    ref = reference_name(speed) or modes.reference().name  # the loop every speedup here is against
    models = sorted({d["config"]["model"]["name"] for d in speed})
    grid = {}  # (model, category, method) -> cell, lossless
    for d in speed:
        lossless = d["metrics"]["match_rate_vs_dense"] >= 1.0
        for cat, cell in _category_cells(d).items():
            grid[(d["config"]["model"]["name"], cat, display_name(d))] = (cell, lossless)
    cats = sorted({c for _, c, _ in grid})
    methods = ordered({n for _, _, n in grid if n != ref}, speed)
    fig, axes = plt.subplots(len(models), 1, figsize=(11, 1.2 + 0.5 * len(cats) * len(models)), squeeze=False)
    md = ("Fastest lossless method: the highest decode speedup against the harness's dense loop among the results "
          "whose greedy tokens were identical to dense in their own run (match rate 1.000); its 95 % interval is "
          "over the category's prompts (n < 3 gives no real interval). Dense itself (1.00×) wins where no method "
          "beats it. Lossy methods (SpecEE) are listed beside with their match rate.\n\n"
          "| model | category | fastest lossless | speedup [95% CI] | above dense (interval > 1) | fastest of all (match rate) |\n"
          "|---|---|---|---|---|---|\n")
    for ax, model in zip(axes[:, 0], models):
        vals = np.array([[grid[(model, c, n)][0][0] if (model, c, n) in grid else np.nan for n in methods] for c in cats])
        sns.heatmap(vals, ax=ax, annot=True, fmt=".2f", center=1.0, cmap="vlag_r", cbar_kws={"label": "speedup vs dense (×)"},
                    xticklabels=methods, yticklabels=cats)
        ax.set_xlabel("method")
        ax.set_ylabel(f"{model}: Spec-Bench category")
        for c in cats:
            lossless = [(grid[(model, c, n)][0], n) for n in methods if grid.get((model, c, n), (None, False))[1]]
            best = max(lossless, default=None, key=lambda x: x[0][0])
            if best is None or best[0][0] < 1.0:
                cell, name = (1.0, None, None), ref
            else:
                cell, name = best
            anyone = max(((grid[(model, c, n)][0], n) for n in methods if (model, c, n) in grid), default=None,
                         key=lambda x: x[0][0])
            match = next((d["metrics"]["match_rate_vs_dense"] for d in speed if anyone and display_name(d) == anyone[1]
                          and d["config"]["model"]["name"] == model), None)
            ci = f"[{cell[1][0]:.2f}, {cell[1][1]:.2f}] n={cell[2]}" if cell[1] else "(the baseline)"
            above = "–" if name == ref else ("yes" if cell[1][0] > 1.0 else "no: ties dense")
            md += (f"| {model} | {c} | {name} | {cell[0]:.2f} {ci} | {above} | "
                   + (f"{anyone[1]} {anyone[0][0]:.2f} ({match:.3f})" if anyone else "–") + " |\n")
    ax.set_title(f"Which method, here? Speedup per category and method\n{stamp(speed)}", fontsize=10)
    md += ("\n| method (model) | speedup [95% CI] | tokens per step (τ) | match rate | against transformers' own "
           "| predicted (chosen setting) |\n|---|---|---|---|---|---|\n")
    for d in sorted(speed, key=lambda d: (d["config"]["model"]["name"], ablations.of_doc(d).order, display_name(d))):
        m, name = d["metrics"], display_name(d)
        if not ablations.of_doc(d).peer:
            continue
        lo, hi = m["speedup_vs_dense_ci"]
        peer = m.get("peer") or {}
        against = (f"{peer['mode_speedup_vs_peer']:.2f}× {peer['name']} [{peer['mode_speedup_vs_peer_ci'][0]:.2f}, "
                   f"{peer['mode_speedup_vs_peer_ci'][1]:.2f}], tokens identical {peer['identical_to_mode_share']:.0%}"
                   if peer else "–")
        choice = ((m.get("prompt_lookup") or {}).get("num_tokens_choice")
                  or (m.get("transformers_peer") or {}).get("exit_layer_choice"))
        pred = (f"{choice['predicted_speedup']:.2f}× at {choice['chosen']}" if choice else "–")
        tau = m.get("mean_accepted_length")
        md += (f"| {name} ({d['config']['model']['name']}) | {m['speedup_vs_dense']:.3f} [{lo:.3f}, {hi:.3f}] | "
               f"{tau:.2f} | {m['match_rate_vs_dense']:.3f} | {against} | {pred} |\n" if tau == tau and tau else
               f"| {name} ({d['config']['model']['name']}) | {m['speedup_vs_dense']:.3f} [{lo:.3f}, {hi:.3f}] | – | "
               f"{m['match_rate_vs_dense']:.3f} | {against} | {pred} |\n")
    return fig, md


def fig_gpu_paths(docs):
    """Where a token's time goes on a GPU, per decoding path (eager; graphed with host exits;
    graphed with exits decided on the device): each speed result's counted work priced for
    Llama-2-7B, by part, against dense on the same path and the strongest dense path; measured
    ms/token beside it where the result itself ran on a GPU."""
    speed = [d for d in by_kind(docs, "speed")
             if "predicted_gpu_paths" in (d["metrics"].get("cost_model") or {})]
    if not speed:
        raise Skip("no speed results with per-path GPU pricing (experiment.cost_rounds=0 or older results)")
    speed = sorted(speed, key=lambda d: (ablations.of_doc(d).order, display_name(d)))
    parts = ("layers", "lm_heads", "predictors", "draft", "host")
    fig, ax = plt.subplots(figsize=(8, 5.5))
    labels, bottoms = [], None
    rows = []
    for d in speed:
        p = d["metrics"]["cost_model"]["predicted_gpu_paths"]["by_model"]["llama2_7b"]
        for path, v in p["paths"].items():
            labels.append(f"{display_name(d)}\n{path.replace('_', ' ')}")
            rows.append((d, path, v, p))
    import numpy as np
    bottoms = np.zeros(len(rows))
    for part in parts:
        vals = np.array([r[2]["us_per_token"][part] / 1e3 for r in rows])
        ax.bar(range(len(rows)), vals, bottom=bottoms, label=part)
        bottoms += vals
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("modelled ms per token, Llama-2-7B shape")
    ax.set_title("Where a token's time goes on a GPU, per path (modelled; analytic A100)", fontsize=10)
    ax.legend(fontsize=7)
    method = speed[0]["metrics"]["cost_model"]["predicted_gpu_paths"]["method"]
    md = ("| mode | path | modelled ms/token (7B) | of it host-side | × dense, same path | × strongest dense | "
          "measured here |\n|---|---|---|---|---|---|---|\n")
    for d, path, v, p in rows:
        t = v["us_per_token"]
        on_gpu = str(d.get("device", "")).startswith("cuda")
        measured = f"{d['metrics']['ms_per_token']:.2f} ms/token ({runtime_kind(d)})" if on_gpu else "– (not a GPU run)"
        md += (f"| {display_name(d)} | {path.replace('_', ' ')} | {t['total'] / 1e3:.2f} | {t['host'] / 1e3:.2f} | "
               f"{v['speedup_vs_dense_same_path']:.3f} | {v['speedup_vs_strongest_dense']:.3f} | {measured} |\n")
    dense = speed[0]["metrics"]["cost_model"]["predicted_gpu_paths"]["by_model"]["llama2_7b"]["dense_us_per_token"]
    md += (f"\nDense (modelled, 7B): eager {dense['eager'] / 1e3:.2f} ms/token, graphed {dense['graphed'] / 1e3:.2f} "
           f"ms/token. Prices: {method}. Counts come from each run's own traces (depth rescaled to 32 "
           "layers); the prices are stated floors, not GPU measurements — a GPU run's measured ms/token "
           "stands beside them.\n")
    return fig, md
