"""The docs cannot go stale: the generated reference equals what its script writes, every
documented `python run.py` command composes and passes the harness's own checks (or fails only
on data a fresh clone lacks), the README stays short and reaches each topic in one link, and a
real speed result carries no metric the catalog does not declare."""
from __future__ import annotations

import importlib.util
import json
import re
import shlex

import pytest

from conftest import ROOT, run_cli

DOCS = sorted((ROOT / "docs").glob("*.md"))
README = ROOT / "README.md"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# -- (a) the generated reference -----------------------------------------------------------------
def test_committed_reference_is_what_the_generator_writes():
    committed = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    assert committed == _generator().render(), \
        "docs/reference.md is stale: run `python scripts/gen_reference.py` and commit it"


def test_reference_lists_every_option_and_field():
    """The page is built from the code, so a new option or field shows up in it (and a stale
    committed page then fails the test above)."""
    import dataclasses
    from specee.config import SCHEMAS, options
    text = _generator().render()
    for group in ("experiment", "model", "ablation", "placement", "draft", "runtime", "dataset"):
        for name in options(group):
            assert f"`{group}={name}`" in text, f"{group}={name} missing from the reference"
    for (group, _), cls in SCHEMAS.items():
        for f in dataclasses.fields(cls):
            if f.name != "_target_":
                assert re.search(rf"`[\w.]*\b{re.escape(f.name)}`", text), f"{group}.{f.name} missing"


def test_reference_check_mode_fails_on_a_stale_page(tmp_path, monkeypatch):
    gen = _generator()
    stale = tmp_path / "reference.md"
    stale.write_text(gen.render().replace("`ablation=dense`", "`ablation=gone`"), encoding="utf-8")
    monkeypatch.setattr(gen, "OUT", stale)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1
    stale.write_text(gen.render(), encoding="utf-8")
    assert gen.main(["--check"]) == 0


# -- (b) every documented command composes ---------------------------------------------------------
def fenced_blocks(text: str) -> list[str]:
    # `console` blocks show a session with its output (an error on purpose, say): not commands to run.
    return re.findall(r"^```(?:bash|sh|shell)?\n(.*?)^```", text, flags=re.S | re.M)


def run_commands(path) -> list[tuple[str, list[str]]]:
    """The `python run.py ...` commands of a markdown file's fenced blocks, with shell variables
    assigned earlier in the same block (M="...") expanded and line continuations joined."""
    out = []
    for block in fenced_blocks(path.read_text(encoding="utf-8")):
        env = {}
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            m = re.match(r'^([A-Z_]+)="([^"]*)"$', line)
            if m:
                env[m.group(1)] = m.group(2)
                continue
            m = re.match(r"^(?:\.venv/bin/)?python3? run\.py\b(.*)$", line)
            if not m:
                continue
            rest = re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda v: env.get(v.group(1) or v.group(2), v.group(0)), m.group(1))
            args = shlex.split(rest, comments=True)
            out.append((line, args or ["experiment=reproduce"]))  # bare `python run.py`: the main job
    return out


COMMANDS = [(p.relative_to(ROOT).as_posix(), line, args)
            for p in [README, *DOCS] for line, args in run_commands(p)]

# What a fresh clone lacks, and the words its one-line error must then contain: a checkpoint the
# reader supplies (/path/to/...), a model fetched later (models/...), a sweep not yet run, a
# training data root (DIR), a user's own prompt file.
MISSING_DATA = (r"/path/to/", r"models/smollm2_135m", r"runs/multirun/", r"\bDIR\b", r"my_prompts\.jsonl",
                r"my_tasks")


def _expected_failure(args: list[str], message: str) -> bool:
    """One line naming data a fresh clone lacks (given on the command line, or implied by an
    option: model=smollm2_135m reads models/smollm2_135m, which experiment=fetch writes)."""
    return "\n" not in message and any(re.search(p, message) for p in MISSING_DATA)


def test_docs_hold_commands_to_check():
    files = {f for f, _, _ in COMMANDS}
    assert "README.md" in files and len(COMMANDS) >= 20, COMMANDS


@pytest.mark.parametrize("where,line,args", COMMANDS, ids=[f"{f}:{l[:60]}" for f, l, _ in COMMANDS])
def test_documented_command_composes(where, line, args):
    from specee.errors import SpeceeError
    from specee.launch import compose_and_check, sweep_jobs
    flags = [a for a in args if a.startswith("-")]
    assert set(flags) <= {"-m", "--multirun"}, f"{where}: unexpected flag in `{line}`"
    jobs = (sweep_jobs(args) or [[a for a in args if not a.startswith("-")]]) if flags else [args]
    for job in jobs:
        try:
            try:
                compose_and_check(job)
            except SpeceeError as err:
                if "no CUDA GPU is visible" not in str(err):
                    raise
                # A GPU command on a machine without one: check everything else as it would run.
                compose_and_check([*job, "model.device=cpu", "model.dtype=float32"])
        except SpeceeError as err:
            assert _expected_failure(job, str(err)), f"{where}: `{line}` fails: {err}"


