"""Typed, validated run configuration: a YAML file plus dotted overrides (`actor.lr=1e-5`).

`sections.py` declares every section and field (defaults, docs, per-field rules); `loading.py`
reads YAML and overrides into a Config and checks the rules across sections. Everything is
importable from here (`from sealrl.config import Config, load_config`); importing it loads no
torch.
"""
from sealrl.config.loading import build_config, check_config, config_diff, load_config, replace, resumable_keys
from sealrl.config.sections import (
                                    EMBEDDED_MODEL,
                                    LOGGERS,
                                    REWARD_BUILTINS,
                                    ActorConfig,
                                    AlgorithmConfig,
                                    Config,
                                    ConfigError,
                                    CriticConfig,
                                    DataConfig,
                                    EnvConfig,
                                    EvalConfig,
                                    LoraConfig,
                                    MissingInputError,
                                    ModelConfig,
                                    PlacementConfig,
                                    ReferenceConfig,
                                    RewardConfig,
                                    RolloutConfig,
                                    RunConfig,
                                    StoppedRun,
                                    UserError,
                                    relative_note,
                                    resumable,
)

__all__ = ["EMBEDDED_MODEL", "LOGGERS", "REWARD_BUILTINS", "ActorConfig", "AlgorithmConfig", "Config", "ConfigError",
           "CriticConfig", "DataConfig", "EnvConfig", "EvalConfig", "LoraConfig", "MissingInputError", "ModelConfig",
           "PlacementConfig", "ReferenceConfig", "RewardConfig", "RolloutConfig", "RunConfig", "StoppedRun",
           "UserError", "build_config", "check_config", "config_diff", "load_config", "relative_note", "replace",
           "resumable", "resumable_keys"]
