"""The main job (`python run.py`): the default reproduction on the configured model.

Runs, each in its own process and into its own folder under ``runs/reproduce/<name>/``:
speed jobs for every ablation in ``experiment.ablations`` (plus the KV-policy variants), the
exit statistics, the accuracy subset, then the report. A second run reuses finished jobs (each
job skips when its results.json exists; ``force=true`` reruns all).
"""
from __future__ import annotations

import time

from tqdm import tqdm

from specee import ablations
from specee.decoding.operating_point import read_frontier
from specee.errors import SpeceeError
from specee.jobs import run_job
from specee.io import PROJECT_ROOT, project_path


# Speed sets whose prompts are not shipped (licence): run only where the data root holds them.
NOT_SHIPPED = {"alpaca": "alpaca_gpt4_demo"}


def _model_option(cfg) -> str:
    """The model= option this run composed (a fine-tune under a base model's config keeps its own
    model.name, passed beside it)."""
    from hydra.core.hydra_config import HydraConfig
    try:
        return HydraConfig.get().runtime.choices.get("model") or cfg.model.name
    except ValueError:  # not under hydra.main (plan() called from a test)
        return cfg.model.name


def bank(cfg) -> str:
    """Which bank the SpecEE jobs read: authors (the released bank: each step's ablation that
    declares ``bank: authors``) or trained (the ablations as named: this harness's training).
    auto: the authors' when their bank
    for this model is in paths.artifacts and the weights are the pretrained ones (on random weights
    every bank is a random stand-in)."""
    e = cfg.experiment
    if e.bank != "auto":
        return e.bank
    folder = project_path(f"{cfg.paths.artifacts}/{cfg.model.name}_predictors_authors")
    return "authors" if cfg.model.init == "pretrained" and folder.is_dir() else "trained"


def skipped_sets(cfg) -> list[str]:
    """Speed sets left out because the data root does not hold their prompts."""
    root = project_path(cfg.paths.data_root)
    return [s for s in cfg.experiment.speed_sets
            if s.partition(":")[0] in NOT_SHIPPED and not (root / NOT_SHIPPED[s.partition(":")[0]]).is_dir()]


def certified_policies(src) -> set[str]:
    """The ablations a frontier result certified a point for (each job then checks its point)."""
    if not src:
        return set()
    doc, _ = read_frontier(str(src), "experiment.operating_point")
    return {name for name, c in doc["metrics"]["calibration"].items() if c.get("chosen") is not None}


def plan(cfg) -> list[tuple[str, list[str]]]:
    e = cfg.experiment
    m = cfg.model
    common = [f"model={_model_option(cfg)}", f"model.name={m.name}", f"paths.data_root={cfg.paths.data_root}",
              f"paths.artifacts={cfg.paths.artifacts}", f"paths.models={cfg.paths.models}", f"seed={cfg.seed}",
              f"model.init={m.init}", f"model.device={m.device}", f"model.dtype={m.dtype}"]
    if m.path:
        common.append(f"model.path={m.path}")
    if m.num_layers is not None:
        common.append(f"model.num_layers={m.num_layers}")
    if cfg.threads:
        common.append(f"threads={cfg.threads}")
    data = [f"dataset={e.dataset}", f"dataset.count={e.count}", f"dataset.max_new_tokens={e.max_new_tokens}"]
    authors = bank(cfg) == "authors"
    # under the authors' bank each SpecEE step runs as the ablation declaring that step with it
    named = lambda a: ablations.variant(a, "authors") if authors else a  # noqa: E731

    def speed_set(s: str) -> list[str]:
        """``name`` or ``name:category`` (a Spec-Bench category) -> dataset overrides."""
        name, _, category = s.partition(":")
        return [f"dataset={name}", *([f"dataset.categories=[{category}]"] if category else []),
                f"dataset.count={e.count}", f"dataset.max_new_tokens={e.max_new_tokens}"]

    certified = certified_policies(e.operating_point)

    def at_point(a: str) -> list[str]:
        return [f"early_exit.operating_point={e.operating_point}"] if named(a) in certified else []

    def speed(a: str, prompts: list[str] = data) -> list[str]:
        hf = [] if a in e.hf_generate_ablations else ["experiment.compare_hf_generate=false"]
        return ["experiment=speed", f"ablation={named(a)}", *hf, *prompts, *e.speed_overrides, *at_point(a)]
    if e.speed_sets:  # one speed job per ablation and prompt set (the paper's protocol: six sets)
        skip = skipped_sets(cfg)
        jobs = [(f"speed_{a}_{s.replace(':', '_')}", speed(a, speed_set(s))) for a in e.ablations
                for s in e.speed_sets if s not in skip]
    else:
        jobs = [(f"speed_{a}", speed(a)) for a in e.ablations]
    jobs += [(f"speed_{a}_{kv}", [*speed(a), f"early_exit.kv_policy={kv}"])
             for a in e.kv_policy_variants for kv in ("propagate",)]
    jobs += [(f"speed_{a}_independent", [*speed(a), "ablation.mapping=independent"]) for a in e.mapping_variants]
    jobs += [(f"speed_{a}_compiled", [*speed(a), "runtime=compiled"]) for a in e.runtime_variants]
    if e.stats:
        stats = [a for a in data if not a.startswith("dataset.count=")] + [f"dataset.count={e.stats_count or e.count}"]
        if e.stats_placements:
            stats.append(f"experiment.placements=[{','.join(e.stats_placements)}]")
        t1_authors = ablations.with_step("T1", "authors")  # the statistics read predictors at every layer
        jobs.append(("stats", ["experiment=stats", *stats, *([f"ablation={t1_authors}"] if authors and t1_authors else [])]))
    groups = [("", e.accuracy_tasks, e.accuracy_limit, []),
              ("_perplexity", e.perplexity_tasks, e.perplexity_limit, []),
              ("_chat", e.chat_tasks, e.accuracy_limit, ["experiment.chat_template=true"])]
    for a in e.accuracy_ablations:
        for suffix, tasks, limit, more in groups:
            if tasks:
                jobs.append((f"accuracy_{a}{suffix}", ["experiment=accuracy", f"ablation={named(a)}",
                                                       f"experiment.tasks=[{','.join(tasks)}]",
                                                       f"experiment.limit={'null' if limit is None else limit}",
                                                       *e.accuracy_overrides, *more, *at_point(a)]))
    return [(name, [*common, *args]) for name, args in jobs]


