"""Batches of any shape: a tuple ``(inputs, targets)``, a dict (the transformers convention, with
``labels`` in it), or any nest of tensors in lists, tuples and dicts.

The loss of a batch:
- a dict, no ``loss_fn``: ``model(**batch).loss`` (a transformers model computes it from ``labels``);
- a dict with ``loss_fn``: ``loss_fn(model(**batch), batch)``;
- ``(inputs, targets)``: ``loss_fn(model(inputs), targets)``, the built-in language-model loss
  when there is no ``loss_fn``;
- a ``loss_fn`` with ``calls_model = True`` runs the forward itself: ``loss_fn(model, batch,
  model_kwargs)`` (framework.hf honours a Trainer subclass's ``compute_loss`` so).
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


def batch_loss(model: torch.nn.Module, batch: Any, loss_fn: Callable | None,
               model_kwargs: dict | None = None) -> torch.Tensor:
    """The mean loss of ``batch`` under ``model`` (see the module docstring). ``model_kwargs`` go to
    the forward of a dict batch's model with the batch (transformers' ``num_items_in_batch``)."""
    if getattr(loss_fn, "calls_model", False):  # it runs the forward itself (a Trainer's compute_loss)
        return loss_fn(model, batch, model_kwargs or {})
    if isinstance(batch, Mapping):
        out = model(**batch, **(model_kwargs or {}))
        if loss_fn is not None:
            return loss_fn(out, batch)
        loss = getattr(out, "loss", None)
        if loss is None:
            raise ValueError("a dict batch without loss_fn needs a model that returns .loss (pass labels in the "
                             "batch, as transformers models expect, or give DDPTrainer a loss_fn)")
        return loss
    inputs, targets = batch
    return (loss_fn or lm_loss)(model(inputs), targets)


def label_count(batch: Any, *, shifted: bool = False) -> torch.Tensor:
    """How many labelled tokens ``batch`` holds: its ``labels`` (a dict batch) or targets (the last
    element of a tuple) that are not -100, the ignore index of cross-entropy and transformers. With
    ``shifted`` (a causal LM that shifts its labels inside), ``labels[..., 1:]``, or the batch's own
    ``shift_labels``, as transformers.Trainer counts them."""
    if isinstance(batch, Mapping):
        labels = batch.get("shift_labels") if "shift_labels" in batch else batch.get("labels")
        if shifted and "shift_labels" not in batch and isinstance(labels, torch.Tensor):
            labels = labels[..., 1:]
    else:
        labels = batch[-1]
    if not isinstance(labels, torch.Tensor):
        raise ValueError("train.loss_average=tokens|rank_tokens counts the labelled tokens of each batch: it needs "
                         "a 'labels' tensor in a dict batch, or targets last in a tuple batch")
    return (labels != -100).sum()


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
