"""A verdict per claim of the SpecEE paper, per protocol and predictor bank, from stored results.

Each row: the claim, the protocol it was measured under, the bank (which predictors), the figure
with its interval, and one word:

* ``confirmed`` / ``refuted``: the interval lies on one side of the claim's bound;
* ``inconclusive``: the interval straddles it (more items would decide);
* ``not testable here``: the dense model is at chance on the task (its 95 % interval reaches
  chance), so a loss or its absence says nothing about early exiting; also where the two rows
  cannot be paired (no per-item records, or records taken under different settings).

Dense's interval is the exact binomial (Clopper-Pearson) 95 % interval of its right answers out of
n, and "reaches" is read at the precision the table prints (0.1 point): the normal approximation
put SmolLM2's SST-2 dense (465 of 872, 53.3 %) at [50.01, 56.6] — "above chance" by a hundredth
of a point that the printed [50.0, 56.6] does not show — while the exact interval starts at 49.95.
A reader checking the printed figures reaches the same word as the rule.

Each row names the model, the protocol and the bank (with the folder it was read from) it rests on.

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

import json
from pathlib import Path

from specee import ablations
from specee.intervals import exact_interval, paired_change, word_for_interval  # noqa: F401  (exact_interval: read here too)

LOSS_BOUND = -1.0  # points of accuracy


def kind(doc) -> str:
    """Which experiment wrote a result (its recipe module's name): speed, accuracy, stats, ..."""
    return doc["config"]["experiment"]["_target_"].split(".")[1]


def bank(doc) -> str:
    """Which predictors a result used: the bank variant its ablation declares."""
    from specee.decoding import modes
    label = modes.bank_label(doc["config"]["ablation"])
    if label is not None:
        return label
    return ablations.BANKS[ablations.of_doc(doc).bank]


def bank_source(doc) -> str | None:
    """The folder a mode's predictors were read from (None for a mode without a bank)."""
    from specee.decoding import modes
    if modes.bank_label(doc["config"]["ablation"]) is not None:
        return None
    folder = str(doc["config"].get("early_exit", {}).get("predictors_path", "") or "")
    return Path(folder).name or None


def model_name(doc) -> str:
    return str((doc["config"].get("model") or {}).get("name", "?"))


def protocol(m: dict) -> str:
    if m.get("protocol"):
        return {"specee_paper": "the paper's (generative, 5-shot, 3 tokens)"}.get(m["protocol"], m["protocol"])
    if str(m.get("primary_metric", "")).startswith("acc"):
        return "harness log-likelihood"
    return "harness generative"


def dense_interval(m: dict) -> tuple[float, float, str]:
    """Dense's 95 % interval in points and how it was computed: exact binomial where the metric is
    a share of n items (an accuracy), else the normal one from lm-eval's stderr."""
    acc, n = m["accuracy"], m.get("n")
    if isinstance(n, int) and n > 0 and 0.0 <= acc <= 1.0 and abs(acc * n - round(acc * n)) < 1e-6:
        lo, hi = exact_interval(round(acc * n), n)
        return 100 * lo, 100 * hi, "exact binomial"
    se = m.get("accuracy_stderr") or 0.0
    return 100 * (acc - 1.96 * se), 100 * (acc + 1.96 * se), "normal"


def reaches_chance(lo: float, chance: float | None) -> bool:
    """Dense's lower end at or below chance, both in points, at the precision the table prints."""
    return chance is not None and round(lo, 1) <= round(100 * chance, 1)


# Settings that change what an item's answer is: two rows are paired only when they agree on these.
PAIRED_SETTINGS = ("limit", "num_fewshot", "fewshot_pool", "chat_template", "task_source", "max_gen_tokens",
                   "max_length", "dtype", "seed")


def _setting_clash(a: dict | None, b: dict | None) -> list[str]:
    a, b = a or {}, b or {}
    return [k for k in PAIRED_SETTINGS if k in a and k in b and a[k] != b[k]]


def accuracy_rows(docs) -> list[dict]:
    """One row per (model, task, mode) of the accuracy results against dense of the same model —
    from the same sweep or from an earlier report's per-item records (:func:`read_item_records`)."""
    cells, items, reference = {}, {}, {}
    for d in docs:
        if kind(d) != "accuracy":
            continue
        name = d["config"]["ablation"]["name"]
        if ablations.of_doc(d).reference:
            reference[model_name(d)] = name
        for task, m in d["metrics"]["accuracy"].items():
            if m.get("lower_is_better"):
                continue  # perplexity: no accuracy claim
            key = (model_name(d), task)
            cells.setdefault(key, {})[name] = (m, d)
            items.setdefault(key, {})[name] = d.get("items", {}).get(task)
    rows = []
    for key in sorted(cells):
        model, task = key
        ref = reference.get(model)
        dense = cells[key].get(ref)
        for name, (m, d) in sorted(cells[key].items()):
            if name == ref or dense is None:
                continue
            dm, dd = dense
            row = {"claim": "accuracy loss < 1 % (Table 4)", "model": model, "task": task,
                   "protocol": protocol(m), "mode": name, "bank": bank(d), "bank_source": bank_source(d),
                   "n": m.get("n"),
                   "rule": "paired 95 % CI of the per-item difference vs dense, in points, against -1; "
                           "not testable where dense's exact binomial 95 % interval reaches chance"}
            pc = paired_change(items[key].get(ref), items[key].get(name))
            chance = m.get("chance") if m.get("chance") is not None else dm.get("chance")
            lo, hi, how = dense_interval(dm)
            row["dense"] = f"{100 * dm['accuracy']:.1f} [{lo:.1f}, {hi:.1f}]"
            row["dense_interval"] = how
            row["chance"] = None if chance is None else 100 * chance
            if m.get("accuracy_paper_denominator") is not None:  # None: no item parsed
                row["paper_figure"] = (f"{100 * m['accuracy_paper_denominator']:.1f} "
                                       f"(÷ {m['paper_denominator']} items; unparsed {100 * m['unparsed_share']:.1f} %)")
            clash = _setting_clash(dd.get("settings"), d.get("settings"))
            if pc is None:
                row.update(figure="–", verdict="not testable here", why="no per-item records to pair")
                rows.append(row)
                continue
            row["figure"] = (f"{pc['delta']:+.1f} pt [{pc['lo']:+.1f}, {pc['hi']:+.1f}]; {pc['changed']} of "
                             f"{pc['n']} answers changed ({pc['worse']} to wrong, {pc['better']} to right)")
            if clash:
                row.update(verdict="not testable here",
                           why=f"dense and {name} ran under different {', '.join(clash)}")
            elif reaches_chance(lo, chance):
                row.update(verdict="not testable here",
                           why=f"dense {row['dense']} ({how} 95 % interval) reaches chance {100 * chance:.0f}")
            else:
                row["verdict"] = word_for_interval(pc["lo"], pc["hi"], LOSS_BOUND)
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
            rows.append({"claim": "skewed exits (Fig. 10)", "model": model, "task": "exit layers",
                         "protocol": "harness stats", "bank_source": bank_source(d),
                         "mode": "predictors at all layers", "bank": bank(d), "figure": f"{skew:.3f}",
                         "verdict": "confirmed" if skew <= 0.20 else "refuted",
                         "rule": "share of exits in the lower-probability half of the layers <= 0.20"})
        sim = d["metrics"].get("context_similarity", {}).get("per_category", {}).get("all", [])
        five = next((r for r in sim if r["n"] == 5), None)
        if five:
            margin = five["hit_rate"] - five["shuffled_chance"]
            rows.append({"claim": "context similarity (Fig. 11)", "model": model, "task": "exit layers",
                         "protocol": "harness stats", "bank_source": bank_source(d),
                         "mode": "N = 5", "bank": bank(d),
                         "figure": f"hit {five['hit_rate']:.3f} vs shuffled {five['shuffled_chance']:.3f}",
                         "verdict": "confirmed" if margin >= 0.05 else "refuted",
                         "rule": "hit rate beats the shuffled-order chance by >= 0.05"})
    return rows


def speed_rows(docs) -> list[dict]:
    """The speed claims, for every ablation that declares itself a step of the paper's staircase
    (its config's ``step``): T1+T2 faster than dense, and T2 scheduling fewer predictors than T1
    with the same bank."""
    speed = [d for d in docs if kind(d) == "speed" and d["config"].get("runtime", {}).get("kind", "eager") == "eager"]
    by, ident = {}, {}
    for d in speed:
        name = d["config"]["ablation"]["name"]
        by.setdefault(name, []).append(d)
        ident[name] = ablations.of_doc(d)
    steps = lambda step: sorted((n for n, i in ident.items() if i.step == step),  # noqa: E731
                                key=lambda n: (ident[n].order, n))
    rows = []
    for name in steps("T1+T2"):
        for d in by[name]:
            m = d["metrics"]
            ci = m.get("speedup_vs_dense_ci")
            if not ci:
                continue
            rows.append({"claim": "speed staircase: T1+T2 faster than dense", "model": model_name(d),
                         "task": str(d["config"].get("dataset", {}).get("name", "?")),
                         "protocol": "harness speed", "mode": name, "bank": bank(d), "bank_source": bank_source(d),
                         "figure": f"{m['speedup_vs_dense']:.3f}× [{ci[0]:.3f}, {ci[1]:.3f}]",
                         "verdict": word_for_interval(ci[0], ci[1], 1.0),
                         "rule": "95 % CI of the decode speedup vs dense, against 1"})
    for n2 in steps("T1+T2"):
        n1 = next((n for n in steps("T1") if ident[n].bank == ident[n2].bank), None)
        if n1 is None:
            continue
        t1, t2 = by[n1], by[n2]
        c1 = sum(d["metrics"]["predictor_calls_per_token"] for d in t1) / len(t1)
        c2 = sum(d["metrics"]["predictor_calls_per_token"] for d in t2) / len(t2)
        rows.append({"claim": "predictor count: T2 schedules fewer predictors", "model": model_name(t2[0]),
                     "task": str(t2[0]["config"].get("dataset", {}).get("name", "?")),
                     "protocol": "harness speed", "mode": f"{n2} vs {n1}", "bank": bank(t2[0]),
                     "bank_source": bank_source(t2[0]),
                     "figure": f"{c2:.2f} vs {c1:.2f} calls/token",
                     "verdict": "confirmed" if c2 < c1 else "refuted",
                     "rule": "predictor calls per token, online ∪ offline against all layers"})
    return rows


def verdict_rows(docs) -> list[dict]:
    from specee.frontier.pages import verdict_table_rows
    return accuracy_rows(docs) + stats_rows(docs) + speed_rows(docs) + verdict_table_rows(docs)


def bank_text(r: dict) -> str:
    return r["bank"] + (f" (`{r['bank_source']}`)" if r.get("bank_source") else "")


def markdown(rows: list[dict]) -> str:
    md = ("| claim | model | task | protocol | mode | bank (folder) | figure [95 % CI] | the paper's own figure | "
          "dense [exact 95 % CI] (chance) | verdict |\n|---|---|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        chance = f" ({r['chance']:.0f})" if r.get("chance") is not None else ""
        verdict = r["verdict"] + (f" — {r['why']}" if r.get("why") else "")
        md += (f"| {r['claim']} | {r.get('model', '?')} | {r['task']} | {r['protocol']} | {r['mode']} | "
               f"{bank_text(r)} | {r['figure']} | {r.get('paper_figure', '–')} | {r.get('dense', '–')}{chance} | "
               f"{verdict} |\n")
    rules = sorted({(r["claim"], r["rule"]) for r in rows})
    return md + "\n" + "".join(f"- {c}: {rule}\n" for c, rule in rules)


def counts(rows: list[dict]) -> dict:
    out = {}
    for r in rows:
        out[r["verdict"]] = out.get(r["verdict"], 0) + 1
    return out



# -- per-item records kept beside a committed report -------------------------------------------------
# A report's accuracy rows rest on per-item answers that live in the run folders, which are not
# committed; without them a later run of one mode cannot be paired with the dense run of an earlier
# report, and dense must be rerun (about 50 minutes per task for SmolLM2 on a CPU under the paper's
# protocol). So a report keeps one small JSONL per (model, task, mode): a header line with what the
# row rests on (settings, metrics, bank folder), then one line per item.
# They are regenerated by every report and ignored by git (.gitignore: reports/*/items/), so the
# main job leaves only its committed pages changed; a report whose records must travel adds them
# with `git add -f`.
ITEMS = "items"
RECORDS_MARK = "specee_item_records"


def _header(doc: dict, task: str) -> dict:
    c = doc["config"]
    return {RECORDS_MARK: 1, "created": doc.get("created"), "device": doc.get("device"),
            "config": {"experiment": {"_target_": c["experiment"]["_target_"]},
                       "model": {k: (c.get("model") or {}).get(k) for k in ("name", "dtype", "path")},
                       "ablation": c["ablation"],
                       "early_exit": {k: v for k, v in (c.get("early_exit") or {}).items()
                                      if k in ("predictors_path", "kv_policy", "delta_from", "threshold")},
                       "runtime": {"kind": (c.get("runtime") or {}).get("kind", "eager")},
                       "draft": {"vocab_size": (c.get("draft") or {}).get("vocab_size")}},
            "env": {k: (doc.get("env") or {}).get(k) for k in ("cpu", "torch_threads", "gpus", "packages")},
            "settings": doc.get("settings"), "task": task,
            "metrics": {"accuracy": {task: doc["metrics"]["accuracy"][task]},
                        **{k: doc["metrics"][k] for k in ("num_layers", "mode") if k in doc["metrics"]}}}


def item_records(docs) -> dict[str, list[dict]]:
    """Relative path (items/<model>/<task>/<mode>.jsonl) -> its lines, for every accuracy result
    that carries per-item values."""
    out = {}
    for d in docs:
        if kind(d) != "accuracy":
            continue
        for task, items in sorted((d.get("items") or {}).items()):
            if task not in d["metrics"]["accuracy"] or not items:
                continue
            base = f"{ITEMS}/{model_name(d)}/{task}/{d['config']['ablation']['name']}"
            rel, i = f"{base}.jsonl", 1
            while rel in out:  # the same mode twice (a variant): both kept
                i += 1
                rel = f"{base}.{i}.jsonl"
            out[rel] = [_header(d, task)] + [{"doc_id": k, **v} for k, v in
                                              sorted(items.items(), key=lambda kv: (len(kv[0]), kv[0]))]
    return out


def write_item_records(docs, out_dir: Path) -> list[Path]:
    written = []
    for rel, lines in item_records(docs).items():
        path = Path(out_dir) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(line, ensure_ascii=False, default=str) + "\n" for line in lines))
        written.append(path)
    return written


