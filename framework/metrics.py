"""Metrics sinks on rank 0: TensorBoard scalars and a tqdm progress bar."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from pathlib import Path

import torch

from . import __version__
from .checkpoint import atomic_write_bytes
from .config import as_dict
from .memory import in_use_gb, memory_stats

log = logging.getLogger(__name__)


class Metrics:
    """Writes scalars to TensorBoard and drives the progress bar, on rank 0 only."""

    def __init__(self, *, enabled: bool, log_dir: str | Path, tensorboard: bool, progress_bar: str,
                 total_steps: int, initial_step: int = 0):
        self.writer = None
        self.bar = None
        if not enabled:
            return
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # A resumed run purges what an earlier incarnation logged after its checkpoint.
            self.writer = SummaryWriter(str(Path(log_dir) / "tensorboard"),
                                        purge_step=initial_step + 1 if initial_step else None)
        show = progress_bar == "true" or (progress_bar == "auto" and sys.stderr.isatty())
        if show:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)

    def progress(self, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class StepLog:
    """Per-step bookkeeping of a run: the latest losses, throughput, and the periodic log lines,
    TensorBoard scalars and memory readings."""

    def __init__(self, trainer, metrics: Metrics):
        self.trainer = trainer
        self.metrics = metrics
        self.first_loss: float | None = None
        self.loss: float | None = None
        self.val_loss: float | None = None
        self.tokens = 0
        self.start = self.window_start = time.perf_counter()
        self.window_tokens = 0

    def record(self, loss: float, lr: float, grad_norm, tokens: int) -> None:
        t, cfg = self.trainer, self.trainer.cfg
        self.loss = loss
        self.first_loss = loss if self.first_loss is None else self.first_loss
        self.tokens += tokens
        self.window_tokens += tokens
        self.metrics.progress(loss)
        log.debug("step %d: loss %.6f lr %.3e micro-batch %d x %d", t.step, loss, lr, t.sampler.batch_size,
                  t.sampler.accumulation)
        if t.step % cfg.log_interval == 0:
            now = time.perf_counter()
            tps = self.window_tokens / (now - self.window_start)
            norm = float(grad_norm)
            log.info("step %d/%d | epoch %d | loss %.4f | lr %.3e | grad_norm %.3f | %.0f tok/s",
                     t.step, t.total_steps, t.sampler.epoch, loss, lr, norm, tps)
            self.metrics.scalars(t.step, {"train/loss": loss, "train/lr": lr, "train/grad_norm": norm,
                                          "train/tokens_per_sec": tps})
            self.window_start, self.window_tokens = now, 0
        if t.step % cfg.memory_check_interval == 0:
            stats = memory_stats(t.env.device)
            log.info("memory: %s", ", ".join(f"{k} {v:.2f}" for k, v in stats.items()))
            self.metrics.scalars(t.step, {f"memory/{k}": v for k, v in stats.items()})
            if in_use_gb(stats) > cfg.max_memory_gb:
                log.warning("memory in use %.2f GiB exceeds max_memory_gb=%g", in_use_gb(stats), cfg.max_memory_gb)

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (evaluation) does not count as training time for tokens/s."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self.start += spent
            self.window_start += spent

    def wall_s(self) -> float:
        return time.perf_counter() - self.start

    def tokens_per_sec(self) -> float:
        wall = self.wall_s()
        return self.tokens / wall if wall > 0 else 0.0


def log_run_start(trainer) -> None:
    """The run's opening lines: versions and config, model, effective batch, each rank's share,
    schedule; rank 0 also saves the resolved config as log_dir/config.json."""
    cfg, env, s = trainer.cfg, trainer.env, trainer.sampler
    log.info("framework %s, torch %s, config: %s", __version__, torch.__version__,
             json.dumps(as_dict(cfg), sort_keys=True))
    log.info("model: %s, %.2fM parameters, amp=%s", type(trainer.raw_model).__name__,
             sum(p.numel() for p in trainer.raw_model.parameters()) / 1e6,
             f"on ({cfg.amp_dtype})" if trainer.amp else "off (fp32)")
    log.info("effective batch: %d per rank x %d ranks x %d accumulation = %d samples per step",
             s.batch_size, env.world_size, s.accumulation, s.global_batch)
    log.info("rank %d share: %d steps/epoch x %d samples = %d of %d samples per epoch; %d loader workers",
             env.rank, s.steps_per_epoch, s.batch_size * s.accumulation,
             s.steps_per_epoch * s.batch_size * s.accumulation, s.num_samples, trainer.num_workers)
    log.info("schedule: %d steps (%d per epoch, num_epochs=%d, max_steps=%d)", trainer.total_steps,
             s.steps_per_epoch, cfg.num_epochs, cfg.max_steps)
    if env.is_main:
        atomic_write_bytes(Path(cfg.log_dir) / "config.json",
                           json.dumps(as_dict(cfg), indent=2, sort_keys=True).encode())
