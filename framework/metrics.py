"""Metrics sinks on rank 0: TensorBoard scalars and a tqdm progress bar."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

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
            self.writer = SummaryWriter(str(Path(log_dir) / "tensorboard"), purge_step=initial_step or None)
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
