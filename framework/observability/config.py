"""What a run reports: the ``logging`` configuration section.

A section is a dataclass of bounded, documented fields (framework/config/fields.py); the whole
configuration assembles them in framework/config/schema.py. Imports no torch: ``--check-config``
reads these without it."""

from __future__ import annotations

from dataclasses import dataclass

from ..config.fields import Switch, bounded, option


@dataclass
class LoggingSection:
    dir: str = option("logs", resume="neutral", was="log_dir")
    """Directory for per-rank logs, TensorBoard events, the resolved config and summary.json."""
    interval: int = bounded(10, lo=1, resume="neutral", was="log_interval")
    """Log training metrics every this many steps."""
    tensorboard: bool = option(True, resume="neutral", was="tensorboard")
    """Write TensorBoard scalars from rank 0."""
    progress_bar: Switch = option("auto", resume="neutral", was="progress_bar")
    """tqdm bar on rank 0: auto shows it only when stderr is a terminal."""
    record_samples: bool = option(False, resume="neutral", was="record_samples")
    """Append each committed step's sample indices to logging.dir/samples_rank_N.jsonl (an audit trail)."""
