"""Keeping a run alive: the ``recovery``, ``straggler`` and ``spike`` configuration sections.

A section is a dataclass of bounded, documented fields (framework/config/fields.py); the whole
configuration assembles them in framework/config/schema.py. Imports no torch: ``--check-config``
reads these without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..config.fields import Switch, bounded, option


@dataclass
class RecoverySection:
    max_errors_per_epoch: int = bounded(5, lo=0, resume="neutral", was="max_errors_per_epoch")
    """Skipped (non-finite) steps allowed per epoch before the run aborts."""
    agree_nonfinite: bool = option(True, resume="changes", was="agree_nonfinite")
    """Skip a step on every rank when any rank sees a non-finite loss or gradient (false: each rank alone)."""
    consistency_check_interval: int = bounded(100, lo=0, resume="neutral", was="consistency_check_interval")
    """Check every this many steps that all ranks hold bit-identical parameters; 0 disables."""
    step_timeout_s: float = bounded(600.0, lo=0.0, hi=86400.0, resume="neutral", was="step_timeout_s")
    """Hang watchdog: a step may take max(this, step_timeout_factor x median step time); 0 disables."""
    step_timeout_factor: float = bounded(10.0, lo=1.0, hi=1000.0, resume="neutral", was="step_timeout_factor")
    """Hang watchdog: multiple of the median step time allowed for one step."""
    max_loader_restarts: int = bounded(3, lo=0, resume="neutral", was="max_loader_restarts")
    """DataLoader rebuilds allowed per epoch after a worker died or timed out."""
    oom: Switch = option("auto", resume="neutral", was="oom_recovery")
    """On out-of-memory, halve the micro-batch and double accumulation; auto = on with CUDA."""
    peer_timeout_s: float = bounded(10.0, lo=0.0, hi=86400.0, resume="neutral", was=None)
    """A peer silent this long (frozen, or cut off: no heartbeat) ends the restart with exit 75 at once,
    not after ddp.timeout_s; 0 disables."""
    heal: Literal["restart", "in_place"] = option("restart", resume="neutral", was=None)
    """After a peer is lost mid-step: restart every process from a checkpoint, or in_place: the survivors
    re-form the group in their processes and go on from the state they hold (docs/fault-tolerance.md)."""
    max_no_progress_restarts: int = bounded(3, lo=1, resume="neutral", was="max_no_progress_restarts")
    """Elastic restarts in a row that resume from the same checkpoint step before the run stops with FATAL."""
    fault_inject: str = option("", resume="neutral", was="fault_inject")
    """Faults to rehearse, e.g. 'nan@step=5,rank=1; sigterm@step=8' (docs/run-health.md); empty = none."""


@dataclass
class StragglerSection:
    interval: int = bounded(50, lo=0, resume="neutral", was="straggler_interval")
    """Share every rank's section timings every this many steps (one small all-gather); 0 = off."""
    threshold: float = bounded(1.3, lo=1.0, resume="neutral", was="straggler_threshold")
    """A rank this many times slower than the fastest in a section (and straggler.min_ms more) is slow."""
    min_ms: float = bounded(5.0, lo=0.0, resume="neutral", was="straggler_min_ms")
    """A rank must also be this many ms slower than the fastest: sub-millisecond noise never counts."""
    patience: int = bounded(2, lo=1, resume="neutral", was="straggler_patience")
    """Checks in a row a rank must be slow before it is named."""
    action: Literal["warn", "fatal"] = option("warn", resume="neutral", was="straggler_action")
    """warn names a persistent straggler in a WARNING; fatal stops the run with FATAL naming it."""


@dataclass
class SpikeSection:
    guard: Literal["off", "warn", "rollback"] = option("warn", resume="neutral", was="spike_guard")
    """Loss-spike guard: warn logs a spike; rollback returns to the checkpoint before it and excludes its samples."""
    threshold: float = bounded(6.0, lo=1.0, resume="neutral", was="spike_threshold")
    """A spike: the loss this many deviations above the trend of the last spike.window steps."""
    warmup: int = bounded(50, lo=0, resume="neutral", was="spike_warmup")
    """Steps observed before the guard judges (the early loss falls too fast for a trend)."""
    window: int = bounded(50, lo=3, resume="neutral", was="spike_window")
    """Steps in the window the trend and its deviation are fitted to."""
    max_rollbacks: int = bounded(3, lo=0, resume="neutral", was="max_rollbacks")
    """Rollbacks allowed in a run; one more stops it with FATAL naming the steps and samples."""
    lr_cooldown: int = bounded(0, lo=0, resume="neutral", was="spike_lr_cooldown")
    """After a rollback, ramp the learning rate back up linearly over this many steps; 0 = off."""
