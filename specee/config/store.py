"""Hydra registration: the schemas in Hydra's ConfigStore, and the resolver that names sweep folders."""
from __future__ import annotations

import hashlib

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from specee.config.schemas import SCHEMAS, Config

_MAX_DIRNAME_BYTES = 200  # file systems cap one name at 255 bytes


def safe_dirname(name: str) -> str:
    """A sweep job's folder name from its overrides, kept inside the sweep folder: path
    separators become '%2F' and a leading dot is escaped, so no override value walks out.
    A name too long for the file system (long path overrides) keeps its start and ends in a
    hash of the whole, so it stays unique and the same on a rerun (skip-if-done)."""
    name = str(name).replace("\\", "%5C").replace("/", "%2F")
    name = "%2E" + name[1:] if name.startswith(".") else name or "_"
    if len(name.encode()) > _MAX_DIRNAME_BYTES:
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        head = name.encode()[:_MAX_DIRNAME_BYTES - 18].decode(errors="ignore")
        name = f"{head}~{digest}"
    return name


def register() -> None:
    if not OmegaConf.has_resolver("specee_dirname"):
        OmegaConf.register_new_resolver("specee_dirname", safe_dirname)
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for (group, name), node in SCHEMAS.items():
        cs.store(group=group, name=name, node=node)
