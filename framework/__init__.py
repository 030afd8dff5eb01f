"""Robust PyTorch DistributedDataParallel training.

The trainer is imported on first use, so that ``ddp_training.py --check-config`` and ``--help``
validate a configuration without importing torch.
"""

__version__ = "0.1.0"

from .config import ConfigError, TrainConfig  # noqa: E402

__all__ = ["ConfigError", "DDPTrainer", "TrainConfig", "__version__"]


def __getattr__(name: str):
    if name == "DDPTrainer":
        from .trainer import DDPTrainer
        return DDPTrainer
    raise AttributeError(f"module 'framework' has no attribute {name!r}")
