"""A verdict per claim of the SpecEE paper, per protocol and predictor bank, from stored results.

Each row: the claim, the protocol it was measured under, the bank (which predictors), the figure
with its interval, and one word:

* ``confirmed`` / ``refuted``: the interval lies on one side of the claim's bound;
* ``inconclusive``: the interval straddles it (more items would decide);
* ``not testable here``: the dense model is at chance on the task (its 95 % interval reaches
  chance), so a loss or its absence says nothing about early exiting.

The rules (stated in each row's ``rule``):

* accuracy loss < 1 % (Table 4): the paired 95 % interval of the per-item difference against dense,
  in percentage points: confirmed when its lower end is above -1, refuted when its upper end is
  below -1. "1 %" is read as one point of accuracy, as the paper's table shows it.
* skewed exits (Fig. 10): the share of exits in the half of the layers with the lowest exit
  probability; the paper reports at most 0.20 — confirmed at <= 0.20, refuted above.
* context similarity (Fig. 11): the hit rate for N = 5 previous tokens against the shuffled-order
  chance; confirmed when it beats chance by at least 0.05, refuted otherwise.
* the speed staircase: T1+T2 decodes faster than dense — the 95 % interval of its speedup above 1
  (confirmed) or below 1 (refuted).
* predictor count: the online schedule (T2) needs fewer predictor calls per token than all layers
  (T1) — confirmed when fewer, refuted otherwise.
"""
from __future__ import annotations

from pathlib import Path

BANKS = {"_paper": "paper-recipe bank", "_tuned": "tuned bank", "_authors": "the authors' released bank"}
LOSS_BOUND = -1.0  # points of accuracy


def kind(doc) -> str:
    """Which experiment wrote a result (its recipe module's name): speed, accuracy, stats, ..."""
    return doc["config"]["experiment"]["_target_"].split(".")[1]


def bank(doc) -> str:
    """Which predictors a result used, by the folder it read them from."""
    from specee.decoding import modes
    label = modes.bank_label(doc["config"]["ablation"])
    if label is not None:
        return label
    folder = Path(str(doc["config"].get("early_exit", {}).get("predictors_path", ""))).name
    return next((label for suffix, label in BANKS.items() if folder.endswith(suffix)), "harness-default bank")


def protocol(m: dict) -> str:
    if m.get("protocol"):
        return {"specee_paper": "the paper's (generative, 5-shot, 3 tokens)"}.get(m["protocol"], m["protocol"])
    if str(m.get("primary_metric", "")).startswith("acc"):
        return "harness log-likelihood"
    return "harness generative"


def _word_for_interval(lo: float, hi: float, bound: float, above_is_good: bool = True) -> str:
    if (lo > bound) if above_is_good else (hi < bound):
        return "confirmed"
    if (hi < bound) if above_is_good else (lo > bound):
        return "refuted"
    return "inconclusive"


def accuracy_rows(docs, paired_change) -> list[dict]:
    """One row per (task, mode) of the accuracy results against dense in the same sweep."""
    cells, items = {}, {}
    for d in docs:
        if kind(d) != "accuracy":
            continue
        name = d["config"]["ablation"]["name"]
        for task, m in d["metrics"]["accuracy"].items():
            if m.get("lower_is_better"):
                continue  # perplexity: no accuracy claim
            cells.setdefault(task, {})[name] = (m, d)
            items.setdefault(task, {})[name] = d.get("items", {}).get(task)
    rows = []
    for task in sorted(cells):
        dense = cells[task].get("dense")
        for name, (m, d) in sorted(cells[task].items()):
            if name == "dense" or dense is None:
                continue
            dm = dense[0]
            row = {"claim": "accuracy loss < 1 % (Table 4)", "task": task, "protocol": protocol(m),
                   "mode": name, "bank": bank(d), "n": m.get("n"),
                   "rule": "paired 95 % CI of the per-item difference vs dense, in points, against -1"}
            pc = paired_change(items[task].get("dense"), items[task].get(name))
            chance = m.get("chance")
            se = dm.get("accuracy_stderr") or 0.0
            dense_ci = (100 * (dm["accuracy"] - 1.96 * se), 100 * (dm["accuracy"] + 1.96 * se))
            row["dense"] = f"{100 * dm['accuracy']:.1f} [{dense_ci[0]:.1f}, {dense_ci[1]:.1f}]"
            row["chance"] = None if chance is None else 100 * chance
            if m.get("accuracy_paper_denominator") is not None:  # None: no item parsed
                row["paper_figure"] = (f"{100 * m['accuracy_paper_denominator']:.1f} "
                                       f"(÷ {m['paper_denominator']} items; unparsed {100 * m['unparsed_share']:.1f} %)")
            if pc is None:
                row.update(figure="–", verdict="not testable here", why="no per-item records to pair")
            else:
                row["figure"] = (f"{pc['delta']:+.1f} pt [{pc['lo']:+.1f}, {pc['hi']:+.1f}]; {pc['changed']} of "
                                 f"{pc['n']} answers changed ({pc['worse']} to wrong, {pc['better']} to right)")
                if chance is not None and dense_ci[0] <= 100 * chance:
                    row.update(verdict="not testable here",
                               why=f"dense {row['dense']} reaches chance {100 * chance:.0f}")
                else:
                    row["verdict"] = _word_for_interval(pc["lo"], pc["hi"], LOSS_BOUND)
            rows.append(row)
    return rows


