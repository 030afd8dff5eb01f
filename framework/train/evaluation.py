"""Validation loss, computed by every rank on its own unpadded shard and all-reduced. A
preemption request stops an evaluation at the next batch, at the same batch on every rank."""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist

from .config import EvalSection
from ..data.batches import batch_loss, fetch, num_samples, to_device
from ..data.sampler import eval_indices
from .agreement import agree
from .events import EventBus

log = logging.getLogger(__name__)


class Interrupted(Exception):
    """An evaluation stopped, by every rank at the same batch, because one of them was asked to."""

    def __init__(self, batch: int, batches: int):
        super().__init__(f"stopped before batch {batch + 1} of {batches}")
        self.batch = batch


@torch.no_grad()
def validation_loss(model, dataset, loss_fn, *, limit: int, batch_size: int, rank: int, world_size: int,
                    device: torch.device, autocast, distributed: bool,
                    stop: Callable[[], bool] | None = None) -> float | None:
    """Mean loss over the first ``limit`` samples of ``dataset``. Each rank takes an unpadded
    shard; sums and counts are all-reduced in float64, so the result is exact for any world size.
    With ``stop``, the ranks agree before each batch whether ``stop()`` is true on any of them,
    and raise Interrupted together if so."""
    if dataset is None or len(dataset) == 0:
        return None
    indices = eval_indices(len(dataset), limit, world_size, rank)
    # Every rank runs as many rounds as rank 0's shard (the largest) has batches: one agreement each.
    rounds = -(-len(eval_indices(len(dataset), limit, world_size, 0)) // batch_size)
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for i, lo in enumerate(range(0, rounds * batch_size, batch_size)):
        if stop is not None and _agreed(stop, device=device, world_size=world_size, distributed=distributed):
            raise Interrupted(i, rounds)
        if lo >= len(indices):
            continue
        batch = to_device(fetch(dataset, indices[lo:lo + batch_size]), device)
        with autocast():
            loss = batch_loss(model, batch, loss_fn)
        n = num_samples(batch)
        sums[0] += loss.double() * n
        sums[1] += n
    if distributed:
        dist.all_reduce(sums)
    total, count = sums.tolist()
    return total / count


def _agreed(stop: Callable[[], bool], *, device: torch.device, world_size: int, distributed: bool) -> bool:
    """Whether ``stop()`` is true on any rank (on one process: no collective, no device sync)."""
    if not distributed:
        return stop()
    return agree(loss=torch.zeros((), device=device), world_size=world_size, distributed=True,
                 preempt=stop()).preempt


class Evaluator:
    """The validation loss every ``eval_interval`` steps (0: only at the end), on every rank."""

    Config = EvalSection  # the configuration's ``eval`` section, its first argument

    def __init__(self, section, *, model: torch.nn.Module, dataset, loss_fn, batch_size: int, env, autocast, sampler,
                 events: EventBus | None = None):
        """``section``: the configuration's eval section; ``batch_size``: data.batch_size (eval.steps counts
        batches of it)."""
        self.model, self.dataset, self.loss_fn = model, dataset, loss_fn
        self.events = events or EventBus()
        self.interval = section.interval
        whole = len(dataset) if dataset is not None else 0
        self.limit = section.steps * batch_size if section.steps else whole
        self.sampler = sampler  # its micro-batch, which an out-of-memory error may have halved
        self.env, self.autocast = env, autocast
        self.interrupted = False  # the last run stopped at a preemption request

    def should_run(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    @property
    def batches(self) -> int:
        """This rank's batches per evaluation (the watchdog's first deadline is scaled by it)."""
        size = len(self.dataset) if self.dataset is not None else 0
        per_rank = -(-min(size, self.limit) // self.env.world_size)
        return max(1, -(-per_rank // self.sampler.batch_size))

    def run(self, step: int, stop: Callable[[], bool] | None = None) -> float | None:
        """Mean validation loss over the first ``eval_steps * batch_size`` validation samples (all
        of them when eval_steps is 0), exact for any world size; the model is put back in the mode it was in.
        With ``stop`` (a preemption request), every rank stops at the same batch once it is true on
        any of them: ``interrupted`` is then True, and the result None."""
        log.info("evaluating at step %d", step)
        was_training = self.model.training
        self.model.eval()
        self.interrupted = False
        try:
            self.events.evaluation(step)
            return validation_loss(self.model, self.dataset, self.loss_fn, limit=self.limit,
                                   batch_size=self.sampler.batch_size, rank=self.env.rank,
                                   world_size=self.env.world_size, device=self.env.device, autocast=self.autocast,
                                   distributed=self.env.distributed, stop=stop)
        except Interrupted as stopped:
            log.warning("evaluation at step %d %s: a preemption request", step, stopped)
            self.interrupted = True
            return None
        finally:
            self.model.train(was_training)
