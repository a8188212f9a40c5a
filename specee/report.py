"""Paper-style figures and a markdown summary, regenerated from stored results only.

Each figure function takes the loaded results and returns ``(figure, markdown)`` or raises
:class:`Skip` with the reason its inputs are missing; the report keeps going without it.
"""
from __future__ import annotations

from collections import defaultdict
from datetime import date
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import seaborn as sns

from specee.errors import SpeceeError  # noqa: E402
from matplotlib.backends.backend_pdf import PdfPages  # noqa: E402

ABLATION_ORDER = ["dense", "pld", "hf_pld", "hf_self_spec", "adainfer", "adainfer_crf", "eagle", "specee_t1",
                  "specee_t1_authors", "specee_t1_t2", "specee_t1_t2_authors", "specee_t1_t2_paper",
                  "specee_t1_t2_tuned", "specee_pld", "specee_full", "specee_full_authors", "specee_full_tuned"]
# The methods a user would pick instead of SpecEE (no training, or transformers' own).
PEER_METHODS = ("pld", "hf_pld", "hf_self_spec", "specee_pld")
# The paper's cumulative steps; a tuned option (calibration beyond the paper) sits beside its step.
STAIRCASE = [("dense", "dense"), ("specee_t1", "T1"), ("specee_t1_authors", "T1 authors' bank"),
             ("specee_t1_t2", "T1+T2"), ("specee_t1_t2_authors", "T1+T2 authors' bank"),
             ("specee_t1_t2_tuned", "T1+T2 tuned"), ("specee_full", "T1+T2+T3"),
             ("specee_full_authors", "T1+T2+T3 authors' bank"), ("specee_full_tuned", "T1+T2+T3 tuned")]


class Skip(Exception):
    """A figure whose inputs are not in the results."""


from specee.decoding import modes  # noqa: E402
from specee.verdicts import kind as _kind  # noqa: E402  (which experiment wrote a result)


def _hardware(doc) -> str:
    """The hardware the run used: its device (a CPU run on a machine with a GPU is a CPU run)."""
    gpus = doc["env"].get("gpus") or []
    device = str(doc.get("device") or (doc["config"].get("model") or {}).get("device") or "")
    if gpus and device.startswith(("cuda", "auto")):
        index = int(device.split(":")[1]) if device.startswith("cuda:") else 0
        gpu = next((g for g in gpus if g.get("index") == index), gpus[0])
        return gpu["name"]
    return f"CPU ({doc['env'].get('cpu')}, {doc['env'].get('torch_threads')} threads)"


def _stamp(docs) -> str:
    models = sorted({d["config"]["model"]["name"] for d in docs})
    hw = sorted({_hardware(d) for d in docs})
    days = sorted({(d.get("created") or "")[:10] for d in docs})
    return f"model: {', '.join(models)} · {'; '.join(hw)} · {', '.join(days)}"


def _by_kind(docs, kind):
    """Results of one experiment kind; a peer transformers could not run (``not_applicable``) has no
    figures to draw."""
    return [d for d in docs if _kind(d) == kind and not d["metrics"].get("not_applicable")]


def _name(doc) -> str:
    name = doc["config"]["ablation"]["name"]
    ee = doc["config"].get("early_exit", {})
    a = doc["config"]["ablation"]
    spec = modes.of(a)
    if not spec.reference and ee.get("kv_policy", "holes") != "holes":
        name += f" ({ee['kv_policy']})"
    if spec.needs_bank and ee.get("delta_from", "previous_layer") != "previous_layer":
        name += f" (Δ {ee['delta_from']})"
    if spec.is_tree(a) and spec.needs_bank and a.get("mapping") != "merged":
        name += f" ({a['mapping']})"
    if (doc["config"].get("draft") or {}).get("vocab_size"):
        name += f" (draft vocab {doc['config']['draft']['vocab_size']})"
    if a.get("tree_select") == "auto" and spec.is_tree(a):
        name += " (tree by cost)"
    if _runtime(doc) != "eager":
        name += f" ({_runtime(doc)})"
    return name


def _runtime(doc) -> str:
    return (doc["config"].get("runtime") or {}).get("kind", "eager")


def _order(names):
    return sorted(names, key=lambda n: (ABLATION_ORDER.index(n.split(" ")[0])
                                        if n.split(" ")[0] in ABLATION_ORDER else 99, n))


