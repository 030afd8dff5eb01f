"""The DDP wrapper's configuration sections: ``ddp`` and ``compile``.

A section is a dataclass of bounded, documented fields (framework/config/fields.py); the whole
configuration assembles them in framework/config/schema.py. Imports no torch: ``--check-config``
reads these without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..config.fields import Switch, bounded, option


@dataclass
class DDPSection:
    backend: Literal["auto", "gloo", "nccl"] = option("auto", resume="neutral", was="backend")
    """Process-group backend: auto = nccl with CUDA, else gloo; nccl under torchrun makes a group even for 1 process."""
    timeout_s: float = bounded(600.0, lo=1.0, hi=86400.0, resume="neutral", was="timeout_s")
    """Timeout in seconds for every collective (and, unless init_timeout_s is set, process-group init)."""
    init_timeout_s: float = bounded(0.0, lo=0.0, hi=86400.0, resume="neutral", was="init_timeout_s")
    """Timeout for process-group init and everything up to the first step's end (then timeout_s); 0 = timeout_s."""
    static_graph: Switch = option("auto", resume="neutral", was="ddp_static_graph")
    """DDP static_graph; auto decides from a preflight probe of the model (env DDP_STATIC_GRAPH=0|1)."""
    find_unused_parameters: Switch = option("auto", resume="neutral", was="find_unused_parameters")
    """DDP find_unused_parameters; auto decides from the preflight probe (env DDP_FIND_UNUSED_PARAMETERS=0|1)."""
    bucket_cap_mb: float = bounded(25.0, lo=0.0, resume="neutral", was="bucket_cap_mb")
    """DDP gradient bucket size in MiB."""
    gradient_as_bucket_view: bool = option(False, resume="neutral", was="gradient_as_bucket_view")
    """Let gradients alias DDP's communication buckets (saves one copy of the gradients)."""
    broadcast_buffers: bool = option(True, resume="changes", was="broadcast_buffers")
    """Broadcast module buffers from rank 0 at every forward."""
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = option("none", resume="changes", was="ddp_comm_hook")
    """All-reduce: none = fp32, fp16/bf16 = 16-bit (gloo or NCCL), powersgd = low-rank (docs/performance.md)"""
    powersgd_rank: int = bounded(1, lo=1, hi=1024, resume="changes", was="powersgd_rank")
    """PowerSGD's matrix approximation rank (1 = strongest compression; try 2, 4, ... if the loss suffers)."""
    powersgd_start_iter: int = bounded(1000, lo=2, resume="changes", was="powersgd_start_iter")
    """PowerSGD runs plain all-reduce for this many synced backward passes (optimizer steps) first; at least 2."""


@dataclass
class CompileSection:
    enabled: bool = option(False, resume="neutral", was="compile")
    """torch.compile the model after the DDP preflight and wrapping (DDP's graph split at bucket boundaries)."""
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = option(
        "default", resume="neutral", was="compile_mode")
    """torch.compile mode."""
    backend: Literal["inductor", "aot_eager", "eager"] = option("inductor", resume="neutral", was="compile_backend")
    """torch.compile backend: inductor generates kernels (needs a C compiler on CPU); aot_eager only traces."""
