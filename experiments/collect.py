"""Recipe: collect a sweep's results into one table, without rerunning anything.

    python run.py experiment=collect sweep=runs/multirun/default      # -> <sweep>/results.csv
"""
from __future__ import annotations

from specee.errors import SpeceeError
from specee.io import project_path
from specee.table import results_table


def run(cfg):
    if not cfg.sweep:
        raise SpeceeError("experiment=collect needs sweep=DIR (a folder of jobs with results.json)")
    root = project_path(cfg.sweep)
    table = results_table(root)
    out = root / "results.csv"
    tmp = out.with_suffix(".csv.tmp")
    table.to_csv(tmp, index=False)
    tmp.replace(out)
    print(f"{len(table)} jobs, {len(table.columns)} columns -> {out}")
    return str(out)