def fig_speedup_per_category(docs):
    """Per Spec-Bench category: few prompts per cell, so every cell carries its n and its 95%
    interval over prompts; the staircase (all prompts together) is the page to read first."""
    speed = _by_kind(docs, "speed")
    if not speed:
        raise Skip("no speed results")
    cells = {(cat, _name(d)): cell for d in speed for cat, cell in _category_cells(d).items()}
    if not cells:
        raise Skip("speed results carry no per-prompt timings")
    cats = sorted({c for c, _ in cells})
    names = _order({n for _, n in cells})
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
                 f"per cell\n{_stamp(speed)}", fontsize=10)
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
        out.setdefault(_name(d), []).append(d["metrics"])
    return out


def _ci(ms):
    cis = [m.get("speedup_vs_dense_ci") for m in ms if m.get("speedup_vs_dense_ci")]
    return (min(c[0] for c in cis), max(c[1] for c in cis)) if cis else None


def _staircase_steps(overall) -> list[tuple[str, list]]:
    """The paper's cumulative steps, each followed by its variants that change only the draft's
    vocabulary or the tree (full vs reduced vocabulary, fixed vs cost-chosen tree, side by side)."""
    steps = []
    for n, label in STAIRCASE:
        if n in overall:
            steps.append((label, overall[n]))
        steps += [(label + v[len(n):], overall[v]) for v in sorted(overall)
                  if v.startswith(n + " (") and ("draft vocab" in v or "tree by cost" in v)]
    return steps


def fig_staircase(docs):
    speed = _by_kind(docs, "speed")
    overall = _overall(speed)
    steps = _staircase_steps(overall)
    if len(steps) < 2:
        raise Skip(f"needs speed results for at least two of {[n for n, _ in STAIRCASE]}")
    fig, ax = plt.subplots(figsize=(max(7.0, 1.2 * len(steps)), 4.5))
    vals = [np.mean([m["speedup_vs_dense"] for m in ms]) for _, ms in steps]
    cis = [_ci(ms) for _, ms in steps]
    noisy = [any(m.get("noisy") for m in ms) for _, ms in steps]
    labels = [lab + (" (noisy)" if bad else "") for (lab, _), bad in zip(steps, noisy)]
    err = np.array([[v - c[0], c[1] - v] if c else [0, 0] for v, c in zip(vals, cis)]).T
    ax.bar(labels, vals, color=sns.color_palette("crest", len(steps)), yerr=err, capsize=4)
    dense = overall.get("dense")
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
    ax.set_title(f"Ablation staircase (cf. paper Fig. 2d)\n{_stamp(speed)}", fontsize=10)
    fmt_ci = lambda c: f"[{c[0]:.3f}, {c[1]:.3f}]" if c else "–"  # noqa: E731
    # Modes timed without HF generate beside them: their end-to-end tokens/s against dense (same
    # run) times the dense job's own dense-vs-HF generate figure, marked †.
    dense_hf = [m["dense"]["speedup_vs_hf_generate"] for m in overall.get("dense", [])
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
          "decode ms/token (× bandwidth floor) | avg layers | match rate | noisy |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|\n") + "".join(
        f"| {lab} | {np.mean([m['speedup_vs_dense'] for m in ms]):.3f} | {fmt_ci(_ci(ms))} | {cm(ms, modelled)} | "
        f"{cm(ms, agree)} | {cm(ms, gpu)} | {cm(ms, gap)} | {hf(ms)} | {floor(ms)} | "
        f"{np.mean([m['avg_layers'] for m in ms]):.2f} | {np.mean([m['match_rate_vs_dense'] for m in ms]):.3f} | "
        f"{'; '.join(r for m in ms for r in m.get('noisy_reasons', [])) or 'no'} |\n"
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
    md += _machine_note(speed, overall.get("dense"))
    cut = sorted({(t["id"], t["tokens"], t["kept"]) for _, ms in steps for m in ms for t in m.get("truncated", [])})
    if cut:
        md += (f"\n{len(cut)} of {max(m.get('prompts', 0) for _, ms in steps for m in ms)} prompts are longer than "
               f"the model's context allows with the generation budget and were cut to their last {cut[0][2]} tokens: "
               + ", ".join(f"prompt {i} ({n} tokens)" for i, n, _ in cut) + ".\n")
    return fig, md


def _machine_note(speed, dense) -> str:
    """Which machine the ratios come from, and what their intervals do and do not cover."""
    fps = [d["metrics"]["machine"] for d in speed if d["metrics"].get("machine")]
    hw = "; ".join(sorted({_hardware(d) for d in speed}))
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


def fig_exit_distribution(docs):
    stats = _by_kind(docs, "stats")
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
                 f"{_stamp(stats)}", fontsize=10)
    ax.legend()
    return fig, md


def fig_context_similarity(docs):
    stats = _by_kind(docs, "stats")
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
    ax.set_title(f"Context similarity of exit layers (cf. paper Fig. 11)\n{_stamp(stats)}", fontsize=10)
    ax.legend(fontsize=8)
    return fig, md


