"""Structured configs: one dataclass per config group, registered in Hydra's ConfigStore.

Each YAML option in ``conf/<group>/`` starts from its schema (``defaults: [<schema>, _self_]``),
so an unknown key or a wrongly typed value fails at compose time, and Hydra itself refuses an
unknown option (``model=foo``) listing the valid choices. Cross-group rules that a single
schema cannot express live in :func:`validate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from specee.errors import SpeceeError


@dataclass
class ModelConfig:
    name: str = MISSING
    # Local directory with a Hugging Face checkpoint (config.json + weights + tokenizer).
    path: Optional[str] = None
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N | auto (device_map="auto", multi-GPU)
    # Only with allow_hub=true may `path` be a hub id; the default refuses any download.
    allow_hub: bool = False
    chat_template: str = "plain"  # plain | llama2_chat | vicuna
    trust_remote_code: bool = False


@dataclass
class AblationConfig:
    name: str = MISSING
    mode: str = "dense"  # dense (more modes arrive with the early-exit issues)


@dataclass
class DatasetConfig:
    name: str = MISSING
    source: str = "spec_bench"
    categories: Optional[list[str]] = None
    count: int = 2  # prompts per category
    offset: int = 0
    max_new_tokens: int = 64


@dataclass
class SpeedExperiment:
    _target_: str = "experiments.speed.run"
    warmup: int = 1
    repeats: int = 1
    compare_hf_generate: bool = True


@dataclass
class TrainBaseExperiment:
    _target_: str = "experiments.train_base.run"
    out_dir: str = "${paths.artifacts}/tiny"
    vocab_size: int = 8192
    hidden_size: int = 192
    intermediate_size: int = 512
    num_layers: int = 24
    num_heads: int = 6
    num_kv_heads: int = 2
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 2200
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    tinystories_share: float = 0.5  # share of training sequences drawn from TinyStories
    eval_every: int = 250
    eval_stories: int = 100  # validation stories during training
    final_eval_stories: int = 500
    max_minutes: Optional[float] = None  # stop early (and say so in the card) after this long
    save_dtype: str = "bfloat16"


@dataclass
class PathsConfig:
    # Relative paths resolve against the project root (the folder holding run.py).
    data_root: str = "${oc.env:SPECEE_DATA_ROOT,../shared/data}"
    artifacts: str = "specee/artifacts"


@dataclass
class Config:
    model: Any = MISSING
    ablation: Any = MISSING
    dataset: Any = MISSING
    experiment: Any = MISSING
    paths: PathsConfig = field(default_factory=PathsConfig)
    seed: int = 0
    threads: Optional[int] = None  # torch intra-op threads; None = torch default
    force: bool = False  # rerun even when results.json already exists


SCHEMAS = {
    ("model", "model_schema"): ModelConfig,
    ("ablation", "ablation_schema"): AblationConfig,
    ("dataset", "dataset_schema"): DatasetConfig,
    ("experiment", "speed_schema"): SpeedExperiment,
    ("experiment", "train_base_schema"): TrainBaseExperiment,
}


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for (group, name), node in SCHEMAS.items():
        cs.store(group=group, name=name, node=node)


def validate(cfg) -> None:
    """Rules across groups; each message says what to change."""
    if cfg.model.chat_template not in ("plain", "llama2_chat", "vicuna"):
        raise SpeceeError(
            f"model.chat_template={cfg.model.chat_template!r} is unknown; valid: plain, llama2_chat, vicuna"
        )
    if cfg.model.dtype not in ("float32", "bfloat16", "float16"):
        raise SpeceeError(f"model.dtype={cfg.model.dtype!r} is unknown; valid: float32, bfloat16, float16")
    if cfg.ablation.mode not in ("dense",):
        raise SpeceeError(f"ablation.mode={cfg.ablation.mode!r} is unknown; valid: dense")