def test_a_broken_command_is_caught():
    """The check above must be able to fail: a misspelt option or key is not taken for missing data."""
    from specee.errors import SpeceeError
    from specee.launch import compose_and_check
    for args in (["experiment=sped"], ["experiment=speed", "ablation=specee_t1_t2", "early_exit.k=0"],
                 ["experiment=speed", "model=llama2_7b", "model.path=/path/to/x", "model.dtyp=float16"]):
        with pytest.raises(SpeceeError) as err:
            compose_and_check(args)
        assert not _expected_failure(args, str(err.value)), str(err.value)


# -- (c) the README -------------------------------------------------------------------------------
def _links(path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'src="([^"]+)"', text)


def test_readme_is_short_and_starts_with_the_commands_and_the_status():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (at most 150: depth goes to docs/)"
    first_screen = "\n".join(lines[:40])
    # CI and the tests' tier docs rely on these two commands, byte for byte.
    assert ('python3.11 -m venv .venv && .venv/bin/pip install -e ".[dev]" && .venv/bin/python run.py'
            in first_screen)
    assert ".venv/bin/python -m pytest -q" in first_screen
    assert "| model (machine) | claim of the paper | verdict |" in first_screen
    assert "awaits a GPU" in first_screen


@pytest.mark.parametrize("topic,page,anchor_words", [
    ("7B walkthrough", "docs/your-model.md", "Llama-2-7B on a GPU"),
    ("verdicts", "docs/paper-protocol.md", "## Verdicts"),
    ("results contract", "docs/results.md", "# Results contract"),
    ("drift check", "docs/accuracy.md", "## The drift check"),
    ("SLURM sweep", "docs/sweeps.md", "## A sweep on SLURM"),
    ("adding a model", "docs/your-model.md", "## Adding a model"),
])
def test_each_topic_is_one_link_from_the_readme(topic, page, anchor_words):
    targets = {link.split("#")[0] for link in _links(README)}
    assert page in targets, f"README.md does not link {page} ({topic})"
    assert anchor_words in (ROOT / page).read_text(encoding="utf-8"), f"{page} lost its {topic} section"


def test_every_relative_link_and_image_exists():
    for path in [README, *DOCS, *sorted((ROOT / "reports").glob("*/README.md"))]:
        for link in _links(path):
            if re.match(r"^[a-z]+:", link) or link.startswith("#"):
                continue
            target = (path.parent / link.split("#")[0]).resolve()
            assert target.exists(), f"{path.relative_to(ROOT)} links {link}, which does not exist"
            if "#" in link and target.suffix == ".md":
                assert link.split("#")[1] in _anchors(target), f"{path.relative_to(ROOT)} links {link}: no such heading"


def _anchors(path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


# -- the metrics catalog against a real speed result ----------------------------------------------
def test_committed_speed_results_carry_only_catalogued_metrics():
    from specee.bench.metrics_catalog import unknown_keys
    files = sorted((ROOT / "reports").rglob("results*.json"))
    assert files
    for f in files:
        metrics = json.loads(f.read_text())["metrics"]
        assert not unknown_keys(metrics), f"{f.relative_to(ROOT)}: not in specee/bench/metrics_catalog.py"


def test_unknown_keys_names_a_new_metric():
    from specee.bench.metrics_catalog import unknown_keys
    assert unknown_keys({"tokens_per_s": 1, "dense": {"ms_per_token": 2, "new_side_key": 3}, "new_key": 4}) == \
        ["new_key", "dense.new_side_key"]


def test_a_real_speed_run_carries_only_catalogued_metrics(micro, tmp_path):
    """A tree-mode SpecEE run on the shared micro artifacts writes the widest set of keys (early
    exit, tree, oracle, cost model, HF generate); every one must be in the catalog."""
    from specee.bench.metrics_catalog import unknown_keys
    _, paths = micro
    res = run_cli("experiment=speed", "ablation=specee_full", *paths, "dataset.categories=[writing]",
                  "dataset.max_new_tokens=8", "experiment.cost_rounds=2", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-2000:]
    metrics = json.loads((tmp_path / "results.json").read_text())["metrics"]
    assert not unknown_keys(metrics), "add these to specee/bench/metrics_catalog.py"