def read_item_records(root: Path) -> list[dict]:
    """Result-like documents from the per-item records under ``root`` (any ``items/`` folder, e.g.
    one copied from a committed report into a sweep folder): each pairs with new rows of the same
    model and task as if its run were in the sweep."""
    docs = []
    for path in sorted(Path(root).rglob("*.jsonl")):
        if ITEMS not in path.relative_to(root).parts[:-1]:
            continue
        with open(path, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.strip()]
        if not lines or not isinstance(lines[0], dict) or lines[0].get(RECORDS_MARK) != 1:
            continue
        head, rows = lines[0], lines[1:]
        doc = {k: v for k, v in head.items() if k not in (RECORDS_MARK, "task")}
        doc["items"] = {head["task"]: {str(r["doc_id"]): {k: v for k, v in r.items() if k != "doc_id"}
                                       for r in rows}}
        doc["item_records"] = str(path)
        docs.append(doc)
    return docs


def with_item_records(docs: list[dict], root: Path) -> list[dict]:
    """``docs`` plus the records under ``root`` for (model, task, mode) cells no result covers."""
    have = {(model_name(d), t, d["config"]["ablation"]["name"]) for d in docs if kind(d) == "accuracy"
            for t in d["metrics"]["accuracy"]}
    extra = [r for r in read_item_records(root)
             if (model_name(r), next(iter(r["items"])), r["config"]["ablation"]["name"]) not in have]
    return docs + extra
