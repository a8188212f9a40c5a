"""An ablation's identity has one home (its conf/ablation YAML), and the code has no import circles.

The report, the verdicts, the paper-figure page, the main job's presets, the folder checks and the
metric catalogue read an ablation's label, step, role, bank and order from the config a result
stored (specee/ablations.py); no module outside conf/ and the decoder registry lists ablations.
"""
import ast
import json
import re
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from conftest import ROOT  # noqa: E402
from specee import ablations  # noqa: E402
from specee.errors import SpeceeError  # noqa: E402

ABLATIONS = sorted(p.stem for p in (ROOT / "conf" / "ablation").glob("*.yaml"))
# Where ablations may be named: their own files (conf/), the decoder registry and its decoders
# (specee/decoding/, where a mode and its ablation share a name) and the tests.
SCANNED = ("specee", "experiments", "scripts")
MAX_LITERALS = 5  # results-format keys named after the reference's side ("dense") and a config default


def _literals(source: str, names) -> list[tuple[int, str]]:
    """String constants equal to an ablation's name, except as a subscript, a dict key, the key
    argument of get/setdefault/pop or tested for membership in a mapping (a results document's own
    keys, e.g. ``metrics["dense"]``)."""
    tree = ast.parse(source)
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            keys.add(id(node.slice))
        elif isinstance(node, ast.Dict):
            keys |= {id(k) for k in node.keys if k is not None}
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "setdefault", "pop") and node.args):
            keys.add(id(node.args[0]))
        elif (isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn))
              and not isinstance(node.comparators[0], (ast.Tuple, ast.List, ast.Set))):
            keys.add(id(node.left))  # `"dense" in doc`: a key of a mapping
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
            and id(node) not in keys]


def test_ablation_names_are_written_only_in_conf_and_the_registry():
    hits = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if (ROOT / "specee" / "decoding") in path.parents or (ROOT / "specee" / "exit_rules") in path.parents:
                continue  # the registries: a mode, or an exit rule, declares its own name
            hits += [f"{path.relative_to(ROOT)}:{line}: {name!r}"
                     for line, name in _literals(path.read_text(encoding="utf-8"), set(ABLATIONS))]
    assert len(hits) <= MAX_LITERALS, (
        f"{len(hits)} ablation names written outside conf/ and the registries (at most {MAX_LITERALS}); "
        "read the ablation's identity (specee/ablations.py) instead:\n" + "\n".join(hits))


def test_the_literal_scan_finds_what_it_is_meant_to():
    names = {"dense", "specee_t1_t2"}
    found = _literals('ORDER = ["dense", "specee_t1_t2"]\nif name == "specee_t1_t2":\n    pass\n', names)
    assert [n for _, n in found] == ["dense", "specee_t1_t2", "specee_t1_t2"]
    assert not _literals('x = m["dense"]["ms"]; y = {"dense": 1}; z = m.get("dense"); w = "dense" in m\n', names)
    assert _literals('w = name in ("dense", "x")\n', names) == [(1, "dense")]


# -- the identity, from a result's stored config or, for an older result, from its file -------------
def test_every_ablation_file_declares_a_known_role_bank_and_an_order():
    declared = ablations.declared()
    assert set(declared) == set(ABLATIONS)
    for name, fields in declared.items():
        assert fields.get("role", "early_exit") in ablations.ROLES, name
        assert fields.get("bank", "trained") in ablations.BANKS, name
        assert isinstance(fields.get("order"), int), f"{name}: no order"
    staircase = [n for n, f in declared.items() if f.get("staircase")]
    assert all(declared[n].get("label") and declared[n].get("step") for n in staircase)
    # the reference is declared once, and it is the registry's reference mode
    from specee.decoding import modes
    refs = [n for n, f in declared.items() if f.get("role") == "reference"]
    assert len(refs) == 1 and declared[refs[0]]["mode"] == modes.reference().name


