"""The run configuration: schema (one dataclass per YAML section), loading, validation."""

from layers.rope import RopeScalingConfig
from models.config import ComputeConfig, ConfigError, ModelConfig
from train.config.load import from_dict, load_config, parse_override, to_dict
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
from train.config.validate import CHOICES, check_built_mesh, get, validate

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
    "from_dict",
    "get",
    "load_config",
    "parse_override",
    "to_dict",
    "validate",
]
