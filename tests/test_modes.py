"""The mode registry is the one home of a decoding mode: a mode registered from outside the package
runs through validation, the launcher, the speed recipe, the cost model and the report; no mode
name is compared anywhere else; the config package has one job per module; recipes stay apart."""
import ast
import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from conftest import ROOT

from specee.decoding import modes
from specee.errors import SpeceeError


class _EchoDecoder:
    """A throwaway mode: dense decoding under another name (its own module would hold this)."""

    def __new__(cls, rt):
        from specee.decoding.dense import DenseDecoder
        dec = DenseDecoder(rt)
        dec.name = "echo"
        return dec


@pytest.fixture
def echo_mode():
    spec = modes.register(modes.ModeSpec(
        "echo", "echo (a throwaway mode for the registry's test)", lambda cfg, rt, parts, **_: _EchoDecoder(rt),
        costs=modes.CostCounts(dense=True)))
    yield spec
    modes.unregister("echo")


def _compose(overrides, out: Path | None = None):
    from hydra import compose, initialize_config_dir
    from specee.config import register
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides, return_hydra_config=out is not None)
    if out is not None:
        from hydra.core.hydra_config import HydraConfig
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(out)
        HydraConfig.instance().set_config(cfg)
        cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    return cfg


ECHO = ["ablation=dense", "ablation.mode=echo", "ablation.name=echo"]
SMALL = ["model=tiny", "dataset.categories=[qa]", "dataset.count=1", "dataset.max_new_tokens=6",
         "experiment.warmup=0", "experiment.cost_rounds=3", "experiment.compare_hf_generate=false"]


def test_an_unregistered_mode_is_refused_naming_the_registered_ones():
    from specee.launch import compose_and_check
    with pytest.raises(SpeceeError, match=r"ablation.mode='echo' is unknown; valid: dense, specee"):
        compose_and_check(["experiment=speed", *ECHO])


def test_a_registered_mode_runs_through_validation_launcher_cost_model_and_report(echo_mode, tmp_path):
    from specee.cost_model import priced_work as cm
    from specee.launch import compose_and_check, run_experiment
    from specee.report import build_report
    compose_and_check(["experiment=speed", *ECHO, *SMALL])  # validation and preflight
    # Its spec is what the rules read: a tree or a placement is refused for a mode that has none.
    with pytest.raises(SpeceeError, match="needs a draft-tree mode"):
        compose_and_check(["experiment=speed", *ECHO, "ablation.decoding=tree"])
    with pytest.raises(SpeceeError, match="schedules SpecEE predictors"):
        compose_and_check(["experiment=speed", *ECHO, "placement=offline_topm"])
    cfg = _compose(["experiment=speed", *ECHO, *SMALL], out=tmp_path / "run")
    m = run_experiment(cfg)  # the launcher dispatches to the speed recipe, which builds the decoder by spec
    assert m["match_rate_vs_dense"] == 1.0 and m["avg_layers"] == m["num_layers"]
    counts = m["cost_model"]["counts"]  # the cost model counted it as its spec says (dense work)
    assert counts["layer_steps"] == m["num_layers"] and counts["predictor_calls"] == 0
    assert cm.count_work([], 4, "echo")["layer_steps"] == 4
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    assert doc["config"]["ablation"]["mode"] == "echo"
    info = build_report([doc], tmp_path / "report", "test")
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "echo" in summary and info["pages"]
    # Its counts priced on each GPU path (it has no exits to decide on the device).
    assert "Where a token's time goes on a GPU, per path" in info["pages"]
    paths = m["cost_model"]["predicted_gpu_paths"]["by_model"]["llama2_7b"]["paths"]
    assert set(paths) == {"eager", "graphed_host_exits"}


def test_the_specs_answer_what_the_rules_used_to_spell_out():
    tree = OmegaConf.create({"mode": "specee", "decoding": "tree"})
    assert modes.is_tree(tree) and not modes.is_tree({"mode": "specee", "decoding": "autoregressive"})
    assert modes.is_tree({"mode": "eagle", "decoding": "tree"}) and not modes.is_tree({"mode": "pld"})
    lossless = {n for n in modes.names() if modes.spec(n).lossless}
    assert lossless == {"dense", "eagle", "pld", "hf_pld", "hf_self_spec"}
    assert [n for n in modes.names() if modes.spec(n).reference] == ["dense"]
    assert {n for n in modes.names() if modes.spec(n).needs_bank} == {"specee"}


# A mode name compared to a value (`mode == "x"`, `mode in ("x", ...)`, `["mode"] != "x"`) anywhere
# but the registry: the concept would have two homes again.
_MODE_NAMES = ("dense", "specee", "adainfer", "eagle", "pld", "hf_pld", "hf_self_spec")
_COMPARE = re.compile(r"""mode"?\]?\s*(==|!=|\bin\b|\bnot in\b)\s*[\(\[{]?\s*["'](%s)["']""" % "|".join(_MODE_NAMES))


def test_no_mode_name_is_compared_outside_the_registry():
    hits = []
    for folder in ("specee", "experiments", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "specee" / "decoding" / "modes.py":
                continue
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if _COMPARE.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "mode names compared outside specee/decoding/modes.py:\n" + "\n".join(hits)


def test_the_mode_comparison_pattern_finds_what_it_is_meant_to():
    for line in ('if cfg.ablation.mode == "pld":', 'if mode in ("specee", "eagle"):',
                 'if doc["config"]["ablation"]["mode"] != "dense" and x:'):
        assert _COMPARE.search(line), line
    assert not _COMPARE.search('sides = {"dense": dense, "mode": decoder}')


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            if node.module == "experiments":
                names |= {f"experiments.{a.name}" for a in node.names}
    return names


def test_the_library_never_imports_a_recipe_and_no_recipe_imports_another():
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in sorted((ROOT / "specee").rglob("*.py"))
           for m in _imports(p) if m == "experiments" or m.startswith("experiments.")]
    for p in sorted((ROOT / "experiments").glob("*.py")):
        bad += [f"{p.relative_to(ROOT)} imports {m}" for m in _imports(p)
                if (m == "experiments" or m.startswith("experiments.")) and m != f"experiments.{p.stem}"]
    assert not bad, "\n".join(bad)


def test_config_is_a_package_of_one_job_per_module():
    assert not (ROOT / "specee" / "config.py").exists()
    assert {p.stem for p in (ROOT / "specee" / "config").glob("*.py")} == {"__init__", "schemas", "store", "checks",
                                                                             "rules"}
    # Allowed values a module owns are read from it, not retyped.
    from specee.config import CHOICES, EarlyExitConfig
    from specee.early_exit.kv_policy import POLICIES
    assert CHOICES[EarlyExitConfig]["kv_policy"]() == POLICIES


def test_recipe_facts_are_declared_once_on_each_experiment_schema():
    from specee.config import SCHEMAS, Recipe
    experiments = {cls for (group, _), cls in SCHEMAS.items() if group == "experiment"}
    assert all(isinstance(cls.facts, Recipe) for cls in experiments)
    for text in ("_LOADS_MODEL", "_REUSES_FINISHED"):  # the lists the facts replaced
        for path in (ROOT / "specee").rglob("*.py"):
            assert text not in path.read_text(encoding="utf-8"), path