def test_a_result_older_than_the_fields_takes_them_from_the_file_of_its_name():
    old = {"name": "specee_t1_t2_tuned", "mode": "specee"}  # a results.json written before the fields
    ident = ablations.of(old)
    assert (ident.label, ident.step, ident.staircase, ident.bank) == ("T1+T2 tuned", "T1+T2", True, "tuned")
    # a stored field wins over the file of the same name (the result says what it ran)
    stored = {**old, "label": "renamed", "step": "T1+T2", "staircase": False, "role": None, "bank": "tuned",
              "order": 7}
    assert (ablations.of(stored).label, ablations.of(stored).order, ablations.of(stored).staircase) == \
        ("renamed", 7, False)
    # an unknown name without fields: its mode says the role, it sorts last
    unknown = ablations.of({"name": "gone", "mode": "eagle"})
    assert (unknown.role, unknown.order, unknown.label, unknown.staircase) == ("lossless", ablations.LAST, "gone",
                                                                              False)


def test_the_authors_variant_of_a_step_is_found_from_the_files():
    assert ablations.variant("specee_t1_t2", "authors") == "specee_t1_t2_authors"
    assert ablations.variant("specee_full", "authors") == "specee_full_authors"
    assert ablations.variant("eagle", "authors") == "eagle"  # no such variant: itself
    assert ablations.variant("specee_t1_t2_tuned", "authors") == "specee_t1_t2_tuned"  # already another bank
    assert ablations.with_step("T1", "authors") == "specee_t1_authors"


def test_a_bad_role_or_bank_is_one_line_naming_the_choices():
    from specee.launch import compose_and_check
    with pytest.raises(SpeceeError, match=r"ablation\.role.*reference, peer, early_exit, lossless"):
        compose_and_check(["experiment=speed", "ablation=pld", "ablation.role=winner"])
    with pytest.raises(SpeceeError, match=r"ablation\.bank.*trained, paper, tuned, authors"):
        compose_and_check(["experiment=speed", "ablation=specee_t1_t2", "ablation.bank=mine"])


def test_the_folder_check_names_the_fill_command_of_the_declared_bank(tmp_path):
    from omegaconf import OmegaConf

    from specee.config import recipe
    from specee.decoding import modes
    from specee.models.folders import needed
    cfg = OmegaConf.create({"model": {"name": "m", "init": "pretrained", "path": None, "allow_hub": False},
                            "draft": {"name": "none", "path": None},
                            "placement": {"offline": False},
                            "early_exit": {"predictors_path": str(tmp_path / "any_folder_name")},
                            "ablation": {"name": "x", "mode": "specee", "bank": "authors"},
                            "experiment": {"_target_": "experiments.speed.run"}})
    fills = {what: fill for what, _, _, fill in needed(cfg, recipe(cfg), modes.of(cfg.ablation))}
    assert "experiment=import_predictors" in fills["predictors"]
    cfg.ablation.bank = "paper"
    fills = {what: fill for what, _, _, fill in needed(cfg, recipe(cfg), modes.of(cfg.ablation))}
    assert "experiment=train_predictors" in fills["predictors"] and "experiment.recipe=paper" in fills["predictors"]


# -- the metric catalogue reads which mode carries which metric from the registry -------------------
def test_every_metric_a_mode_declares_is_catalogued_and_named_for_it():
    from specee.bench import metrics_catalog as mc
    from specee.decoding import modes
    top = {m.key: m for m in mc.TOP}
    for name in modes.names():
        for key in modes.spec(name).extra_metrics:
            assert key in top, f"{name} declares {key}, which the catalogue lacks"
            assert name in mc.present_for(top[key]) or top[key].when is not None
    # a catalogued metric whose modes come from the registry names at least one
    assert all(mc.modes_carrying(m.key) for m in mc.TOP if m.when is None)


def test_committed_results_carry_no_metric_the_registry_gives_another_mode():
    from specee.bench.metrics_catalog import foreign_keys
    files = sorted((ROOT / "reports").rglob("results*.json"))
    assert files
    for f in files:
        doc = json.loads(f.read_text(encoding="utf-8"))
        assert not foreign_keys(doc["metrics"], doc["config"]["ablation"].get("mode", "dense")), f
    assert foreign_keys({"prompt_lookup": {}, "tokens_per_s": 1.0}, "dense") == ["prompt_lookup"]