def fig_overhead(docs):
    # transformers' peers run their own loop: no phase split measured (overhead_share None)
    speed = [d for d in _by_kind(docs, "speed") if "time_split_s" in d["metrics"]
             and d["metrics"].get("overhead_share") is not None]
    if not speed:
        raise Skip("no early-exit speed results with a time split")
    names = _order({_name(d) for d in speed})
    parts = ["layers", "predictors", "verification", "draft"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = np.zeros(len(names))
    for part in parts:
        vals = []
        for n in names:
            ds = [d["metrics"] for d in speed if _name(d) == n]
            vals.append(np.mean([100 * m["time_split_s"][part] / m["time_split_s"]["decode_total"] for m in ds]))
        ax1.bar(names, vals, bottom=bottom, label=part)
        bottom += vals
    ax1.set_ylabel("share of decode time (%)")
    ax1.set_title("Where decode time goes", fontsize=10)
    ax1.legend(fontsize=8)
    ax1.tick_params(axis="x", rotation=20)
    calls = [np.mean([d["metrics"]["predictor_calls_per_token"] for d in speed if _name(d) == n]) for n in names]
    ax2.bar(names, calls, color="tab:purple")
    ax2.set_ylabel("predictor evaluations per token")
    ax2.set_title("Predictor count", fontsize=10)
    ax2.tick_params(axis="x", rotation=20)
    fig.suptitle(f"Predictor count and overhead breakdown\n{_stamp(speed)}", fontsize=10)
    md = "| method | predictor calls/token | overhead share | draft share | efficiency |\n|---|---|---|---|---|\n"
    for n in names:
        ms = [d["metrics"] for d in speed if _name(d) == n]
        md += (f"| {n} | {np.mean([m['predictor_calls_per_token'] for m in ms]):.2f} | "
               f"{np.mean([m['overhead_share'] for m in ms]):.3f} | {np.mean([m['draft_share'] for m in ms]):.3f} | "
               f"{np.mean([m['efficiency'] for m in ms]):.3f} |\n")
    return fig, md


def paired_change(dense: dict | None, mode: dict | None, scale: float = 100.0) -> dict | None:
    """Item by item against dense (the same items): the mean difference of the per-item metric with
    its 95 % interval (normal, paired: the items' own spread, not two independent samples), how
    many answers changed, and how many items the mode got wrong that dense got right and back."""
    if not dense or not mode:
        return None
    common = sorted(set(dense) & set(mode))
    if len(common) < 2:
        return None
    diff = np.array([mode[i]["value"] - dense[i]["value"] for i in common]) * scale
    half = 1.96 * diff.std(ddof=1) / np.sqrt(len(diff))
    return {"n": len(common), "delta": float(diff.mean()), "lo": float(diff.mean() - half),
            "hi": float(diff.mean() + half),
            "changed": sum(mode[i]["answer"] != dense[i]["answer"] for i in common),
            "worse": sum(mode[i]["value"] < dense[i]["value"] for i in common),
            "better": sum(mode[i]["value"] > dense[i]["value"] for i in common)}


def fig_accuracy(docs):
    """The paper's Table 4 layout: task x mode, the dense value beside the early-exit value, the
    difference, item counts, 95 % intervals and the layers used. Perplexity-like metrics (lower is
    better) are shown as they are; accuracies in %."""
    acc = [d for d in docs if "accuracy" in d.get("metrics", {})]
    if not acc:
        raise Skip("no accuracy results (experiment=accuracy)")
    cell = defaultdict(dict)  # task -> mode -> metrics
    items = defaultdict(dict)  # task -> mode -> per-item values and answers
    for d in acc:
        for task, m in d["metrics"]["accuracy"].items():
            cell[task][_name(d)] = m
            if task in d.get("items", {}):
                items[task][_name(d)] = d["items"][task]
    names = _order({n for t in cell.values() for n in t})
    tasks = sorted(cell)
    paired = {(t, n): paired_change(items[t].get("dense"), items[t][n],
                                    1 if cell[t][n].get("lower_is_better") else 100)
              for t in tasks for n in items[t] if n != "dense"}

    def value(m):
        v = m.get("accuracy", m.get("acc", m.get("exact_match")))
        return v if m.get("lower_is_better") else 100 * v

    def ci(m):
        se = m.get("accuracy_stderr")
        if se is None:
            return None
        v, k = value(m), 1.96 * (se if m.get("lower_is_better") else 100 * se)
        return v - k, v + k

    cells = []
    for t in tasks:
        dense = cell[t].get("dense")
        row = []
        for n in names:
            m = cell[t].get(n)
            if m is None:
                row.append("–")
                continue
            delta = f" ({value(m) - value(dense):+.{3 if m.get('lower_is_better') else 1}f})" \
                if dense is not None and n != "dense" else ""
            fmt = ".3f" if m.get("lower_is_better") else ".1f"
            lay = m.get("mean_layers")
            pc = paired.get((t, n))
            if pc and delta and not m.get("lower_is_better"):  # the paired interval beside the Δ
                delta = f"{delta[:-1]} [{pc['lo']:+.1f}, {pc['hi']:+.1f}])"
            row.append(f"{value(m):{fmt}}{delta}" + (f"\n{lay:.1f} layers" if lay else ""))
        cells.append(row)
    fig, ax = plt.subplots(figsize=(min(16, 3 + 2.2 * len(names)), 1.5 + 0.6 * len(tasks)))
    ax.axis("off")
    labels = [t + (" (lower better)" if any(m.get("lower_is_better") for m in cell[t].values()) else " (%)")
              for t in tasks]
    tab = ax.table(cellText=cells, rowLabels=labels, colLabels=names, loc="center", cellLoc="center")
    tab.scale(1, 2.2)
    tab.set_fontsize(8)
    ax.set_title(f"Accuracy (%, or the task's metric), Δ vs dense [95 % CI, paired over items], mean layers used "
                 f"(cf. paper Table 4)\n"
                 f"{_stamp(acc)}", fontsize=10)
    md = ("| task | metric | mode | dense | mode value | Δ | Δ 95% CI (paired) | answers changed (→ wrong / → right) "
          "| n | 95% CI (mode) | avg layers (mode / dense) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|\n")
    for t in tasks:
        dense = cell[t].get("dense")
        for n in names:
            m = cell[t].get(n)
            if m is None or (n == "dense" and len(cell[t]) > 1):
                continue
            low = m.get("lower_is_better")
            fmt = ".3f" if low else ".1f"
            c = ci(m)
            dv = f"{value(dense):{fmt}}" if dense else "–"
            delta = f"{value(m) - value(dense):+{fmt}}" if dense and n != "dense" else "–"
            lay = m.get("mean_layers")
            dlay = dense.get("mean_layers") if dense else None
            pc = paired.get((t, n))
            pci = f"[{pc['lo']:+{fmt}}, {pc['hi']:+{fmt}}]" if pc else "–"
            chg = (f"{pc['changed']} ({pc['worse']} / {pc['better']})" if pc and not low else "–")
            md += (f"| {t} | {m.get('primary_metric', 'acc')}{' (lower better)' if low else ' (%)'} | {n} | {dv} | "
                   f"{value(m):{fmt}} | {delta} | {pci} | {chg} | {m.get('n', '–')} | "
                   f"{f'[{c[0]:{fmt}}, {c[1]:{fmt}}]' if c else '–'} | "
                   f"{f'{lay:.2f}' if lay else '–'} / {f'{dlay:.2f}' if dlay else '–'} |\n")
    return fig, md + _published_table(acc, cell)


def _published_table(acc, cell) -> str:
    """Dense accuracies beside the figures published for the same model, and what differs."""
    from specee.evaluation import published
    models = sorted({d["config"]["model"]["name"] for d in acc if d.get("config")})
    md = ""
    for model in models:
        pub = published.load(model)
        if not pub:
            continue
        md += (f"\n**{model}: dense against published figures** (%; ours on the shipped items, n as above)\n\n"
               "| task | ours ± 95% CI (metric) | published | source | note |\n|---|---|---|---|---|\n")
        for task, entries in sorted(pub["tasks"].items()):
            dense = cell.get(task, {}).get("dense")
            for e in entries:
                ours = dense.get(e["compare_with"]) if dense else None
                se = dense.get(f"{e['compare_with']}_stderr") if dense else None
                ci = f" ± {196 * se:.1f}" if se is not None and ours is not None else ""
                md += (f"| {task} | {f'{100 * ours:.1f}{ci}' if ours is not None else '–'} ({e['compare_with']}) | "
                       f"{e['value']:.1f} | {e['source']} | {e.get('note', '')} |\n")
        md += "\n" + "".join(f"- `{k}`: {v['title']} ({v['url']}); differs: {v['differs']}\n"
                              for k, v in pub["sources"].items())
    return md


def fig_verdicts(docs):
    """One row per claim of the paper, protocol and bank: its figure, interval and verdict."""
    from specee import verdicts
    rows = verdicts.verdict_rows(docs, paired_change)
    if not rows:
        raise Skip("no results that test a claim of the paper (accuracy against dense, stats, speed)")
    fig, ax = plt.subplots(figsize=(16, 1.6 + 0.42 * len(rows)))
    ax.axis("off")
    # Which model, protocol and bank (with its folder) each row rests on, and why a row is not testable.
    cols = ["claim", "model", "task", "protocol", "mode", "bank (folder)", "figure [95% CI]", "verdict"]
    cells = [[r["claim"], r.get("model", "?"), r["task"], r["protocol"], r["mode"], verdicts.bank_text(r).replace("`", ""),
              r["figure"], r["verdict"] + (f"\n({r['why']})" if r.get("why") else "")] for r in rows]
    tab = ax.table(cellText=cells, colLabels=cols, loc="center", cellLoc="left")
    tab.auto_set_font_size(False)
    tab.set_fontsize(6)
    tab.scale(1, 1.8)
    colour = {"confirmed": "#d9f2d9", "refuted": "#f7d4d4", "inconclusive": "#fff2cc"}
    for i, r in enumerate(rows, 1):
        tab[i, 7].set_facecolor(colour.get(r["verdict"], "#e6e6e6"))
    n = verdicts.counts(rows)
    ax.set_title("Verdict per claim of the paper, per protocol and predictor bank "
                 f"({', '.join(f'{v} {k}' for k, v in sorted(n.items()))})\n{_stamp(docs)}", fontsize=10)
    return fig, verdicts.markdown(rows)


def _set_label(doc) -> str:
    """A speed result's prompt set: the dataset, with its Spec-Bench category when one was chosen."""
    ds = doc["config"].get("dataset") or {}
    cats = ds.get("categories") or []
    return ds.get("name", "?") + (f":{','.join(cats)}" if cats else "")


def fig_paper_beside(docs):
    """Each measured row of a model the paper reports on, beside the paper's own figure for it
    (specee/paper_figures.py; "not digitised" where the harness holds none). A row measured on
    random weights says so: its speed is a cost on the real shape, its accuracy says nothing."""
    from specee import paper_figures as pf
    mine = [d for d in docs if d["config"]["model"]["name"] in pf.MODELS]
    if not mine:
        raise Skip(f"no results for a model the paper reports on ({', '.join(pf.MODELS)})")

    def basis(d) -> str:
        syn = d.get("synthetic") or {}
        return "random weights: cost only" if "weights" in syn else ("synthetic: " + ", ".join(syn) if syn else "measured")
    rows = []
    for d in _by_kind(mine, "speed"):
        m, name = d["metrics"], d["config"]["ablation"]["name"]
        ci = m.get("speedup_vs_dense_ci")
        rows.append(["speed", _set_label(d), name, pf.step(name),
                     f"{m['speedup_vs_dense']:.3f}×" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""),
                     pf.speed_figure(name),
                     f"{m['avg_layers']:.1f} of {m.get('num_layers', '?')}" if m.get("avg_layers") else "–",
                     pf.layers_figure(name), basis(d)])
    acc = [d for d in mine if "accuracy" in d.get("metrics", {})]
    dense_acc = {t: m for d in acc if d["config"]["ablation"]["name"] == "dense"
                 for t, m in d["metrics"]["accuracy"].items()}
    for d in acc:
        name = d["config"]["ablation"]["name"]
        for task, m in sorted(d["metrics"]["accuracy"].items()):
            if m.get("lower_is_better"):
                continue
            v = 100 * m.get("accuracy", 0.0)
            dv = dense_acc.get(task)
            delta = f" ({v - 100 * dv['accuracy']:+.1f} vs dense)" if dv is not None and name != "dense" else ""
            rows.append(["accuracy", task, name, pf.step(name), f"{v:.1f} %{delta}", pf.accuracy_figure(name),
                         f"{m['mean_layers']:.1f}" if m.get("mean_layers") else "–", "–", basis(d)])
    for d in _by_kind(mine, "stats"):
        skew = d["metrics"].get("exit_distribution", {}).get("all", {}).get("skew_bottom_half_by_probability")
        if skew is not None:
            rows.append(["exit statistics", "exits in the lower-probability half", d["config"]["ablation"]["name"],
                         "T1 (all layers)", f"{skew:.3f}", pf.SKEW, "–", "–", basis(d)])
    if not rows:
        raise Skip("no speed, accuracy or statistics results for a model the paper reports on")
    cols = ["kind", "set / task", "ablation", "paper's step", "measured", "the paper's figure", "layers measured",
            "layers (paper)", "basis"]
    fig, ax = plt.subplots(figsize=(17, 1.6 + 0.36 * len(rows)))
    ax.axis("off")
    tab = ax.table(cellText=rows, colLabels=cols, loc="center", cellLoc="left")
    tab.auto_set_font_size(False)
    tab.set_fontsize(6.5)
    tab.scale(1, 1.4)
    ax.set_title(f"Measured beside the paper's own figures ({pf.SOURCE})\n{_stamp(mine)}", fontsize=10)
    md = ("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
          + "".join("| " + " | ".join(str(c) for c in r) + " |\n" for r in rows))
    md += (f"\nThe paper's figures: {pf.SOURCE}, for Llama-2-7B. \"{pf.NOT_DIGITISED}\": the paper reports one (its "
           "per-dataset bars, its accuracy table's per-task values) that is not recorded in this harness; no figure "
           "is shown that was not checked. Rows on random weights (model.init=random) measure cost on the real "
           "shape: set them beside the paper's speed, never its accuracy.\n")
    return fig, md


