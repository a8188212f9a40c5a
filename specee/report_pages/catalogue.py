"""What the report's pages call a result, and where it sorts: its printed name (the ablation and
the settings that make it a variant), its hardware stamp, its experiment kind, and its ablation's
identity (specee/ablations.py: order, label, role), read from the config the result stored."""
from __future__ import annotations

from specee import ablations
from specee.decoding import modes
from specee.verdicts import kind as experiment_kind


class Skip(Exception):
    """A figure whose inputs are not in the results."""


def hardware(doc) -> str:
    """The hardware the run used: its device (a CPU run on a machine with a GPU is a CPU run)."""
    gpus = doc["env"].get("gpus") or []
    device = str(doc.get("device") or (doc["config"].get("model") or {}).get("device") or "")
    if gpus and device.startswith(("cuda", "auto")):
        index = int(device.split(":")[1]) if device.startswith("cuda:") else 0
        gpu = next((g for g in gpus if g.get("index") == index), gpus[0])
        return gpu["name"]
    return f"CPU ({doc['env'].get('cpu')}, {doc['env'].get('torch_threads')} threads)"


def stamp(docs) -> str:
    models = sorted({d["config"]["model"]["name"] for d in docs})
    hw = sorted({hardware(d) for d in docs})
    days = sorted({(d.get("created") or "")[:10] for d in docs})
    return f"model: {', '.join(models)} · {'; '.join(hw)} · {', '.join(days)}"


def by_kind(docs, kind):
    """Results of one experiment kind; a peer transformers could not run (``not_applicable``) has no
    figures to draw."""
    return [d for d in docs if experiment_kind(d) == kind and not d["metrics"].get("not_applicable")]


def display_name(doc) -> str:
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
    if runtime_kind(doc) != "eager":
        name += f" ({runtime_kind(doc)})"
    return name


def runtime_kind(doc) -> str:
    return (doc["config"].get("runtime") or {}).get("kind", "eager")


def identities(docs) -> dict:
    """Each result's name as the pages print it (:func:`display_name`) -> its ablation's identity."""
    return {display_name(d): ablations.of_doc(d) for d in docs}


def ordered(names, docs) -> list[str]:
    """``names`` (as :func:`display_name` prints them) in the order their ablations declare."""
    ids = identities(docs)
    last = ablations.LAST
    return sorted(names, key=lambda n: (ids[n].order if n in ids else last, n))


def reference_name(docs) -> str | None:
    """The name the reference ablation's results print under (its plain run, not a variant)."""
    refs = [(display_name(d), d["config"]["ablation"]["name"]) for d in docs if ablations.of_doc(d).reference]
    plain = [shown for shown, name in refs if shown == name]
    return (plain or [shown for shown, _ in refs] or [None])[0]


def set_label(doc) -> str:
    """A speed result's prompt set: the dataset, with its Spec-Bench category when one was chosen."""
    ds = doc["config"].get("dataset") or {}
    cats = ds.get("categories") or []
    return ds.get("name", "?") + (f":{','.join(cats)}" if cats else "")
