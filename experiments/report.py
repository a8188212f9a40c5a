"""Recipe: the PDF report + markdown summary of a sweep, from stored results only.

    python run.py experiment=report sweep=runs/multirun/default   # -> reports/default/report.pdf
"""
from __future__ import annotations

from specee.errors import SpeceeError
from specee.io import PROJECT_ROOT, project_path
from specee.report import build_report
from specee.table import load_results


def run(cfg):
    if not cfg.sweep:
        raise SpeceeError("experiment=report needs sweep=DIR (a folder of jobs with results.json)")
    root = project_path(cfg.sweep)
    docs = [d for _, d in load_results(root)]
    if not docs:
        raise SpeceeError(f"no results.json under {root}; run the sweep first")
    out = project_path(cfg.experiment.out_dir) if cfg.experiment.out_dir else PROJECT_ROOT / "reports" / root.name
    info = build_report(docs, out, str(cfg.sweep))
    print(f"report: {info['pdf']} ({len(info['pages'])} pages: {', '.join(info['pages'])})")
    for title, why in info["skipped"]:
        print(f"  skipped {title}: {why}")
    print(f"summary: {info['markdown']}")
    return info
