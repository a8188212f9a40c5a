"""Recipe: the PDF report + markdown summary of a sweep, from stored results only.

    python run.py experiment=report sweep=runs/multirun/default   # -> reports/default/report.pdf
"""
from __future__ import annotations

from specee import verdicts
from specee.errors import SpeceeError
from specee.io import PROJECT_ROOT, project_path
from specee.report import build_report
from specee.results import read_sweep
from specee.table import load_results


def run(cfg):
    if not cfg.sweep:
        raise SpeceeError("experiment=report needs sweep=DIR (a folder of jobs with results.json)")
    root = project_path(cfg.sweep)
    if not root.is_dir():
        load_results(root)  # its one line for a sweep folder that is not there
    whole, broken = read_sweep(root)  # a broken results.json is listed, the whole ones still reported
    # Per-item accuracy records of an earlier report (its items/ folder copied into the sweep) pair
    # with this sweep's rows as if their runs were here (specee/verdicts.py).
    docs = verdicts.with_item_records([d for _, d in whole], root)
    for path, why in broken:
        print(f"  skipped {path}: {why}")
    if not docs:
        raise SpeceeError(f"no results.json under {root}; run the sweep first")
    out = project_path(cfg.experiment.out_dir) if cfg.experiment.out_dir else PROJECT_ROOT / "reports" / root.name
    source = str(cfg.sweep)
    if broken:  # the report itself says what it left out, not only this job's log
        names = [str(p.relative_to(root)) for p, _ in broken]
        source += f" ({len(broken)} broken results.json skipped: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
    info = build_report(docs, out, source)
    records = verdicts.write_item_records(docs, out)  # a committed report keeps what its rows rest on
    if records:
        print(f"per-item records: {len(records)} files under {out / verdicts.ITEMS}")
    print(f"report: {info['pdf']} ({len(info['pages'])} pages: {', '.join(info['pages'])})")
    for title, why in info["skipped"]:
        print(f"  skipped {title}: {why}")
    print(f"summary: {info['markdown']}")
    return info
