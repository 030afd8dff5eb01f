"""The data's configuration section (``data``): the source, the batch and its split, the loader.

A section is a dataclass of bounded, documented fields (framework/config/fields.py); the whole
configuration assembles them in framework/config/schema.py. Imports no torch: ``--check-config``
reads these without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..config.fields import AUTO, bounded, option


@dataclass
class DataSection:
    source: str = option("synthetic", resume="refused_builtin_data", was="data", used_by=("data",))
    """'synthetic' (seeded Markov chain), a .txt file (character-level) or a .bin uint16 token file."""
    synthetic_size: int = bounded(10000, lo=1, resume="refused_builtin_data", was="dataset_size",
                                 used_by=("data",))
    """Number of training sequences generated for data.source=synthetic."""
    batch_size: int = bounded(32, lo=1, resume="changes", was="batch_size")
    """Sequences per micro-batch on each rank."""
    gradient_accumulation_steps: int = bounded(1, lo=1, resume="changes", was="gradient_accumulation_steps")
    """Micro-batches per optimizer step; all but the last run under no_sync()."""
    global_batch_size: int = bounded(0, lo=0, resume="changes", was=None)
    """Samples per optimizer step on all ranks, re-split at any world size (unevenly where it does not divide, each
    rank's loss weighted by its samples); 0: batch_size x accumulation x ranks."""
    world_size_change: Literal["keep_global_batch", "scale_global_batch"] = option(
        "keep_global_batch", resume="neutral", was=None)
    """On resume at another world size: keep the checkpoint's global batch (re-split per rank), or scale it."""
    num_workers: int = bounded(AUTO, lo=0, resume="neutral", was="num_workers", auto=True)
    """DataLoader workers per rank, capped by the cores left after one per rank (min 1); auto: up to 4, 0 if none."""
    pin_memory: bool = option(True, resume="neutral", was="pin_memory")
    """Pin host memory for batches; used only on CUDA."""
    exclude_samples: str = option("", resume="neutral", was="exclude_samples")
    """A JSON file of training-sample indices left out of every epoch (e.g. a rollback's EXCLUDED_SAMPLES.json)."""
