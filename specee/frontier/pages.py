"""The frontier's report: one figure per model (speedup against quality loss, a line per policy,
lossless peers as points, the oracle's curve, the budget as a band), the table "at the paper's
budget", replay against real runs, and the joint claim as one verdict per model and task."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specee.errors import SpeceeError
from specee.frontier.replay import DECIDERS


def replay_vs_real(curves: dict, measured: dict) -> dict:
    """Per policy, replay's figures beside the real runs' at the same points (test prompts): the
    largest gaps in layers per token and in token disagreement (real: at its own context)."""
    out = {}
    for name, pts in measured.items():
        if name not in curves:
            continue
        rows = []
        for p in pts:
            r = curves[name][p["index"]]["test"]
            rows.append({"value": p["value"], "kv_policy": p.get("kv_policy"), "replay_avg_layers": r["avg_layers"], "real_avg_layers": p["avg_layers"],
                         "replay_disagreement": r["token_disagreement"],
                         "real_disagreement": p["own_context_disagreement"],
                         "replay_sequence_identity": r["sequence_identity"],
                         "real_sequence_identity": p["sequence_identity"],
                         "modelled_speedup": r["modelled_speedup"], "measured_speedup": p["speedup"],
                         "measured_ci": p["speedup_ci"]})
        out[name] = {"points": rows,
                     "max_layer_gap": max(abs(r["replay_avg_layers"] - r["real_avg_layers"]) for r in rows) if rows else None,
                     "max_disagreement_gap": max(abs(r["replay_disagreement"] - r["real_disagreement"]) for r in rows)
                     if rows else None}
    return out


def agreement_near_budget(m: dict) -> dict | None:
    """Replay against reality where a budget is spent: over the measured points whose replay differs
    from the full stack on at most the largest calibrated budget's share of tokens (the points a
    calibration can choose), the largest gaps in layers per token, in tokens differing, and between
    modelled and measured speed (relative). None when no measured point lies there."""
    budgets = [float(d) for d in m.get("screen_at", {})] or [float(m["delta"])]
    limit = max(budgets)
    rows = [r for a in m["replay_vs_real"].values() for r in a["points"] if r["replay_disagreement"] <= limit]
    if not rows:
        return None
    return {"budget": limit, "points": len(rows),
            "layers": max(abs(r["replay_avg_layers"] - r["real_avg_layers"]) for r in rows),
            "disagreement": max(abs(r["replay_disagreement"] - r["real_disagreement"]) for r in rows),
            "speed": max(abs(r["modelled_speedup"] / r["measured_speedup"] - 1) for r in rows)}


def closest_to_oracle(m: dict, d: float, ob: dict) -> str:
    """Which exit rule comes closest to the teacher-forced reference at the budget: per policy the
    fastest grid point (modelled) whose replayed held-out loss is within ``d``, and beside it the
    fastest point certified on real decoding."""
    best = []
    for name, rows in m["curves"].items():
        ok = [r for r in rows if np.mean(r["test"]["per_request_loss"]) <= d]
        if ok:
            r = max(ok, key=lambda r: r["test"]["modelled_speedup"])
            best.append((r["test"]["modelled_speedup"], name, r["value"]))
    if not best:
        return f"Closest to the reference at δ = {d:g}: no policy has a grid point with replayed loss ≤ δ."
    sp, name, value = max(best)
    pol = m["policies"][name]
    cert = [(m["calibration"][n].get("modelled_speedup"), n) for n in m["calibration"]
            if m["calibration"][n].get("chosen") is not None]
    cert_txt = (f"; on real decoding the fastest certified point is {m['policies'][max(cert)[1]]['label']}'s "
                f"({max(cert)[0]:.3f}× modelled)" if cert else "; on real decoding no policy is certified")
    return (f"Closest to the reference at δ = {d:g} (replay screen, held-out prompts): **{pol['label']}** at "
            f"{pol['knob']} = {value:g}, {sp:.3f}× modelled against the reference's {ob['modelled_speedup']:.3f}×"
            + cert_txt + ".")


def claim_of(policy: dict) -> str:
    """The claim a row tests, in the policy's own name: SpecEE's for SpecEE, a peer's for a peer."""
    # the kinds' registry says whose claim a kind tests; results from before kinds were recorded are SpecEE's
    decider = DECIDERS.get(policy.get("kind"), DECIDERS["specee"])
    who = f"SpecEE ({policy['label']})" if decider.is_specee else f"{policy['label']} (a peer, not SpecEE)"
    return f"{who} is faster than dense at <= delta loss"