def fig_potential(docs):
    """experiment=potential: per model, the share of tokens each layer already predicts, and the
    ceilings on SpecEE's speedup here and on a named GPU (one row per model of a sweep)."""
    pots = _by_kind(docs, "potential")
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
    ax.set_title(f"Exit potential: agreement of each layer with the final token\n{_stamp(pots)}", fontsize=10)
    ax.legend(fontsize=8)
    md += ("\nCeilings assume exits at the oracle floor with no wrong exit (T1+T2: plus a third of T1's predictor "
           "calls, and one draft step per token); the GPU column prices the same work analytically "
           f"({pots[0]['metrics']['unit_costs']['gpu']['method']}).\n")
    return fig, md


def fig_runtime(docs):
    """Eager vs compiled runtime per mode: ms/token against the bandwidth floor, and what the
    early-exit modes keep of their speedup on the faster runtime."""
    speed = _by_kind(docs, "speed")
    comp = [d for d in speed if _runtime(d) == "compiled"]
    if not comp:
        raise Skip("no speed results on runtime=compiled")
    rows = []
    for d in sorted(comp, key=lambda d: ABLATION_ORDER.index(d["config"]["ablation"]["name"])
                    if d["config"]["ablation"]["name"] in ABLATION_ORDER else 99):
        base = _name(d).replace(" (compiled)", "")
        eager = [e["metrics"] for e in speed if _runtime(e) == "eager" and _name(e) == base]
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
    ax.set_title(f"Eager vs compiled runtime\n{_stamp(comp)}", fontsize=10)
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
    speed = [d for d in _by_kind(docs, "speed") if d["metrics"].get("oracle_gap")]
    if not speed:
        raise Skip("no speed results with the exit-vs-oracle measurement")
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    md = ("| mode | avg layers | oracle | over oracle | at oracle | +1–2 | later | never | earlier (token ≠ full stack) | "
          "fire precision | refuted fires/token | their cost (layer-units/token) | match rate |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    cards = {}
    for d in sorted(speed, key=lambda d: _order([_name(d)])[0]):
        m, g = d["metrics"], d["metrics"]["oracle_gap"]
        hist = {int(k): v for k, v in g["layers_over_oracle_histogram"].items()}
        xs = np.arange(min(hist), max(hist) + 1)
        ax.step(xs, [hist.get(int(x), 0) / g["tokens"] for x in xs], where="mid", label=_name(d))
        units = (m.get("cost_model") or {}).get("units_us") or {}
        ratio = units["lm_head"] / units["layer"] if units.get("layer") else None
        refuted = m.get("refuted_fires_per_token")
        cost = f"{refuted * ratio:.2f}" if refuted is not None and ratio else "–"
        f = lambda x: "–" if x is None else f"{x:.3f}"  # noqa: E731
        md += (f"| {_name(d)} | {m['avg_layers']:.2f} | {g['oracle_avg_layers']:.2f} | {g['avg_layers_over_oracle']:.3f} | "
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
    fig.suptitle(_stamp(speed), fontsize=9)
    md += ("\nOracle: per token, the earliest layer whose argmax equals the full stack's at the mode's own "
           "context (computed untimed after the timed pass). \"earlier\": the mode exited below it, so its token "
           "differs from what the full stack would say there (a lossy exit). A refuted fire is a predictor "
           "firing whose LM-head verification failed: a full LM head bought nothing.\n")
    return fig, md


def fig_cost_model(docs):
    """Every speed result's measured speedup beside its cost model: counted work x unit costs
    measured in the same job; the two costs that separate it from the layer ratio; the same
    counts priced for Llama-2 shapes on a GPU (analytic unless a GPU-measured table was given)."""
    speed = [d for d in _by_kind(docs, "speed")
             if "modelled_speedup_vs_dense" in (d["metrics"].get("cost_model") or {})]
    if not speed:
        raise Skip("no speed results with a cost model (experiment.cost_rounds=0 or older results)")
    speed = sorted(speed, key=lambda d: _order([_name(d)])[0])
    fig, ax = plt.subplots(figsize=(7.5, 6))
    md = ("| mode | measured [95% CI] | modelled [band] | agree | unmodelled share | top costs beyond the layer "
          "ratio L/avg layers (layer-units/token) | Llama-2-7B / 13B predicted |\n|---|---|---|---|---|---|---|\n")
    for d in speed:
        m, c = d["metrics"], d["metrics"]["cost_model"]
        lo, hi = m["speedup_vs_dense_ci"]
        blo, bhi = c["modelled_band"]
        x, y = c["modelled_speedup_vs_dense"], m["speedup_vs_dense"]
        ax.errorbar(x, y, yerr=[[y - lo], [hi - y]], xerr=[[max(0, x - blo)], [max(0, bhi - x)]], fmt="o",
                    capsize=3, label=_name(d))
        agree = "yes" if c["model_in_measured_ci"] else "in band" if c["measured_in_model_band"] else "no"
        if "block_costs" in c:  # prompt lookup: priced by the block-cost table c(n), not by units
            gap = f"blocks of {c['counts']['mean_block']:.2f} tokens, {c['counts']['steps_per_token']:.3f} steps/token"
        else:
            gap = "; ".join(f"{g['cost']} {g['layer_units_per_token']:.2f}" for g in c["gap_to_layer_ratio"]) or "–"
        gpu = (c.get("predicted_gpu") or {}).get("speedup_vs_dense")
        md += (f"| {_name(d)} | {y:.3f} [{lo:.3f}, {hi:.3f}] | {x:.3f} [{blo:.2f}, {bhi:.2f}] | {agree} | "
               f"{c['unmodelled_share']:+.1%} | {gap} | "
               + (f"{gpu['llama2_7b']:.2f} / {gpu['llama2_13b']:.2f} |\n" if gpu else "– (not priced for a GPU) |\n"))
    lims = [min(ax.get_xlim()[0], ax.get_ylim()[0]), max(ax.get_xlim()[1], ax.get_ylim()[1])]
    ax.plot(lims, lims, "k--", lw=0.8)
    ax.set_xlabel("modelled speedup vs dense (×): counted work × unit costs, band over rounds")
    ax.set_ylabel("measured decode speedup vs dense (×), 95% CI over prompts")
    ax.set_title(f"Measured against modelled speedup\n{_stamp(speed)}", fontsize=10)
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
    speed = [d for d in _by_kind(docs, "speed") if "speedup_vs_dense" in d["metrics"]]
    if not any(d["config"]["ablation"]["name"] in PEER_METHODS for d in speed):
        raise Skip(f"no speed results for any of {', '.join(PEER_METHODS)}")
    models = sorted({d["config"]["model"]["name"] for d in speed})
    grid = {}  # (model, category, method) -> cell, lossless
    for d in speed:
        lossless = d["metrics"]["match_rate_vs_dense"] >= 1.0
        for cat, cell in _category_cells(d).items():
            grid[(d["config"]["model"]["name"], cat, _name(d))] = (cell, lossless)
    cats = sorted({c for _, c, _ in grid})
    methods = _order({n for _, _, n in grid if n != "dense"})
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
                cell, name = (1.0, None, None), "dense"
            else:
                cell, name = best
            anyone = max(((grid[(model, c, n)][0], n) for n in methods if (model, c, n) in grid), default=None,
                         key=lambda x: x[0][0])
            match = next((d["metrics"]["match_rate_vs_dense"] for d in speed if anyone and _name(d) == anyone[1]
                          and d["config"]["model"]["name"] == model), None)
            ci = f"[{cell[1][0]:.2f}, {cell[1][1]:.2f}] n={cell[2]}" if cell[1] else "(the baseline)"
            above = "–" if name == "dense" else ("yes" if cell[1][0] > 1.0 else "no: ties dense")
            md += (f"| {model} | {c} | {name} | {cell[0]:.2f} {ci} | {above} | "
                   + (f"{anyone[1]} {anyone[0][0]:.2f} ({match:.3f})" if anyone else "–") + " |\n")
    ax.set_title(f"Which method, here? Speedup per category and method\n{_stamp(speed)}", fontsize=10)
    md += ("\n| method (model) | speedup [95% CI] | tokens per step (τ) | match rate | against transformers' own "
           "| predicted (chosen setting) |\n|---|---|---|---|---|---|\n")
    for d in sorted(speed, key=lambda d: (d["config"]["model"]["name"], _order([_name(d)]))):
        m, name = d["metrics"], _name(d)
        if d["config"]["ablation"]["name"] not in PEER_METHODS:
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
    speed = [d for d in _by_kind(docs, "speed")
             if "predicted_gpu_paths" in (d["metrics"].get("cost_model") or {})]
    if not speed:
        raise Skip("no speed results with per-path GPU pricing (experiment.cost_rounds=0 or older results)")
    speed = sorted(speed, key=lambda d: _order([_name(d)])[0])
    parts = ("layers", "lm_heads", "predictors", "draft", "host")
    fig, ax = plt.subplots(figsize=(8, 5.5))
    labels, bottoms = [], None
    rows = []
    for d in speed:
        p = d["metrics"]["cost_model"]["predicted_gpu_paths"]["by_model"]["llama2_7b"]
        for path, v in p["paths"].items():
            labels.append(f"{_name(d)}\n{path.replace('_', ' ')}")
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
        measured = f"{d['metrics']['ms_per_token']:.2f} ms/token ({_runtime(d)})" if on_gpu else "– (not a GPU run)"
        md += (f"| {_name(d)} | {path.replace('_', ' ')} | {t['total'] / 1e3:.2f} | {t['host'] / 1e3:.2f} | "
               f"{v['speedup_vs_dense_same_path']:.3f} | {v['speedup_vs_strongest_dense']:.3f} | {measured} |\n")
    dense = speed[0]["metrics"]["cost_model"]["predicted_gpu_paths"]["by_model"]["llama2_7b"]["dense_us_per_token"]
    md += (f"\nDense (modelled, 7B): eager {dense['eager'] / 1e3:.2f} ms/token, graphed {dense['graphed'] / 1e3:.2f} "
           f"ms/token. Prices: {method}. Counts come from each run's own traces (depth rescaled to 32 "
           "layers); the prices are stated floors, not GPU measurements — a GPU run's measured ms/token "
           "stands beside them.\n")
    return fig, md


FIGURES = [
    ("Speedup per dataset and method", fig_speedup_per_category),
    ("Which method, here?", fig_which_method),
    ("Ablation staircase", fig_staircase),
    ("Measured against modelled speedup", fig_cost_model),
    ("Where a token's time goes on a GPU, per path", fig_gpu_paths),
    ("Exit-layer distribution", fig_exit_distribution),
    ("Context similarity", fig_context_similarity),
    ("Predictor count and overhead", fig_overhead),
    ("Exits against the oracle", fig_exit_vs_oracle),
    ("Accuracy", fig_accuracy),
    ("Verdicts on the paper's claims", fig_verdicts),
    ("Beside the paper's own figures", fig_paper_beside),
    ("Will SpecEE pay off here? (potential)", fig_potential),
    ("Eager vs compiled runtime", fig_runtime),
]


def build_report(docs: list[dict], out_dir: Path, source: str) -> dict:
    """Write report.pdf and summary.md into ``out_dir``; return pages made and skipped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sns.set_theme(style="whitegrid", context="paper")
    made, skipped, md_parts = [], [], []
    pdf_tmp, md_tmp = out_dir / ".report.pdf.tmp", out_dir / ".summary.md.tmp"
    with PdfPages(pdf_tmp) as pdf:
        figures = []
        for title, fn in FIGURES:
            try:
                fig, md = fn(docs)
            except Skip as why:
                skipped.append((title, str(why)))
                continue
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
                pdf_tmp.unlink(missing_ok=True)
                raise SpeceeError(f"report page {title!r} cannot be drawn from these results "
                                  f"({type(err).__name__}: {err}); the report in {out_dir} was not "
                                  "updated") from None
            figures.append((title, fig))
            md_parts.append(f"## {title}\n\n{md}")
        cover = plt.figure(figsize=(8.5, 11))
        lines = [f"specee report — {source}", f"generated {date.today().isoformat()} from {len(docs)} result files",
                 "", "Pages:"] + [f"  {i + 2}. {t}" for i, (t, _) in enumerate(figures)] + \
                ["", "Skipped:"] + [f"  {t}: {why}" for t, why in skipped or [("none", "")]]
        cover.text(0.08, 0.92, "\n".join(lines), va="top", family="monospace", fontsize=9)
        pdf.savefig(cover)
        plt.close(cover)
        for title, fig in figures:
            fig.tight_layout()
            pdf.savefig(fig)
            plt.close(fig)
            made.append(title)
    md = [f"# specee report\n\nSource: `{source}` · {len(docs)} result files · generated {date.today().isoformat()}\n"]
    md += md_parts
    if skipped:
        md.append("## Skipped figures\n\n" + "".join(f"- {t}: {why}\n" for t, why in skipped))
    md_tmp.write_text("\n".join(md))
    pdf_tmp.replace(out_dir / "report.pdf")
    md_tmp.replace(out_dir / "summary.md")
    return {"pages": ["cover", *made], "skipped": skipped, "pdf": str(out_dir / "report.pdf"),
            "markdown": str(out_dir / "summary.md")}
