"""The run's state on disk: the ``checkpoint`` configuration section.

A section is a dataclass of bounded, documented fields (framework/config/fields.py); the whole
configuration assembles them in framework/config/schema.py. Imports no torch: ``--check-config``
reads these without it."""

from __future__ import annotations

from dataclasses import dataclass

from ..config.fields import bounded, option


@dataclass
class CheckpointSection:
    dir: str = option("checkpoints", resume="neutral", was="checkpoint_dir")
    """Directory for checkpoints and the final model."""
    every_steps: int = bounded(0, lo=0, resume="neutral", was="save_every_steps")
    """Save a checkpoint every this many optimizer steps; 0 disables step checkpoints."""
    every_epochs: int = bounded(5, lo=0, resume="neutral", was="save_interval")
    """Save a checkpoint every this many epochs; 0 disables epoch checkpoints."""
    every_minutes: float = bounded(10.0, lo=0.0, resume="neutral", was=None)
    """Save a checkpoint once this many minutes of training have passed since the last save (rank 0's
    clock, agreed at the step); 0 disables timed checkpoints."""
    keep_last: int = bounded(3, lo=1, resume="neutral", was="keep_last")
    """Number of checkpoints kept in checkpoint.dir (older ones are deleted)."""
    resume: str = option("auto", resume="neutral", was="resume")
    """auto = the newest valid checkpoint in checkpoint.dir, none = start fresh, or a checkpoint file."""
    export_dir: str = option("", resume="neutral", was="export_dir")
    """Where a finished run exports its final weights as safetensors: '' = checkpoint.dir/export; none = no export."""
    save_on_peer_loss: bool = option(True, resume="neutral", was=None)
    """When a peer process goes away mid-step (killed, or its node lost), a surviving rank saves the last
    step every rank finished, alone, so that the restart redoes no step."""