def scope_line(cfg, num_layers: int) -> str:
    """What a verdict covers: this model, machine, batch 1, greedy decoding of this length, the
    project's own draft and predictors, prompts like the calibration ones."""
    from specee.env import environment
    env = environment()
    return (f"{cfg.model.name} ({num_layers} layers) on {machine(env)}; batch 1, greedy, "
            f"{cfg.experiment.max_new_tokens} new tokens; this project's draft head and predictors; "
            f"{cfg.dataset.name if 'name' in cfg.dataset else 'the dataset group'}'s prompts like the calibration ones")


def joint_verdict(cal: dict, measured_pt: dict | None, refute: dict | None, delta: float,
                  never_exit_first: bool = True) -> tuple[str, str]:
    """The joint claim "some operating point is faster than dense at <= delta loss", decided soundly:

    - confirmed: a point certified on the real decoder's loss whose measured speedup interval lies
      above 1;
    - refuted: every grid point whose speed could reach 1x has a real-loss lower bound above delta
      (jointly, with the correction ``refute`` names);
    - inconclusive otherwise, saying which side is short (calibration units, or speed).
    A certified point that is slower than dense does not refute the claim: a faster point may still
    be within the budget."""
    grid_note = "" if never_exit_first else "; the grid's most conservative point already exits (not the never-exit point)"
    if cal.get("chosen") is not None and measured_pt is not None and measured_pt["speedup_ci"][0] > 1:
        lo, hi = measured_pt["speedup_ci"]
        return "confirmed", (f"{measured_pt['speedup']:.3f}x [{lo:.3f}, {hi:.3f}] at a point certified on real "
                             f"decoding (held-out real loss {cal['test_loss']:.4f})")
    if refute is not None and refute["refuted"]:
        if not refute["fast_points"]:
            return "refuted", "no grid point's speed reaches 1x (modelled band, measured interval)" + grid_note
        lb = min(r["loss_lower_bound"] for r in refute["points"])
        return "refuted", (f"all {refute['fast_points']} point(s) whose speed could reach 1x lose more than "
                           f"{delta:g} on real decoding (smallest lower bound {lb:.4f}; {refute['correction']})" + grid_note)
    short = []
    if cal.get("chosen") is None:
        short.append("units: " + cal.get("why_none", "no point certified"))
    elif measured_pt is None:
        short.append(f"speed: the certified point is modelled at {cal['modelled_speedup']:.3f}x, not measured")
    else:
        lo, hi = measured_pt["speedup_ci"]
        side = "slower than dense" if hi < 1 else "its interval contains 1"
        short.append(f"speed: the certified point runs at {measured_pt['speedup']:.3f}x [{lo:.3f}, {hi:.3f}], {side}")
    if refute is not None and refute["short"]:
        short.append(f"{len(refute['short'])} of {refute['fast_points']} fast point(s) not shown over budget "
                     f"(values {', '.join(f'{v:g}' for v in refute['short'][:4])})")
    return "inconclusive", "; ".join(short) + grid_note


