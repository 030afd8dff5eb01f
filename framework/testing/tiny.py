"""One tiny configuration for tests, workers and rehearsals: a 1-layer, 32-wide GPT on 128 synthetic
samples that trains a step in milliseconds on one CPU thread, quietly (no TensorBoard, no loader
workers, no early stop on the loss). Build a variant with ``tiny(...)`` and overrides rather than a
dict of one's own, so that a test states only the values it depends on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY: dict[str, Any] = dict(
    vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, seq_len=16, dataset_size=128, batch_size=8,
    dropout=0.0, num_workers=0, learning_rate=3e-3, target_loss=0.0, eval_steps=2, log_interval=2,
    tensorboard=False,
)


def tiny(run_dir: str | Path | None = None, **overrides: Any) -> dict[str, Any]:
    """A fresh copy of TINY with ``overrides``; given ``run_dir``, its logs and checkpoints go to
    ``run_dir/logs`` and ``run_dir/ck`` (an override of either still wins)."""
    dirs = {} if run_dir is None else {"log_dir": str(Path(run_dir) / "logs"),
                                       "checkpoint_dir": str(Path(run_dir) / "ck")}
    return {**TINY, **dirs, **overrides}
