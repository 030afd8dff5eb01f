"""Drop-ins for ``transformers.Trainer`` and TRL's ``SFTTrainer``: change the import
(docs/huggingface.md).

    from framework.hf import Trainer                    # was: from transformers import Trainer
    from framework.hf import SFTConfig, SFTTrainer      # was: from trl import SFTConfig, SFTTrainer

Importing this package under torchrun joins the process group with the framework's restart-safe
store, before anything else can: ``TrainingArguments()`` initialises the group itself (through
accelerate) with ``env://``, which reads a dead restart's addresses after an in-place restart
and fails with gloo's "connectFullMesh failed ... Connection refused". accelerate reuses a group
that exists. Import it before building TrainingArguments.

A script's own ``torch.distributed.init_process_group(...)`` after the import (as the Kaggle
guide's scripts do) then finds the group joined and returns: one line says so. Its
``destroy_process_group()`` at the end is the framework's teardown, which frees the group safely
while a DDP wrapper of the script's still holds it. A ConfigError that
the script does not catch ends it with its lines and exit 2, without a traceback."""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

from ..config.schema import ConfigError
from ..ddp import process_group
from .trainer import Trainer

log = logging.getLogger(__name__)

process_group.join_early()

_init_process_group = dist.init_process_group


def init_process_group(*args, **kwargs):
    """torch.distributed.init_process_group, except when framework.hf has joined the group already:
    then the script's call is a no-op (its backend and addresses would be a dead restart's after
    an in-place restart)."""
    if dist.is_initialized() and process_group.STORE is not None:
        log.info("init_process_group: the process group is already joined by framework.hf (restart-safe); "
                 "this call returns it as it is")
        return None
    return _init_process_group(*args, **kwargs)


dist.init_process_group = init_process_group


def destroy_process_group(group=None) -> None:
    """torch.distributed.destroy_process_group, except for the group framework.hf joined: the
    framework's teardown, which first has every DDP module let go of it (a script's own DDP
    wrapper freed after the group hangs at exit; see process_group.release_ddp_holders)."""
    if group is None and dist.is_initialized() and process_group.STORE is not None:
        process_group.teardown()
        return
    dist.distributed_c10d.destroy_process_group(group)


dist.destroy_process_group = destroy_process_group

_excepthook = sys.excepthook


def _config_error_exits_2(kind, value, traceback) -> None:
    if not isinstance(value, ConfigError):
        _excepthook(kind, value, traceback)
        return
    for problem in value.problems:
        print(f"error: {problem}", file=sys.stderr)
    sys.stderr.flush()
    process_group.teardown()
    import os

    os._exit(2)


sys.excepthook = _config_error_exits_2


def __getattr__(name: str):
    """SFTConfig and SFTTrainer, imported with TRL on first use (pip install -e .[trl])."""
    if name == "SFTConfig":
        from trl import SFTConfig
        return SFTConfig
    if name == "SFTTrainer":
        from .sft import SFTTrainer
        return SFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SFTConfig", "SFTTrainer", "Trainer", "destroy_process_group", "init_process_group"]