def verdicts(m: dict, model: str, scope: str = "") -> list[dict]:
    """One row per model, task (Spec-Bench token disagreement, each accuracy task) and policy."""
    rows = []
    oracle = {o["budget"]: o for o in m["oracle"]}
    ob = oracle.get(m["delta"]) or min(m["oracle"], key=lambda o: abs(o["budget"] - m["delta"]))
    L = m["num_layers"]
    for name, cal in m["calibration"].items():
        pt = next((p for p in m["measured"].get(name, []) if p["index"] == cal.get("chosen")
                   and p.get("kv_policy") == cal.get("kv_policy")), None)
        first = m["curves"][name][0]["calibration"]
        v, fig = joint_verdict(cal, pt, m.get("refutation", {}).get(name), m["delta"], first["avg_layers"] >= L - 1e-9)
        rows.append({"model": model, "task": "spec_bench (tokens differing, own context)", "policy": name,
                     "claim": claim_of(m["policies"][name]), "verdict": v, "figure": fig, "delta": m["delta"],
                     "epsilon": m["epsilon"], "scope": scope, "kv_policy": cal.get("kv_policy"),
                     "oracle": f"{ob['modelled_speedup']:.3f}x modelled at a {ob['budget']:g} token budget "
                               "(teacher-forced, cost-free reference)"})
    n_timed = m["prompts"]["timed"]
    for tname, task in m.get("tasks", {}).items():
        if task.get("rolling"):
            continue
        for name in m["calibration"]:
            cal = (task.get("calibration") or {}).get(name, {})
            if not task.get("testable", False):
                v, fig = "not testable", task.get("why_not_testable") or ""
            elif cal.get("on") != "real decoding":  # a result from before items were certified on real answers
                v, fig = "inconclusive", "replay only: the real decoder's item loss is not certified"
            else:  # item flips of the real decoder's answers; the speed is Spec-Bench's at the same point
                pt = next((p for p in m["measured"].get(name, []) if p["index"] == cal.get("chosen")
                           and p.get("kv_policy") == cal.get("kv_policy")), None)
                v, fig = joint_verdict(cal, pt, None, m["delta"], True)
                fig += (f"; item loss: answers flipping right → wrong on real decoding ({cal['calibration_units']} "
                        f"calibration items); speed: Spec-Bench timing at the same point ({n_timed} prompts), not "
                        "this task's workload; no refutation rule for items")
            orc = task.get("oracle", {}).get("test", {})
            rows.append({"model": model, "task": tname, "policy": name, "claim": claim_of(m["policies"][name]),
                         "verdict": v, "figure": fig, "delta": m["delta"], "epsilon": m["epsilon"], "scope": scope,
                         "oracle": (f"earliest-agreeing exits (teacher-forced reference): "
                                    f"{orc.get('delta', float('nan')):+.1f} points at "
                                    f"{orc.get('avg_layers', float('nan')):.1f} layers") if orc else ""})
    return rows


def machine(env: dict) -> str:
    cpu = env.get("cpu", "?")
    gpus = env.get("gpus") or []
    threads = env.get("torch_threads")
    return (", ".join(str(g.get("name", g)) if isinstance(g, dict) else str(g) for g in gpus) or
            f"{cpu} ({env.get('cpu_count', '?')} cores, {threads} torch threads)")


def _speed_axis(ax, label: str) -> None:
    """Speedups on a log axis (a ratio: 0.5x and 2x equally far from dense), ticks as plain numbers."""
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    ticks = [t for t in (0.1, 0.125, 0.25, 0.5, 0.8, 1.0, 1.25, 1.5, 2.0, 4.0, 8.0, 16.0) if lo <= t <= hi]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_ylabel(label)