def stats_rows(docs) -> list[dict]:
    rows = []
    for d in docs:
        if kind(d) != "stats":
            continue
        model = d["config"]["model"]["name"]
        dist = d["metrics"].get("exit_distribution", {}).get("all", {})
        skew = dist.get("skew_bottom_half_by_probability")
        if skew is not None:
            rows.append({"claim": "skewed exits (Fig. 10)", "task": model, "protocol": "harness stats",
                         "mode": "predictors at all layers", "bank": bank(d), "figure": f"{skew:.3f}",
                         "verdict": "confirmed" if skew <= 0.20 else "refuted",
                         "rule": "share of exits in the lower-probability half of the layers <= 0.20"})
        sim = d["metrics"].get("context_similarity", {}).get("per_category", {}).get("all", [])
        five = next((r for r in sim if r["n"] == 5), None)
        if five:
            margin = five["hit_rate"] - five["shuffled_chance"]
            rows.append({"claim": "context similarity (Fig. 11)", "task": model, "protocol": "harness stats",
                         "mode": "N = 5", "bank": bank(d),
                         "figure": f"hit {five['hit_rate']:.3f} vs shuffled {five['shuffled_chance']:.3f}",
                         "verdict": "confirmed" if margin >= 0.05 else "refuted",
                         "rule": "hit rate beats the shuffled-order chance by >= 0.05"})
    return rows


def speed_rows(docs) -> list[dict]:
    speed = [d for d in docs if kind(d) == "speed" and d["config"].get("runtime", {}).get("kind", "eager") == "eager"]
    by = {}
    for d in speed:
        by.setdefault(d["config"]["ablation"]["name"], []).append(d)
    rows = []
    for name in ("specee_t1_t2", "specee_t1_t2_tuned", "specee_t1_t2_paper", "specee_t1_t2_authors"):
        for d in by.get(name, []):
            m = d["metrics"]
            ci = m.get("speedup_vs_dense_ci")
            if not ci:
                continue
            rows.append({"claim": "speed staircase: T1+T2 faster than dense", "task": d["config"]["model"]["name"],
                         "protocol": f"harness speed ({d['config'].get('dataset', {}).get('name', '?')})",
                         "mode": name, "bank": bank(d),
                         "figure": f"{m['speedup_vs_dense']:.3f}× [{ci[0]:.3f}, {ci[1]:.3f}]",
                         "verdict": _word_for_interval(ci[0], ci[1], 1.0),
                         "rule": "95 % CI of the decode speedup vs dense, against 1"})
    t1, t2 = by.get("specee_t1"), by.get("specee_t1_t2")
    if t1 and t2:
        c1 = sum(d["metrics"]["predictor_calls_per_token"] for d in t1) / len(t1)
        c2 = sum(d["metrics"]["predictor_calls_per_token"] for d in t2) / len(t2)
        rows.append({"claim": "predictor count: T2 schedules fewer predictors", "task": t2[0]["config"]["model"]["name"],
                     "protocol": "harness speed", "mode": "specee_t1_t2 vs specee_t1", "bank": bank(t2[0]),
                     "figure": f"{c2:.2f} vs {c1:.2f} calls/token",
                     "verdict": "confirmed" if c2 < c1 else "refuted",
                     "rule": "predictor calls per token, online ∪ offline against all layers"})
    return rows


def verdict_rows(docs, paired_change) -> list[dict]:
    return accuracy_rows(docs, paired_change) + stats_rows(docs) + speed_rows(docs)


def markdown(rows: list[dict]) -> str:
    md = ("| claim | task / model | protocol | mode | bank | figure [95 % CI] | the paper's own figure | "
          "dense [95 % CI] (chance) | verdict |\n|---|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        chance = f" ({r['chance']:.0f})" if r.get("chance") is not None else ""
        verdict = r["verdict"] + (f" — {r['why']}" if r.get("why") else "")
        md += (f"| {r['claim']} | {r['task']} | {r['protocol']} | {r['mode']} | {r['bank']} | {r['figure']} | "
               f"{r.get('paper_figure', '–')} | {r.get('dense', '–')}{chance} | {verdict} |\n")
    rules = sorted({(r["claim"], r["rule"]) for r in rows})
    return md + "\n" + "".join(f"- {c}: {rule}\n" for c, rule in rules)


def counts(rows: list[dict]) -> dict:
    out = {}
    for r in rows:
        out[r["verdict"]] = out.get(r["verdict"], 0) + 1
    return out

