"""The run configuration: schema (one dataclass per YAML section), loading, validation."""

from layers.rope import RopeScalingConfig
from models.config import ComputeConfig, ConfigError, ModelConfig
from train.config.load import from_dict, load_config, to_dict, warn_repeated
from train.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    MeshConfig,
    MixtureComponent,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
)
from train.config.validate import CHOICES, check_built_mesh, check_positions, validate

__all__ = [
    "CHOICES",
    "CheckpointConfig",
    "ComputeConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "MeshConfig",
    "MixtureComponent",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RopeScalingConfig",
    "TrainConfig",
    "check_built_mesh",
    "check_positions",
    "from_dict",
    "load_config",
    "to_dict",
    "validate",
    "warn_repeated",
]
