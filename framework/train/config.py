"""The training step's configuration sections: ``optim``, ``train``, ``precision`` and ``eval``.

A section is a dataclass of bounded, documented fields (framework/config/fields.py); the whole
configuration assembles them in framework/config/schema.py. Imports no torch: ``--check-config``
reads these without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..config.fields import Switch, bounded, option


@dataclass
class OptimSection:
    lr: float = bounded(1e-4, lo=0.0, resume="changes", was="learning_rate")
    """Peak AdamW learning rate."""
    min_lr: float = bounded(0.0, lo=0.0, resume="changes", was="min_lr")
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = bounded(0, lo=0, resume="changes", was="warmup_steps")
    """Linear warmup steps from 0 to optim.lr."""
    beta1: float = bounded(0.9, lo=0.0, hi=0.999999, resume="changes", was="beta1")
    """AdamW beta1."""
    beta2: float = bounded(0.95, lo=0.0, hi=0.999999, resume="changes", was="beta2")
    """AdamW beta2."""
    weight_decay: float = bounded(0.01, lo=0.0, resume="changes", was="weight_decay")
    """AdamW weight decay, applied to matrices only (not biases, norms or embeddings' positions)."""
    impl: Literal["auto", "fused", "foreach", "for_loop"] = option("auto", resume="changes", was="optimizer_impl")
    """The built-in AdamW's kernels: auto = fused (one kernel for all parameters; CPU, CUDA), foreach, for_loop."""
    grad_clip: float = bounded(1.0, lo=0.0, resume="changes", was="grad_clip")
    """Clip the global gradient norm to this value; 0 disables clipping."""


@dataclass
class TrainSection:
    num_epochs: int = bounded(10, lo=1, resume="neutral", was="num_epochs")
    """Passes over the training set (an upper bound when max_steps is set)."""
    max_steps: int = bounded(0, lo=0, resume="neutral", was="max_steps")
    """Stop after this many optimizer steps; 0 means num_epochs decides."""
    target_loss: float = bounded(0.01, lo=0.0, resume="neutral", was="target_loss")
    """Stop once the all-reduced training loss is at or below this; 0 disables."""
    seed: int = bounded(1337, lo=0, hi=2**63 - 1, resume="refused", was="seed")
    """Seed for model init, data order and dropout."""
    deterministic: bool = option(False, resume="changes", was="deterministic")
    """Use deterministic kernels only (bit-reproducible runs, slower on CUDA)."""
    loss_average: Literal["micro_batch", "tokens", "rank_tokens"] = option("micro_batch", resume="changes", was=None)
    """How a step's loss averages: micro_batch = each micro-batch's mean, averaged; tokens = every labelled
    token (label != -100) of the global batch weighs the same (transformers' average_tokens_across_devices);
    rank_tokens = each rank's tokens weigh the same, then the ranks are averaged."""


@dataclass
class PrecisionSection:
    autocast: Switch = option("auto", resume="changes", was="use_amp")
    """Autocast: auto = on for CUDA, off (fp32) on CPU; true forces it, false disables it."""
    dtype: Literal["bf16", "fp16"] = option("bf16", resume="changes", was="amp_dtype")
    """Autocast dtype; fp16 adds a GradScaler and needs CUDA."""


@dataclass
class EvalSection:
    interval: int = bounded(500, lo=0, resume="neutral", was="eval_interval")
    """Evaluate every this many steps (and at the end); 0 evaluates only at the end."""
    steps: int = bounded(20, lo=0, resume="neutral", was="eval_steps")
    """Validation batches per evaluation (the same global prefix of the validation set on any world size); 0 = all."""
