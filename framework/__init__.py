"""Robust PyTorch DistributedDataParallel training."""

__version__ = "0.1.0"

from .config import ConfigError, TrainConfig  # noqa: E402
from .trainer import DDPTrainer  # noqa: E402

__all__ = ["ConfigError", "DDPTrainer", "TrainConfig", "__version__"]
