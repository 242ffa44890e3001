"""Run configuration: the schema (one frozen dataclass per section), its checks, and loading/writing."""

from alignrl.config.checks import check_combinations, check_ranges, check_world_size
from alignrl.config.folders import check_folders
from alignrl.config.load import keys_given, load_config, reference_markdown, to_yaml
from alignrl.config.schema import (ActorConfig, AgentConfig, AlgorithmConfig, ConfigError, CriticConfig, DataConfig, ModelConfig,
                                   PipelineConfig, RetrieverConfig, RolloutConfig, RunConfig, SafetyConfig, ServicesConfig,
                                   TrainerConfig, opt)

__all__ = ["ActorConfig", "AgentConfig", "AlgorithmConfig", "ConfigError", "CriticConfig", "DataConfig", "ModelConfig",
           "PipelineConfig", "RetrieverConfig", "RolloutConfig", "RunConfig", "SafetyConfig", "ServicesConfig", "TrainerConfig",
           "check_combinations", "check_folders", "check_ranges", "check_world_size", "keys_given", "load_config", "opt",
           "reference_markdown", "to_yaml"]