def _dense_ms_per_token(root) -> float | None:
    """Dense's decode ms/token in this reproduction's speed job of the reference ablation (None
    before it ran)."""
    import json
    path = root / f"speed_{ablations.reference_name()}" / "results.json"
    try:
        return json.loads(path.read_text())["metrics"]["dense"]["ms_per_token"]
    except (OSError, ValueError, KeyError):
        return None


def _write_timing(root, cfg, seconds: dict, minutes: float, dense_ms) -> None:
    """runs/reproduce/<name>/timing.json: this run's wall time per job (jobs reused from an earlier run
    are absent), its total, and the machine it ran on."""
    import json

    from specee.env import environment
    env = environment()
    root.mkdir(parents=True, exist_ok=True)
    (root / "timing.json").write_text(json.dumps(
        {"name": cfg.experiment.name, "model": cfg.model.name, "total_minutes": round(minutes, 2),
         "job_seconds": seconds, "jobs_reused": len(plan(cfg)) - len(seconds), "dense_ms_per_token": dense_ms,
         "machine": {k: env[k] for k in ("cpu", "cpu_caches", "cpu_count", "torch_threads")},
         "created": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))


def run(cfg):
    root = PROJECT_ROOT / "runs" / "reproduce" / cfg.experiment.name
    jobs = plan(cfg)
    if cfg.experiment.speed_sets:
        for s in skipped_sets(cfg):
            tqdm.write(f"[{s}] left out: its prompts are not shipped ({NOT_SHIPPED[s.partition(':')[0]]}/ is not in "
                       f"paths.data_root={cfg.paths.data_root}; point paths.data_root at a data root that holds it)")
    tqdm.write(f"SpecEE bank: {bank(cfg)}")
    t0, failed, seconds = time.perf_counter(), [], {}
    for name, args in tqdm(jobs, desc="reproduce", unit="job"):
        out = root / name
        if (out / "results.json").is_file() and not cfg.force:
            tqdm.write(f"[{name}] finished earlier, reusing {out / 'results.json'}")
            continue
        tqdm.write(f"[{name}] python run.py {' '.join(args)}")
        force = ["force=true"] if cfg.force else []
        job = run_job([*args, *force], out)
        rc, seconds[name] = job.rc, job.seconds
        tqdm.write(f"[{name}] {seconds[name]:.0f} s")
        if rc != 0:
            failed.append(name)
            tqdm.write(f"[{name}] failed (exit status {rc}); continuing with the other jobs")
    report_dir = project_path(cfg.experiment.report_dir) if cfg.experiment.report_dir else \
        PROJECT_ROOT / "reports" / cfg.experiment.name
    rc = run_job(["experiment=report", f"sweep={root.relative_to(PROJECT_ROOT)}", f"experiment.out_dir={report_dir}"],
                 root / "_report").rc
    minutes = (time.perf_counter() - t0) / 60
    dense_ms = _dense_ms_per_token(root)
    _write_timing(root, cfg, seconds, minutes, dense_ms)
    print(f"\nreproduction '{cfg.experiment.name}' done in {minutes:.1f} min: {len(jobs) - len(failed)}/{len(jobs)} jobs ok"
          + (f" (dense {cfg.model.name} at {dense_ms:.1f} ms/token on this machine: the figure a time here scales with)"
             if dense_ms else ""))
    print(f"results: {root}\nreport:  {report_dir / 'report.pdf'}\nsummary: {report_dir / 'summary.md'}")
    if failed or rc != 0:
        raise SpeceeError(f"jobs failed: {failed or ['report']}; their messages are above")
    return str(report_dir / "report.pdf")
