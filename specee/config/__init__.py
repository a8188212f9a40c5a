"""Structured configs, one module per job:

- ``schemas``: one dataclass per config group, and what each experiment recipe needs (``facts``);
- ``store``: registration in Hydra's ConfigStore;
- ``checks``: the generic engine (every field against its declared range and allowed values) and
  the discovery of each group's options;
- ``rules``: the rules across groups.
"""
from specee.config.checks import (CHOICES, FLOAT_MAX, INT_MAX, LIMITS, Options, Pattern, check_choices,
                                  check_declared_keys, check_fields, option_schema, options)
from specee.config.rules import check_exit_layer_text, validate
from specee.config.schemas import (SCHEMAS, AblationConfig, AccuracyExperiment, CalibrationConfig, CollectExperiment,
                                   Config, DatasetConfig, DraftConfig, DraftVocabExperiment, EarlyExitConfig,
                                   FetchExperiment, ModelConfig, PathsConfig, PlacementConfig, PotentialExperiment,
                                   ProfileExitsExperiment, Recipe, ReportExperiment, ReproduceExperiment,
                                   RuntimeConfig, SpeedExperiment, StatsExperiment, TrainBaseExperiment,
                                   TrainDraftExperiment, TrainPredictorsExperiment, recipe, recipe_name)
from specee.config.store import register, safe_dirname

__all__ = ["CHOICES", "FLOAT_MAX", "INT_MAX", "LIMITS", "Options", "Pattern", "check_choices", "check_declared_keys",
           "check_fields", "option_schema", "options", "check_exit_layer_text", "validate", "SCHEMAS",
           "AblationConfig", "AccuracyExperiment", "CalibrationConfig", "CollectExperiment", "Config",
           "DatasetConfig", "DraftConfig", "DraftVocabExperiment", "EarlyExitConfig", "FetchExperiment",
           "ModelConfig", "PathsConfig", "PlacementConfig", "PotentialExperiment", "ProfileExitsExperiment",
           "Recipe", "ReportExperiment", "ReproduceExperiment", "RuntimeConfig", "SpeedExperiment",
           "StatsExperiment", "TrainBaseExperiment", "TrainDraftExperiment", "TrainPredictorsExperiment",
           "recipe", "recipe_name", "register", "safe_dirname"]
