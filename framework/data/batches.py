"""Batches of any shape: a tuple ``(inputs, targets)``, a dict (the transformers convention, with
``labels`` in it), or any nest of tensors in lists, tuples and dicts.

The loss of a batch:
- a dict, no ``loss_fn``: ``model(**batch).loss`` (a transformers model computes it from ``labels``);
- a dict with ``loss_fn``: ``loss_fn(model(**batch), batch)``;
- ``(inputs, targets)``: ``loss_fn(model(inputs), targets)``, the built-in language-model loss
  when there is no ``loss_fn``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch.utils.data import Dataset, default_collate

from ..model.gpt import lm_loss


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it moved to ``device``, the nest otherwise unchanged."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def batch_loss(model: torch.nn.Module, batch: Any, loss_fn: Callable | None) -> torch.Tensor:
    """The mean loss of ``batch`` under ``model`` (see the module docstring)."""
    if isinstance(batch, Mapping):
        out = model(**batch)
        if loss_fn is not None:
            return loss_fn(out, batch)
        loss = getattr(out, "loss", None)
        if loss is None:
            raise ValueError("a dict batch without loss_fn needs a model that returns .loss (pass labels in the "
                             "batch, as transformers models expect, or give DDPTrainer a loss_fn)")
        return loss
    inputs, targets = batch
    return (loss_fn or lm_loss)(model(inputs), targets)


def _first_tensor(batch: Any) -> torch.Tensor:
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"]
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def num_tokens(batch: Any) -> int:
    """Tokens in ``batch`` for tokens/s: the elements of ``input_ids``, else of the first tensor."""
    tensor = _first_tensor(batch)
    return 0 if tensor is None else tensor.numel()


def num_samples(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of ``input_ids``, else of the first tensor."""
    tensor = _first_tensor(batch)
    return 0 if tensor is None or tensor.dim() == 0 else tensor.shape[0]


def fetch(dataset: Dataset, indices: list[int]):
    """One batch read directly (no worker processes), as the loader would collate it."""
    if hasattr(dataset, "__getitems__"):
        return dataset.__getitems__(indices)
    return default_collate([dataset[i] for i in indices])
