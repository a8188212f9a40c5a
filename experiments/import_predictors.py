"""Recipe: import the SpecEE authors' released predictor bank (Llama-2-7b-chat) as a harness bank.

    python run.py experiment=import_predictors model=llama2_7b      # no model weights are read

Reads ``experiment.source`` (their model0.pth .. model31.pth, LICENSE.txt, optional SHA256SUMS)
with specee/early_exit/authors.py, which never executes the pickles, and writes
``experiment.out_dir`` (default ``<artifacts>/<model>_predictors_authors``, beside -- not over --
a bank the harness trains itself): predictors.safetensors, predictors_card.json (source, licence,
sha256 of every input file), the licence and a NOTICE. Use it with
``early_exit.predictors_path=<out_dir> placement=authors_llama2_7b``.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from specee.early_exit.authors import AUTHORS_K, SOURCE_NAME, card_for, load_authors_bank, sha256_file
from specee.early_exit.predictor import CARD, PredictorBank
from specee.errors import SpeceeError
from specee.io import project_path

LICENSE = "LICENSE.txt"
SUMS = "SHA256SUMS"
NOTICE = "NOTICE.md"
_SHAPES = Path(__file__).resolve().parents[1] / "specee" / "models" / "shapes"


def _model_layers(model_cfg) -> int | None:
    """The model's depth without loading it: model.path's config.json, else the shipped shape."""
    src = project_path(model_cfg.path) / "config.json" if model_cfg.path else _SHAPES / f"{model_cfg.name}.json"
    if not src.is_file():
        return None
    try:
        n = json.loads(src.read_text())["num_hidden_layers"]
    except (ValueError, KeyError, OSError) as err:
        raise SpeceeError(f"{src} does not say the model's num_hidden_layers ({type(err).__name__})") from None
    return model_cfg.num_layers if model_cfg.init == "random" and model_cfg.num_layers else n


def _check_sums(source: Path, sha: dict[str, str]) -> None:
    """The source's own SHA256SUMS (when it has one) against the files read: a damaged copy stops here."""
    sums = source / SUMS
    if not sums.is_file():
        return
    listed = {}
    for line in sums.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            listed[parts[1].lstrip("*")] = parts[0].lower()
    bad = [name for name, digest in sha.items() if name in listed and listed[name] != digest]
    if bad:
        raise SpeceeError(f"{source / bad[0]} does not match its sha256 in {sums} ({len(bad)} file(s) differ); "
                          "copy the authors' folder again")


def _notice(card: dict) -> str:
    src = card["source"]
    return (f"# {SOURCE_NAME}, converted\n\n"
            f"- Origin: {src['origin']}.\n"
            f"- Licence: {card['licence']}. The weights are the authors' work; this folder redistributes them "
            "under that licence.\n"
            f"- Changes: {card['conversion']}. The 32 pickled modules became one safetensors file "
            "(`predictors.safetensors`, read by `PredictorBank.load`); the sha256 of every input file is in "
            "`predictors_card.json`.\n"
            "- Use: `early_exit.predictors_path=<this folder> placement=authors_llama2_7b` on "
            "`model=llama2_7b` (Llama-2-7b-chat-hf with the EAGLE head EAGLE-llama2-chat-7B).\n"
            f"- Feature definition they were trained on: {card['feature_definition']}.\n"
            f"- Recreate: `{card['command']}` with the authors' folder under the data root.\n")


def run(cfg):
    e = cfg.experiment
    if cfg.model.name != e.source_model:
        raise SpeceeError(f"the authors' bank at experiment.source was trained for model={e.source_model}; this run "
                          f"has model={cfg.model.name} (its hidden states would make its decisions meaningless)")
    if cfg.early_exit.k != AUTHORS_K:
        raise SpeceeError(f"the authors' predictors take K={AUTHORS_K} speculative tokens; this run has "
                          f"early_exit.k={cfg.early_exit.k}")
    source, out = project_path(e.source), project_path(e.out_dir)
    if not (source / LICENSE).is_file():
        raise SpeceeError(f"{source} has no {LICENSE}: the authors' Apache-2.0 licence must travel with the "
                          "converted bank; copy it from their repository beside the model<i>.pth files")
    bank, sha = load_authors_bank(source, _model_layers(cfg.model), cfg.early_exit.k)
    _check_sums(source, sha)
    extra = {f.name: sha256_file(f) for f in sorted(source.iterdir())
             if f.is_file() and f.name not in sha}
    card = card_for(source, sha, extra, bank, cfg.model.name)

    if (out / CARD).is_file() and not cfg.force:
        try:
            old = json.loads((out / CARD).read_text())
        except ValueError:
            old = {}
        if (old.get("source") or {}).get("what") != SOURCE_NAME:
            raise SpeceeError(f"{out} already holds a predictor bank that is not an import of the authors' "
                              "(a trained one?); choose another experiment.out_dir or pass force=true to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        bank.save(tmp, card)
        shutil.copyfile(source / LICENSE, tmp / LICENSE)
        (tmp / NOTICE).write_text(_notice(card))
        # read back through the loader every decoder uses: what was written is what was read
        back, _ = PredictorBank.load(tmp, bank.num_layers, bank.k, 0.5)
        if not all(torch.equal(getattr(back, n), getattr(bank, n)) for n in ("w1", "b1", "w2", "b2", "has")):
            raise SpeceeError(f"the bank written to {tmp} does not read back equal; nothing was replaced")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 (and the writers' 0600) are for staging only
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    print(f"imported {len(sha)} predictors from {source} into {out} (K={bank.k}, hidden {bank.w1.shape[-1]}, "
          f"{card['licence'].split(' ')[0]})")
    return str(out), card
