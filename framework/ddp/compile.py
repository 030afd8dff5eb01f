"""torch.compile of the model that trains: after the DDP preflight, which probes the eager model,
and after wrapping, so that TorchDynamo's DDPOptimizer splits the graph at DDP's bucket
boundaries and each bucket's all-reduce still overlaps the rest of the backward.

The checkpoint, the export and the model fingerprint use the unwrapped, uncompiled model, so a
compiled run's checkpoint loads into an uncompiled run and back. Evaluation runs the eager model.
A micro-batch halved after an out-of-memory error changes the input shape: Dynamo recompiles once
(and marks the batch dimension dynamic from then on). An injected OOM (fault_inject oom@) adds a
forward hook that an already compiled graph would not see, so that one micro-step runs eagerly.
"""

from __future__ import annotations

import logging

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

log = logging.getLogger(__name__)


def compile_model(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """``model`` compiled as ``cfg`` (the compile section) says, or itself."""
    if not cfg.enabled:
        return model
    mode = None if cfg.mode == "default" else cfg.mode
    log.info("torch.compile: backend %s, mode %s, DDP graph splitting at bucket boundaries %s", cfg.backend,
             cfg.mode, "on" if isinstance(model, DDP) and torch._dynamo.config.optimize_ddp else "n/a")
    return torch.compile(model, backend=cfg.backend, mode=mode)


def is_ddp(model: torch.nn.Module) -> bool:
    """Whether ``model`` is DDP, compiled or not."""
    return isinstance(getattr(model, "_orig_mod", model), DDP)


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without its torch.compile wrapper (DDP stays), for a micro-step that must run eagerly."""
    return getattr(model, "_orig_mod", model)