# -- a new ablation is a YAML file and nothing else ------------------------------------------------
def _probe_conf(tmp_path: Path) -> Path:
    """A config folder holding one new ablation: specee_t1_t2.yaml copied under a new name and label."""
    folder = tmp_path / "probe_conf" / "ablation"
    folder.mkdir(parents=True)
    text = (ROOT / "conf" / "ablation" / "specee_t1_t2.yaml").read_text(encoding="utf-8")
    text = re.sub(r"(?m)^(\s*)name: specee_t1_t2$", r"\1name: specee_probe", text)
    text = re.sub(r"(?m)^(\s*)label: .*$", r"\1label: T1+T2 probe", text)
    assert "specee_probe" in text and "T1+T2 probe" in text
    (folder / "specee_probe.yaml").write_text(text, encoding="utf-8")
    return folder.parent


def _composed_ablation(name: str, searchpath: Path) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from specee.config import register
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", [f"ablation={name}", f"hydra.searchpath=[file://{searchpath}]"])
    return OmegaConf.to_container(cfg.ablation, resolve=True)


def _speed_result(ablation: dict, speedup: float, match: float, calls: float) -> dict:
    prompts = [{"id": f"{cat}{i}", "category": cat, "tokens": 11, "decode_s": 1.0 / speedup * (1 + i / 50),
                "dense_tokens": 11, "dense_decode_s": 1.0} for cat in ("qa", "writing") for i in range(3)]
    m = {"speedup_vs_dense": speedup, "speedup_vs_dense_ci": [speedup - 0.05, speedup + 0.05],
         "match_rate_vs_dense": match, "avg_layers": 3.0, "mean_accepted_length": 1.0, "tokens_per_s": 10 * speedup,
         "ms_per_token": 10 / speedup, "predictor_calls_per_token": calls,
         "dense": {"tokens_per_s": 10.0, "ms_per_token": 10.0}}
    return {"config": {"model": {"name": "tiny"}, "ablation": ablation, "early_exit": {}, "runtime": {"kind": "eager"},
                       "dataset": {"name": "spec_bench"}, "experiment": {"_target_": "experiments.speed.run"}},
            "env": {"cpu": "cpu", "gpus": [], "torch_threads": 2}, "created": "2026-12-05", "prompts": prompts,
            "metrics": m}


def _section(summary: str, title: str) -> str:
    return summary.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_a_new_ablation_yaml_reaches_the_report_with_no_python_edit(tmp_path):
    from specee.report import build_report
    conf = _probe_conf(tmp_path)
    assert "specee_probe" not in ablations.declared()  # nothing in the project knows it
    docs = [_speed_result(_composed_ablation("dense", conf), 1.0, 1.0, 0.0),
            _speed_result(_composed_ablation("pld", conf), 1.2, 1.0, 0.0),
            _speed_result(_composed_ablation("specee_t1", conf), 0.9, 0.95, 4.0),
            _speed_result(_composed_ablation("specee_probe", conf), 1.6, 0.9, 2.0)]
    assert docs[-1]["config"]["ablation"]["label"] == "T1+T2 probe"
    build_report(docs, tmp_path / "report", "probe")
    summary = (tmp_path / "report" / "summary.md").read_text(encoding="utf-8")
    staircase = _section(summary, "Ablation staircase")
    bars = [line.split("|")[1].strip() for line in staircase.splitlines()[2:] if line.startswith("| ")]
    assert bars == ["dense", "T1", "T1+T2 probe"]  # under its label, in its declared place
    which = _section(summary, "Which method, here?")
    assert re.search(r"\| specee_probe 1\.5\d \(0\.900\) \|", which)  # the fastest of all, lossy
    assert "| pld (tiny) |" in which  # the peer row
    verdicts = _section(summary, "Verdicts on the paper's claims")
    rows = [line for line in verdicts.splitlines() if "specee_probe" in line]
    assert any("T1+T2 faster than dense" in r and "| confirmed" in r for r in rows)  # its step's claim
    assert any("specee_probe vs specee_t1" in r for r in rows)  # T2 against T1 of the same bank


def test_the_bank_a_copied_ablation_declares_is_the_bank_its_rows_name(tmp_path):
    from specee import verdicts
    conf = _probe_conf(tmp_path)
    path = conf / "ablation" / "specee_probe.yaml"
    path.write_text(path.read_text(encoding="utf-8").replace("  order: 50", "  bank: tuned\n  order: 50"),
                    encoding="utf-8")
    probe = _speed_result(_composed_ablation("specee_probe", conf), 1.1, 0.9, 2.0)
    assert verdicts.bank(probe) == ablations.BANKS["tuned"]


def test_the_design_page_lists_the_files_a_new_ablation_and_mode_touch():
    """docs/design.md's "Adding a mode or an ablation": every file it names exists, an ablation is
    its YAML alone (the probe above follows it), and the identity fields it lists are the schema's."""
    from specee.config import AblationConfig
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = text.split("## Adding a mode or an ablation\n", 1)[1].split("\n## ", 1)[0]
    ablation = section.split("### An ablation\n", 1)[1]
    assert "no Python" in ablation and "`conf/ablation/<name>.yaml`" in ablation
    assert all(f"`{f}`" in ablation for f in ablations.FIELDS)
    assert set(ablations.FIELDS) <= set(AblationConfig.__dataclass_fields__)
    for path in sorted(set(re.findall(r"`((?:specee|conf|tests|scripts)/[^`\s]+)`", section))):
        concrete = path.replace("<name>", "dense").replace("reproduce*", "reproduce")
        assert (ROOT / concrete).exists(), f"docs/design.md names {path}, which is not there"


# -- no import circles ------------------------------------------------------------------------------
def _modules() -> dict[str, Path]:
    out = {}
    for folder in ("specee", "experiments"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of specee/ and experiments/ it imports, at the top or inside a function
    (a deferred import is still a dependency)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None
    graph = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                out |= {resolve(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                out |= {resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else resolve(base)
                        for a in node.names}
        graph[mod] = {m for m in out if m and m != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_specee_and_experiments_have_no_import_circle():
    graph = import_graph()
    assert "specee.report" in graph and "specee.runtime.layerwise" in graph["specee.runtime.build"]
    circles = cycles(graph)
    assert not circles, "import circles (each: the modules that import one another):\n" + "\n".join(
        " <-> ".join(c) + "\n    " + "; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in circles)


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_one_json_reader_accepts_a_byte_order_mark(tmp_path):
    from specee import cards, io, results
    assert cards.read_json is io.read_json
    path = tmp_path / "results.json"
    doc = {"specee_results": 1, "config": {"model": {}, "ablation": {}, "experiment": {}}, "env": {}, "metrics": {}}
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(doc).encode())  # what some editors save
    assert results.read_results(path, "rerun it") == doc
    path.write_text('{"specee_results": 1', encoding="utf-8")
    with pytest.raises(SpeceeError, match=r"results.json is corrupt \(truncated\).*rerun it"):
        results.read_results(path, "rerun it")


def test_the_exit_control_checks_have_distinct_names():
    from specee.runtime import device_walk
    from specee.config import rules
    assert not hasattr(device_walk, "check_exit_control") and hasattr(rules, "check_exit_control")
    assert hasattr(device_walk, "check_device_exits_supported")


def folder_of(mod: str) -> str:
    """The folder a module is in: its package under specee/ (``specee.decoding``), or for a module
    at the top of specee/ the module itself (each is its own room); a recipe is ``experiments``."""
    parts = mod.split(".")
    if parts[0] == "experiments":
        return "experiments"
    if len(parts) >= 2 and (ROOT / "specee" / parts[1]).is_dir():
        return f"specee.{parts[1]}"
    return mod


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        src = folder_of(mod)
        out.setdefault(src, set()).update(folder_of(d) for d in deps if folder_of(d) != src)
    return out


def test_no_loop_between_folders_counting_imports_inside_functions():
    """Folders (the packages of specee/, each top-level module on its own) import one another in one
    direction only: a deferred import inside a function counts, since it is still a dependency."""
    graph = import_graph()
    folders = folder_graph(graph)
    assert "specee.decoding" in folders["specee.frontier"]
    loops = cycles(folders)
    assert not loops, "loops between folders:\n" + "\n".join(
        " <-> ".join(c) + "\n    " + "; ".join(
            f"{a} -> {b} ({', '.join(sorted(m for m in graph if folder_of(m) == a and any(folder_of(d) == b for d in graph[m])))})"
            for a in c for b in sorted(folders[a] & set(c))) for c in loops)


def test_the_folder_loop_finder_finds_one_made_by_a_deferred_import():
    graph = {"specee.runtime.layerwise": {"specee.early_exit.features"}, "specee.early_exit.kv_policy": {"specee.runtime.layerwise"},
             "specee.early_exit.features": set()}
    assert cycles(folder_graph(graph)) == [["specee.early_exit", "specee.runtime"]]
