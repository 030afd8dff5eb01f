"""Recovery decisions that outlive a step: which errors are fatal, and the out-of-memory policy
(halve the micro-batch, double accumulation, keep the effective batch)."""

from __future__ import annotations

import logging

import torch

from . import resume

log = logging.getLogger(__name__)


class FatalError(RuntimeError):
    """An error that a restart cannot fix; it leaves a FATAL marker so a restarted group stops at once."""


class MicroBatchOOM(RuntimeError):
    """Out of memory where every rank can still agree: retry the step with half the micro-batch."""


class SyncedBackwardOOM(RuntimeError):
    """Out of memory inside a synced backward: the other ranks are in DDP's all-reduce, so only a
    restart (with the halved micro-batch recorded) can continue."""


def halve_micro_batch(sampler, reason: str) -> tuple[int, int]:
    """Half the micro-batch, twice the accumulation; the same global batch per step."""
    b, a = sampler.batch_size, sampler.accumulation
    if b == 1 or b % 2:
        raise FatalError(f"{reason} at micro-batch {b}: cannot halve it further without changing the "
                         f"effective batch; lower seq_len or the model size, or turn on gradient_checkpointing")
    sampler.batch_size, sampler.accumulation = b // 2, a * 2
    log.warning("%s: micro-batch %d -> %d, gradient accumulation %d -> %d (the effective batch stays %d)",
                reason, b, b // 2, a, a * 2, sampler.global_batch)
    return b // 2, a * 2


def forward_backward_with_retry(trainer, micro: list) -> torch.Tensor:
    """``trainer.forward_backward``, retrying the same samples with half the micro-batch after an
    agreed OOM; after an OOM in the synced backward, record the halved micro-batch and re-raise."""
    while True:
        try:
            return trainer.forward_backward(micro)
        except MicroBatchOOM as err:
            trainer.optimizer.zero_grad(set_to_none=True)  # every rank: some hold finished micro-steps
            halve_micro_batch(trainer.sampler, str(err))
            micro = trainer.stream.refetch_step()
        except SyncedBackwardOOM as err:
            b, a = halve_micro_batch(trainer.sampler, str(err))
            resume.record_micro_batch(trainer.cfg.checkpoint_dir, b, a, str(err))
            log.error("%s: the other ranks are inside DDP's all-reduce, so this rank exits; the restarted "
                      "group resumes from the last checkpoint with micro-batch %d x %d", err, b, a)
            raise
