"""The pages on the paper's claims: accuracy against dense (Table 4), a verdict per claim, and the
measured rows beside the paper's own figures."""
from __future__ import annotations

from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from specee import ablations  # noqa: E402
from specee.intervals import paired_change  # noqa: E402
from specee.report_pages.catalogue import (Skip, by_kind, display_name, ordered, reference_name,  # noqa: E402
                                           set_label, stamp)


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
            cell[task][display_name(d)] = m
            if task in d.get("items", {}):
                items[task][display_name(d)] = d["items"][task]
    names = ordered({n for t in cell.values() for n in t}, acc)
    tasks = sorted(cell)
    ref = reference_name(acc)
    paired = {(t, n): paired_change(items[t].get(ref), items[t][n],
                                    1 if cell[t][n].get("lower_is_better") else 100)
              for t in tasks for n in items[t] if n != ref}

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
        dense = cell[t].get(ref)
        row = []
        for n in names:
            m = cell[t].get(n)
            if m is None:
                row.append("–")
                continue
            delta = f" ({value(m) - value(dense):+.{3 if m.get('lower_is_better') else 1}f})" \
                if dense is not None and n != ref else ""
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
                 f"{stamp(acc)}", fontsize=10)
    md = ("| task | metric | mode | dense | mode value | Δ | Δ 95% CI (paired) | answers changed (→ wrong / → right) "
          "| n | 95% CI (mode) | avg layers (mode / dense) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|\n")
    for t in tasks:
        dense = cell[t].get(ref)
        for n in names:
            m = cell[t].get(n)
            if m is None or (n == ref and len(cell[t]) > 1):
                continue
            low = m.get("lower_is_better")
            fmt = ".3f" if low else ".1f"
            c = ci(m)
            dv = f"{value(dense):{fmt}}" if dense else "–"
            delta = f"{value(m) - value(dense):+{fmt}}" if dense and n != ref else "–"
            lay = m.get("mean_layers")
            dlay = dense.get("mean_layers") if dense else None
            pc = paired.get((t, n))
            pci = f"[{pc['lo']:+{fmt}}, {pc['hi']:+{fmt}}]" if pc else "–"
            chg = (f"{pc['changed']} ({pc['worse']} / {pc['better']})" if pc and not low else "–")
            md += (f"| {t} | {m.get('primary_metric', 'acc')}{' (lower better)' if low else ' (%)'} | {n} | {dv} | "
                   f"{value(m):{fmt}} | {delta} | {pci} | {chg} | {m.get('n', '–')} | "
                   f"{f'[{c[0]:{fmt}}, {c[1]:{fmt}}]' if c else '–'} | "
                   f"{f'{lay:.2f}' if lay else '–'} / {f'{dlay:.2f}' if dlay else '–'} |\n")
    return fig, md + _published_table(acc, cell, ref)


def _published_table(acc, cell, ref) -> str:
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
            dense = cell.get(task, {}).get(ref)
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
    rows = verdicts.verdict_rows(docs)
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
                 f"({', '.join(f'{v} {k}' for k, v in sorted(n.items()))})\n{stamp(docs)}", fontsize=10)
    return fig, verdicts.markdown(rows)


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
    for d in by_kind(mine, "speed"):
        m, name, ident = d["metrics"], d["config"]["ablation"]["name"], ablations.of_doc(d)
        ci = m.get("speedup_vs_dense_ci")
        rows.append(["speed", set_label(d), name, pf.step(ident),
                     f"{m['speedup_vs_dense']:.3f}×" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""),
                     pf.speed_figure(ident),
                     f"{m['avg_layers']:.1f} of {m.get('num_layers', '?')}" if m.get("avg_layers") else "–",
                     pf.layers_figure(ident), basis(d)])
    acc = [d for d in mine if "accuracy" in d.get("metrics", {})]
    dense_acc = {t: m for d in acc if ablations.of_doc(d).reference for t, m in d["metrics"]["accuracy"].items()}
    for d in acc:
        name, ident = d["config"]["ablation"]["name"], ablations.of_doc(d)
        for task, m in sorted(d["metrics"]["accuracy"].items()):
            if m.get("lower_is_better"):
                continue
            v = 100 * m.get("accuracy", 0.0)
            dv = dense_acc.get(task)
            delta = f" ({v - 100 * dv['accuracy']:+.1f} vs dense)" if dv is not None and not ident.reference else ""
            rows.append(["accuracy", task, name, pf.step(ident), f"{v:.1f} %{delta}", pf.accuracy_figure(ident),
                         f"{m['mean_layers']:.1f}" if m.get("mean_layers") else "–", "–", basis(d)])
    for d in by_kind(mine, "stats"):
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
    ax.set_title(f"Measured beside the paper's own figures ({pf.SOURCE})\n{stamp(mine)}", fontsize=10)
    md = ("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
          + "".join("| " + " | ".join(str(c) for c in r) + " |\n" for r in rows))
    md += (f"\nThe paper's figures: {pf.SOURCE}, for Llama-2-7B. \"{pf.NOT_DIGITISED}\": the paper reports one (its "
           "per-dataset bars, its accuracy table's per-task values) that is not recorded in this harness; no figure "
           "is shown that was not checked. Rows on random weights (model.init=random) measure cost on the real "
           "shape: set them beside the paper's speed, never its accuracy.\n")
    return fig, md
