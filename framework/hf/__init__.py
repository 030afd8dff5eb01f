"""A drop-in for ``transformers.Trainer``: change ``from transformers import Trainer`` to
``from framework.hf import Trainer`` (docs/huggingface.md).

Importing this package under torchrun joins the process group with the framework's restart-safe
store, before anything else can: ``TrainingArguments()`` initialises the group itself (through
accelerate) with ``env://``, which reads a dead incarnation's addresses after an in-place restart
and fails with gloo's "connectFullMesh failed ... Connection refused". accelerate reuses a group
that exists. Import it before building TrainingArguments."""

from __future__ import annotations

from ..ddp import process_group
from .trainer import Trainer

process_group.join_early()

__all__ = ["Trainer"]