def figure(m: dict, path: Path, title: str) -> None:
    """Left: Spec-Bench, speedup against tokens differing. Then one panel per accuracy task: speedup
    against the accuracy lost (points, test split), each policy's replayed points."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    acc_tasks = [t for t, v in m.get("tasks", {}).items() if not v.get("rolling")]
    fig, axes = plt.subplots(1, 1 + len(acc_tasks), figsize=(7.5 + 4.2 * len(acc_tasks), 5.6), squeeze=False)
    ax = axes[0][0]
    delta = m["delta"]
    ax.axvspan(0, 100 * delta, color="tab:green", alpha=0.12, label=f"budget ≤ {100 * delta:g} % of tokens")
    colors = {}
    for name, rows in m["curves"].items():
        x = [100 * r["test"]["token_disagreement"] for r in rows]
        y = [r["test"]["modelled_speedup"] for r in rows]
        line, = ax.plot(x, y, marker="o", ms=3, label=f"{m['policies'][name]['label']} (replayed, modelled)")
        colors[name] = line.get_color()
        for p in m["measured"].get(name, []):
            lo, hi = p["speedup_ci"]
            ax.errorbar([100 * p["own_context_disagreement"]], [p["speedup"]], yerr=[[p["speedup"] - lo], [hi - p["speedup"]]],
                        fmt="s", color=line.get_color(), ms=5, mfc="none", capsize=2)
    for name, pts in m["measured"].items():
        if name in m["curves"]:
            continue
        ax.plot([100 * p["own_context_disagreement"] for p in pts], [p["speedup"] for p in pts], marker="s", ls="--",
                label=f"{name} (measured)")
    ax.plot([100 * o["token_disagreement"] for o in m["oracle"]], [o["modelled_speedup"] for o in m["oracle"]],
            color="black", lw=2, label="oracle: teacher-forced, cost-free reference (earliest agreeing layer)")
    for name, p in m["lossless_peers"].items():
        lo, hi = p["speedup_ci"]
        ax.errorbar([0], [p["speedup"]], yerr=[[p["speedup"] - lo], [hi - p["speedup"]]], fmt="*", ms=10,
                    capsize=2, label=f"{p['label']} (lossless, measured)")
    _speed_axis(ax, "decode speedup against dense (×, log scale)")
    ax.set_xlabel("loss: mean per-prompt share of tokens the full stack would not emit (%, test prompts)")
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlim(left=-0.05)
    ax.set_title(title, fontsize=10)
    first = ax
    for ax, tname in zip(axes[0][1:], acc_tasks):
        task = m["tasks"][tname]
        ax.axvspan(0, 100 * delta, color="tab:green", alpha=0.12)
        for name, pts in task["points"].items():
            curve = m["curves"][name]
            ax.plot([-p["test"]["delta"] for p in pts], [c["test"]["modelled_speedup"] for c in curve], marker="o", ms=3,
                    color=colors.get(name), label=m["policies"][name]["label"])
        _speed_axis(ax, "modelled decode speedup (×, log scale)")
        dn = task["dense"]["test"]
        note = "" if task.get("testable") else " — dense at chance"
        ax.set_title(f"{tname}: dense {100 * dn['accuracy']:.1f} % (n={dn['n']}){note}", fontsize=9)
        ax.set_xlabel("accuracy lost against dense (points, test split)")
        ax.legend(fontsize=7, loc="best")
    # the first panel's legend under the figure: inside the panel it would hide the oracle's curve
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.legend(*first.get_legend_handles_labels(), loc="lower center", ncol=min(6, 2 + len(acc_tasks)), fontsize=7)
    fig.savefig(path.with_suffix(".png"), dpi=130, bbox_inches="tight")
    fig.savefig(path.with_suffix(".pdf"), bbox_inches="tight")
    plt.close(fig)


def certified_table(m: dict) -> list[str]:
    """Per policy, the point certified on real decoding, its held-out real loss and its speed."""
    d, eps = m["delta"], m["epsilon"]
    lines = [f"| policy | certified point (K/V) | calibration prompts | real loss, calibration (p) | held-out real loss "
             f"[{100 * (1 - eps):g} %] | held-out loss ≤ δ | sequences identical (held-out) | modelled speedup | "
             "measured speedup [95 %] |", "|---|---|---|---|---|---|---|---|---|"]
    for name, cal in m["calibration"].items():
        pol = m["policies"][name]
        label = pol["label"] + (" (fitted on its own split)" if pol.get("fitted") else "")
        if cal["chosen"] is None:
            lines.append(f"| {label} | none | {cal['calibration_units']} | – | – | – | – | – | {cal.get('why_none', '')} |")
            continue
        pt = next((p for p in m["measured"].get(name, []) if p["index"] == cal["chosen"]
                   and p.get("kv_policy") == cal["kv_policy"]), None)
        meas = f"{pt['speedup']:.3f} [{pt['speedup_ci'][0]:.3f}, {pt['speedup_ci'][1]:.3f}]" if pt else "–"
        lo, hi = cal["test_interval"]
        lines.append(f"| {label} | {pol['knob']} = {cal['value']:g} ({cal['kv_policy']}) | {cal['calibration_units']} | "
                     f"{cal['calibration_loss']:.4f} ({cal['p_value']:.3g}) | {cal['test_loss']:.4f} [{lo:.4f}, {hi:.4f}] "
                     f"({cal['test_units']} prompts) | {'yes' if cal['held_out_within_budget'] else 'no'} | "
                     f"{100 * cal['test_sequence_identity']:.1f} % | {cal['modelled_speedup']:.3f} | {meas} |")
    lines += ["", "Hypotheses tested on real runs, in their fixed order (stopped at the first not certified; a point "
                  "stops running prompts once even zero loss on the rest could not pass it):", "",
              "| policy | point | K/V | prompts run | real loss | sequences identical | p-value | certified |",
              "|---|---|---|---|---|---|---|---|"]
    if not any(cal.get("tested") for cal in m["calibration"].values()):
        lines.append("| – | none tested: no policy has enough calibration prompts to certify any point | – | – | – | – | – | – |")
    for name, cal in m["calibration"].items():
        for t in cal.get("tested", []):
            p = "stopped: cannot pass" if t["p_value"] is None else f"{t['p_value']:.3g}"
            lines.append(f"| {m['policies'][name]['label']} | {t['value']:g} | {t['kv_policy']} | {t['units_run']} | "
                         f"{t['loss']:.4f} | {100 * t['sequence_identity']:.1f} % | {p} | {'yes' if t['certified'] else 'no'} |")
    return lines


def screen_table(m: dict, screen: dict) -> list[str]:
    lines = ["| policy | point passing on replay | replayed calibration loss (bound) | replayed held-out loss | modelled speedup |",
             "|---|---|---|---|---|"]
    for name, cal in screen.items():
        label = m["policies"][name]["label"]
        if cal["chosen"] is None:
            lines.append(f"| {label} | none | {cal.get('why_none', '')} | – | – |")
            continue
        lines.append(f"| {label} | {m['policies'][name]['knob']} = {cal['value']:g} | {cal['calibration_loss']:.4f} "
                     f"({cal['calibration_bound']:.4f}) | {cal['test_loss']:.4f} | {cal['modelled_speedup']:.3f} |")
    return lines


def refutation_table(m: dict) -> list[str]:
    lines = ["| policy | points whose speed could reach 1× | correction | smallest real-loss lower bound | not shown over δ |",
             "|---|---|---|---|---|"]
    for name, r in m.get("refutation", {}).items():
        lb = min((p["loss_lower_bound"] for p in r["points"]), default=None)
        lines.append(f"| {m['policies'][name]['label']} | {r['fast_points']} | {r['correction']} | "
                     f"{'–' if lb is None else f'{lb:.4f}'} | {', '.join(f'{v:g}' for v in r['short']) or 'none'} |")
    return lines


def summary_md(doc: dict) -> str:
    m, cfg = doc["metrics"], doc.get("config", {})
    model = cfg.get("model", {}).get("name", "?")
    env = doc.get("env", {})
    d, eps = m["delta"], m["epsilon"]
    lines = [f"# Speed at a loss budget: {model}", "",
             f"Model `{model}` ({m['num_layers']} layers); Spec-Bench prompts: {m['prompts']['calibration']} "
             f"calibration, {m['prompts']['test']} test ({m['prompts']['timed']} timed), {m['max_new_tokens']} new "
             f"tokens each. Budget δ = {d:g}, confidence 1 − ε = {1 - eps:g}. Run time {m['seconds'] / 60:.1f} min on "
             f"{machine(env)}; created {doc.get('created', '?')}.", "",
             f"Loss, everywhere below: {m.get('loss', 'the mean per-prompt share of tokens differing from the full stack')}.",
             "", f"Splits: {m['prompts'].get('fit', 0)} calibration prompts fit the fitted policies (their Learn-then-Test "
             f"uses the other {m['prompts'].get('calibration_for_fitted', m['prompts']['calibration'])}); timed prompts "
             f"cover {len(m['prompts'].get('timed_categories', []))} of the test split's "
             f"{len(m['prompts'].get('test_categories', []))} categories (a seeded stratified sample).", "",
             "Certified points: Learn-then-Test on the *real decoder's* loss, each point under each K/V policy "
             f"({', '.join(m.get('kv_policies', []))}) in a fixed order, conservative first. Replayed points: exits "
             "replayed from one teacher-forced pass under dense's trajectory (exact up to each sequence's first exit), "
             "speed from the cost model with unit costs measured in the same job — the cheap screen over the whole "
             "curve, never the guarantee. Measured points: real runs beside dense, step by step in turn, on the timed "
             "test prompts.", "",
             "![frontier](frontier.png)", "",
             f"## At the budget δ = {d:g}{' (the paper’s 1 %)' if d == 0.01 else ''}: Spec-Bench, certified on real "
             "decoding", "",
             "The guarantee: with probability ≥ 1 − ε over the calibration prompts, each certified point's expected "
             "real-decoding loss on prompts like them is ≤ δ (this model, batch 1, greedy, this length).", ""]
    lines += certified_table(m)
    lines += ["", "### Refutation: every point whose speed could reach 1×", "",
              "A fast point's real loss is bounded below from its prompts' first exits, where replay is exact (a wrong "
              f"first exit costs at least 1/{m['max_new_tokens'] - 1} of that prompt's tokens); the bounds hold jointly.", ""]
    lines += refutation_table(m)
    for dd, cal in m.get("screen_at", {}).items():
        lines += ["", f"### Replay screen at a {100 * float(dd):g} % budget (teacher-forced, no guarantee on real decoding)", ""]
        lines += screen_table(m, cal)
    if m.get("left_out"):
        lines += [""] + [f"Left out: {k}: {v}" for k, v in m["left_out"].items()]
    ob = min(m["oracle"], key=lambda o: abs(o["budget"] - d))
    lines += ["", f"A teacher-forced, cost-free reference (the oracle at a {ob['budget']:g} pooled-token budget: "
              f"earliest agreeing layer, no predictor, draft or verification cost): {ob['modelled_speedup']:.3f}× "
              f"modelled, {ob['avg_layers']:.1f} layers per token. Not a bound any real exit rule must stay under.", ""]
    lines += [closest_to_oracle(m, d, ob), ""]
    for tname, task in m.get("tasks", {}).items():
        lines += [f"### {tname}", ""]
        dn = task["dense"]["test"]
        if task.get("rolling"):
            lines.append(f"Dense bits/byte {dn['bits_per_byte']:.3f} (test split, {dn['n']} documents).")
        else:
            lines.append(f"Dense {100 * dn['accuracy']:.1f} % (test split, {dn['n']} items); chance "
                         f"{100 * (task.get('chance') or 0):.1f} %; " + ("testable." if task.get("testable") else
                                                                      f"not testable: {task.get('why_not_testable')}."))
            lines.append(f"Source: {task.get('source', 'shipped')}; {task.get('output_type', 'loglikelihood')}; settings as "
                         f"the task ran them: {json.dumps(task.get('settings', {}), default=str)[:900]}.")
            for name, cal in (task.get("calibration") or {}).items():
                head = f"- real decoding, δ = {m['delta']:g}, {m['policies'][name]['label']}: "
                if cal.get("on") != "real decoding":
                    continue
                lines.append(head + (str(cal.get("why_none")) if cal.get("chosen") is None else
                                     f"{m['policies'][name]['knob']} = {cal['value']:g} ({cal['kv_policy']}) certified, "
                                     f"held-out flips {cal['test_loss']:.4f} [{cal['test_interval'][0]:.4f}, "
                                     f"{cal['test_interval'][1]:.4f}] over {cal['test_units']} items"))
            for dd, cals in (task.get("calibration_at") or {}).items():
                for name, cal in cals.items():
                    head = f"- replay screen, δ = {float(dd):g}, {m['policies'][name]['label']}: "
                    if cal.get("chosen") is None:
                        lines.append(head + str(cal.get("why_none")))
                    else:
                        lines.append(head + f"{m['policies'][name]['knob']} = {cal['value']:g} on replayed items, calibration flips "
                                     f"{cal['calibration_loss']:.4f} (bound {cal['calibration_bound']:.4f}), held-out "
                                     f"{cal['test_loss']:.4f} [{cal['test_interval'][0]:.4f}, {cal['test_interval'][1]:.4f}], held-out ≤ δ: "
                                     f"{'yes' if cal['held_out_within_budget'] else 'no'}, "
                                     f"modelled speedup {cal['modelled_speedup']:.3f}")
        lines += ["", "| policy | point | layers | Δ (test) [95 %] |", "|---|---|---|---|"]
        unit = "bits/byte" if task.get("rolling") else "points"
        for name, pts in task["points"].items():
            for p in pts:
                t = p["test"]
                lines.append(f"| {m['policies'][name]['label']} | {m['policies'][name]['knob']} = {p['value']:g} | "
                             f"{t['avg_layers']:.1f} | {t['delta']:+.3f} [{t['delta_ci'][0]:+.3f}, {t['delta_ci'][1]:+.3f}] {unit} |")
        lines.append("")
    lines += ["## Every operating point (test prompts)", "",
              "| policy | point | layers | tokens differing | sequences identical | modelled speedup [band] |",
              "|---|---|---|---|---|---|"]
    for name, rows in m["curves"].items():
        for r in rows:
            t = r["test"]
            lines.append(f"| {m['policies'][name]['label']} | {r['knob']} = {r['value']:g} | {t['avg_layers']:.2f} | "
                         f"{100 * t['token_disagreement']:.2f} % | {100 * t['sequence_identity']:.1f} % | "
                         f"{t['modelled_speedup']:.3f} [{t['modelled_band'][0]:.3f}, {t['modelled_band'][1]:.3f}] |")
    lines += ["", "## Oracle", "", "| token budget | layers | tokens differing | modelled speedup |", "|---|---|---|---|"]
    for o in m["oracle"]:
        lines.append(f"| {o['budget']:g} | {o['avg_layers']:.2f} | {100 * o['token_disagreement']:.2f} % | {o['modelled_speedup']:.3f} |")
    lines += ["", "## Measured runs and replay against reality", "",
              "| policy | point | measured speedup [95 %] | layers real / replay | tokens differing real (own context) / replay | sequences identical real / replay |",
              "|---|---|---|---|---|---|"]
    for name, pts in m["measured"].items():
        agree = {(p["value"], p.get("kv_policy")): p for p in m["replay_vs_real"].get(name, {}).get("points", [])}
        for p in pts:
            a = agree.get((p["value"], p.get("kv_policy")))
            rl = f"{p['avg_layers']:.2f} / {a['replay_avg_layers']:.2f}" if a else f"{p['avg_layers']:.2f} / –"
            rd = (f"{100 * p['own_context_disagreement']:.2f} % / {100 * a['replay_disagreement']:.2f} %" if a
                  else f"{100 * p['own_context_disagreement']:.2f} % / –")
            rs = (f"{100 * p['sequence_identity']:.1f} % / {100 * a['replay_sequence_identity']:.1f} %" if a
                  else f"{100 * p['sequence_identity']:.1f} % / –")
            lines.append(f"| {name} | {p['value']:g} ({p.get('kv_policy', '–')}) | {p['speedup']:.3f} [{p['speedup_ci'][0]:.3f}, {p['speedup_ci'][1]:.3f}] | "
                         f"{rl} | {rd} | {rs} |")
    for name, p in m["lossless_peers"].items():
        lines.append(f"| {name} (lossless) | – | {p['speedup']:.3f} [{p['speedup_ci'][0]:.3f}, {p['speedup_ci'][1]:.3f}] | "
                     f"– | {100 * p['own_context_disagreement']:.2f} % | {100 * p['sequence_identity']:.1f} % |")
    gaps = [(n, a["max_layer_gap"], a["max_disagreement_gap"]) for n, a in m["replay_vs_real"].items() if a["points"]]
    if gaps:
        lines += ["", "Replay against real runs, largest gaps per policy: " + "; ".join(
            f"{n}: {lg:.2f} layers, {100 * dg:.2f} points of tokens differing" for n, lg, dg in gaps) + "."]
    near = agreement_near_budget(m)
    if near:
        lines += ["", f"Where a budget is spent (the {near['points']} measured points replaying at most "
                      f"{100 * near['budget']:g} % of tokens differing): replay is within {near['layers']:.2f} layers per "
                      f"token and {100 * near['disagreement']:.2f} points of tokens differing of the real runs, and the "
                      f"modelled speedup within {100 * near['speed']:.1f} % of the measured one."]
    lines += ["", "## Verdicts", "",
              "Confirmed: a point certified on real decoding whose measured speedup interval lies above 1. Refuted: every "
              "point whose speed could reach 1× has a real-loss lower bound above δ (jointly). Otherwise inconclusive, "
              "saying which side is short. Each row is its own claim; no statement here is made about a family of rows.", ""]
    scopes = {v.get("scope") for v in m["verdicts"] if v.get("scope")}
    if scopes:
        lines += [f"Scope: {s}." for s in sorted(scopes)] + [""]
    lines += ["| model | task | policy | claim | verdict | figure | oracle |", "|---|---|---|---|---|---|---|"]
    for v in m["verdicts"]:
        lines.append(f"| {v['model']} | {v['task']} | {v['policy']} | {v['claim']} (δ = {v['delta']:g}) | "
                     f"{v['verdict']} | {v['figure']} | {v['oracle']} |")
    return "\n".join(lines) + "\n"


def write_report(doc: dict, out_dir: Path) -> Path:
    """summary.md, frontier.png/.pdf and frontier.json (a copy of the job's results.json) under ``out_dir``."""
    m = doc.get("metrics", {})
    if not isinstance(m, dict) or "curves" not in m:
        raise SpeceeError(f"not a frontier result (no curves): rerun experiment=frontier into {out_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    model = doc.get("config", {}).get("model", {}).get("name", "?")
    figure(m, out_dir / "frontier", f"{model}: speed against tokens differing from the full stack")
    (out_dir / "summary.md").write_text(summary_md(doc), encoding="utf-8")
    (out_dir / "frontier.json").write_text(json.dumps(doc, indent=1, default=str), encoding="utf-8")
    print(f"wrote {out_dir / 'summary.md'}")
    return out_dir


def verdict_table_rows(docs) -> list[dict]:
    """The frontier's joint verdicts as rows of the report's verdict table (specee/verdicts.py)."""
    rows = []
    for d in docs:
        if d.get("config", {}).get("experiment", {}).get("_target_") != "experiments.frontier.run":
            continue
        for v in d["metrics"].get("verdicts", []):
            rows.append({"claim": v["claim"].replace("<= delta", f"≤ {100 * v['delta']:g} %"), "model": v["model"],
                         "task": v["task"], "protocol": f"frontier (LTT, 1 − ε = {1 - v['epsilon']:g})",
                         "mode": v["policy"], "bank": "trained", "bank_source": None, "figure": v["figure"] or "–",
                         "verdict": v["verdict"], "why": f"oracle: {v['oracle']}" if v.get("oracle") else None,
                         "scope": v.get("scope"),
                         "rule": "confirmed: a point certified <= δ on real decoding (Learn-then-Test) measured faster "
                                 "(95 % CI above 1); refuted: every point whose speed could reach 1x has a real-loss "
                                 "lower bound above δ (Bonferroni over those points); else inconclusive"})
    return rows
