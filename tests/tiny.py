"""One tiny configuration for tests and their workers: a 1-layer, 32-wide GPT on 128 synthetic
samples that trains a step in milliseconds on one CPU thread, quietly (no TensorBoard, no loader
workers, no early stop on the loss). Build a variant with ``tiny(run_dir, {"train.max_steps": 4})``
rather than a dict of one's own, so that a test states only the values it depends on.

Keys are spelled one way, as users write them: dotted (``train.max_steps``), or the original API's
compact keys (``batch_size``, ``learning_rate``, ...; ``framework.config.schema.COMPACT``). A
deprecated flat spelling (``max_steps``) is refused, so that the tests use none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from framework.config.schema import ALIASES, COMPACT

TINY: dict[str, Any] = {
    "vocab_size": 32, "hidden_size": 32, "num_layers": 1, "num_heads": 2, "seq_len": 16, "dataset_size": 128,
    "batch_size": 8, "dropout": 0.0, "num_workers": 0, "learning_rate": 3e-3, "target_loss": 0.0, "log_interval": 2,
    "eval.steps": 2, "logging.tensorboard": False,
}
_COMPACT_OF = {ALIASES[key]: key for key in COMPACT}  # "data.batch_size" -> "batch_size"


def spelled(key: str) -> str:
    """``key`` as the tests spell it (a compact key's dotted form becomes the compact key); a
    deprecated flat spelling is a TypeError naming the dotted one."""
    if key in ALIASES and key not in COMPACT:
        raise TypeError(f"tiny(): {key!r} is the deprecated flat spelling; use {ALIASES[key]!r}")
    return _COMPACT_OF.get(key, key)


def tiny(run_dir: str | Path | None = None, overrides: dict[str, Any] | None = None, /,
         **keys: Any) -> dict[str, Any]:
    """A fresh copy of TINY with ``overrides`` and ``keys`` (dotted or compact keys; ``keys`` are
    written ``batch_size=4``, or ``**{"train.max_steps": 4}``); given ``run_dir``, its logs and
    checkpoints go to ``run_dir/logs`` and ``run_dir/ck`` (an override of either still wins)."""
    dirs = {} if run_dir is None else {"logging.dir": str(Path(run_dir) / "logs"),
                                       "checkpoint.dir": str(Path(run_dir) / "ck")}
    given = {key if isinstance(value, dict) else spelled(key): value  # a dict: a section's table
             for key, value in {**(overrides or {}), **keys}.items()}
    return {**TINY, **dirs, **given}


def variant(base: dict[str, Any]):
    """A ``tiny`` whose configuration starts from TINY with ``base`` (a test module's own defaults)."""
    def tiny_variant(run_dir: str | Path | None = None, overrides: dict[str, Any] | None = None, /,
                     **keys: Any) -> dict[str, Any]:
        return tiny(run_dir, {**base, **(overrides or {})}, **keys)
    return tiny_variant
