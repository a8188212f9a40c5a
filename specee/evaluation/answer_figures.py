"""Accuracy of a generative answer task under each denominator, and the share never parsed.

A generative multiple-choice task (the model writes its answer, a filter reads a label out of it)
has two honest accuracies: over all items (an unreadable answer is wrong) and over the items whose
answer parsed to a valid label. The SpecEE authors' CommonsenseQA script reports the second for
SpecEE and the first for its baseline, so unreadable answers silently leave SpecEE's denominator;
here both are reported, with the unparsed share, and ``accuracy_paper_denominator`` is the figure
their script would print for this mode (``metadata.paper_denominator``: ``dense`` / ``speculative``
-> ``all`` | ``parsed``).

The valid labels are the task's ``metadata.answer_labels``; a task without them (a user's own)
takes them from the task itself (:func:`task_labels`): its ``doc_to_choice`` over all its items, else
the distinct gold answers of all its items — never only of the items ``experiment.limit`` kept, which
would make a four-option task's "D" unparsed when the first 60 golds hold only A-C — when there are
at most ``MAX_LABELS`` (a label set); otherwise an answer counts as parsed when it is not empty and
not the parser's ``N/A``. Chance follows from the label set where the task declares none.
"""
from __future__ import annotations

from specee.errors import SpeceeError

MAX_LABELS = 26
_NOT_PARSED = ("", "N/A", "[invalid]")  # the authors' parser, lm-eval's regex filter fallback


def _answer(sample) -> str:
    fr = sample.get("filtered_resps")
    while isinstance(fr, (list, tuple)) and fr:
        fr = fr[0]
    return "" if fr is None or isinstance(fr, (list, tuple)) else str(fr).strip()


def _gold(sample) -> str:
    t = sample.get("target")
    return str(t[0] if isinstance(t, (list, tuple)) and t else t).strip()


def _unique(values) -> list[str]:
    return list(dict.fromkeys(str(v).strip() for v in values))


def task_labels(task) -> dict:
    """What a loaded lm-eval task declares about its answers, read over *all* its evaluation items:
    ``labels`` (``metadata.answer_labels``; else the union of ``doc_to_choice``; else the distinct
    gold answers; None beyond ``MAX_LABELS``), where they came from, and ``chance`` (the declared
    ``metadata.chance``; else the mean of 1 / choices per item; else 1 / labels)."""
    cfg = task.config
    meta = cfg.metadata or {}
    out = {"labels": None, "labels_from": None, "chance": meta.get("chance")}
    if meta.get("answer_labels"):
        out.update(labels=_unique(meta["answer_labels"]), labels_from="metadata.answer_labels")
    else:
        docs = list(task.eval_docs)
        if cfg.doc_to_choice is not None:
            per = [_unique(task.doc_to_choice(d)) for d in docs]
            union = _unique(c for cs in per for c in cs)
            out.update(labels=union if len(union) <= MAX_LABELS else None, labels_from="doc_to_choice")
            if out["chance"] is None and per:
                out["chance"] = sum(1 / max(len(cs), 1) for cs in per) / len(per)
        else:
            golds = []
            for d in docs:
                t = task.doc_to_target(d)
                golds += list(t) if isinstance(t, (list, tuple)) else [t]
            union = sorted(_unique(golds))
            out.update(labels=union if len(union) <= MAX_LABELS else None,
                       labels_from=f"the gold answers of all {len(docs)} items")
    if out["chance"] is None and out["labels"]:
        out["chance"] = 1 / len(out["labels"])
    out["chance"] = None if out["chance"] is None else float(out["chance"])
    return out


def figures(samples: list[dict], metric: str, metadata: dict, mode: str, labels: list | None = None) -> dict:
    """The three figures (and their parts) for one task's per-sample log. ``metric`` is the
    per-sample correctness key (lm-eval's ``exact_match``); ``mode`` the decoding mode; ``labels``
    the task's own label set (:func:`task_labels`) where its metadata declares none. Without either,
    the distinct gold answers of the samples stand in (only the items evaluated)."""
    if not samples:
        raise SpeceeError("a generative task produced no samples; nothing to score")
    labels = metadata.get("answer_labels") or labels
    if labels is None:
        golds = {_gold(s) for s in samples}
        labels = sorted(golds) if len(golds) <= MAX_LABELS else None
    labels = None if labels is None else {str(x).strip() for x in labels}
    n = len(samples)
    correct = [float(s.get(metric, 0.0)) >= 1.0 for s in samples]
    parsed = [(_answer(s) in labels) if labels is not None else (_answer(s) not in _NOT_PARSED)
              for s in samples]
    n_parsed, n_correct = sum(parsed), sum(correct)
    kinds = metadata.get("paper_denominator") or {}
    from specee.decoding import modes
    which = kinds.get("dense" if modes.spec(mode).reference else "speculative", "all")
    if which not in ("all", "parsed"):
        raise SpeceeError(f"metadata.paper_denominator={kinds} must map dense/speculative to all or parsed")
    acc_parsed = n_correct / n_parsed if n_parsed else None
    return {"accuracy_all_items": n_correct / n,
            "accuracy_parsed_items": acc_parsed,
            "accuracy_paper_denominator": acc_parsed if which == "parsed" else n_correct / n,
            "paper_denominator": which,
            "parsed_items": n_parsed, "unparsed_share": 1 - n_parsed / n,
            "answer_labels": sorted(labels) if labels is not None else None,
            "chance": metadata.get("chance") if metadata.get("chance") is not None
            else (1 / len(labels) if labels else None)}
