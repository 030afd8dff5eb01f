"""DDP communication hooks (``ddp_comm_hook``): registering the chosen one on the wrapped model,
and PowerSGD's per-rank state, which goes into the checkpoint so that a resumed run continues
exactly.

PowerSGD compresses each bucket to a low-rank product and keeps, per rank, what the compression
lost (error feedback) plus the last Q factors (warm start), keyed by DDP's bucket index. DDP
rebuilds its buckets in the forward after a process's first synced backward (after its second
under static_graph; torch 2.13), so the state only fits the rebuilt layout: the DDP preflight runs
that many synced warm-up backwards before the hook is registered, and a fresh and a resumed
process both apply PowerSGD to rebuilt buckets only.

On gloo a bucket's PowerSGD all-reduces are issued from gloo's own threads as the previous ones
complete, so with two buckets or more the ranks can issue them in different orders: plain torch
2.13 hangs (or fails with "Received data size doesn't match") at the first compressed step. There
each bucket's PowerSGD is waited for before backward goes on; on NCCL the chain is issued at once,
in order, and nothing waits.

Healing in place on gloo (CPU), every hook (``none`` too: ``allreduce_hook``, DDP's own arithmetic)
is ``breakable``: its future fails as soon as the peer monitor names a peer lost
(framework/ddp/collectives.py), so a backward waiting for a frozen or cut-off peer ends in seconds,
not after ``ddp.timeout_s``.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from . import collectives
from .config import DDPSection

log = logging.getLogger(__name__)



def compress_hook(dtype: torch.dtype):
    """A DDP hook that all-reduces each bucket in ``dtype``, averaged, then cast back in place:
    torch's fp16/bf16 compress hooks without their NCCL-only check for bf16, since gloo sums bf16
    as well (torch 2.13's ``bf16_compress_hook`` raises TypeError on gloo)."""
    def hook(process_group, bucket):  # unannotated: DDP rejects this module's string annotations
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(group.size())

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            return buffer.copy_(fut.value()[0])

        return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)

    hook.__name__ = f"{dtype}_compress_hook".replace("torch.", "")
    return hook


_COMPRESS = {"fp16": compress_hook(torch.float16), "bf16": compress_hook(torch.bfloat16)}


def allreduce_hook(process_group, bucket):  # unannotated, as above
    """DDP's own averaging all-reduce as a hook: the bucket multiplied by 1/W, as the reducer does
    (torch's ``default_hooks.allreduce_hook`` divides, which differs from it by an ulp at a world
    size that is not a power of two), then summed."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer().mul_(1.0 / group.size())
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def breakable(hook):
    """``hook``, whose future fails with ``collectives.PeerLostError`` when a peer is named lost in
    this process's breaker before the bucket's all-reduce completes (the breaker read at each call:
    None, the future as it is). Gloo on CPU buckets only: the breaker's future is a CPU future,
    which would lose a CUDA bucket's stream order (and NCCL's future completes when the work is
    queued, so there is nothing to break)."""
    def guarded(state, bucket):  # unannotated, as above
        fut = hook(state, bucket)
        breaker = collectives.BREAKER
        return fut if breaker is None or bucket.buffer().is_cuda else breaker.future(fut, "the gradient all-reduce")

    guarded.__name__ = f"breakable_{getattr(hook, '__name__', 'hook')}"
    return guarded


def capture_powersgd(state: PowerSGDState) -> dict:
    """``state``'s training state as plain values and CPU tensors (the safe loader reads them)."""
    _, keys, pos, has_gauss, cached_gaussian = state.rng.get_state()
    cpu = lambda d: {int(i): t.detach().to("cpu", copy=True) for i, t in d.items()}  # noqa: E731
    return {"iter": int(state.iter), "rank": int(state.matrix_approximation_rank), "error": cpu(state.error_dict),
            "p": cpu(state.p_memory_dict), "q": cpu(state.q_memory_dict),
            "rng": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                    "cached_gaussian": float(cached_gaussian)},
            "stats": [int(state.total_numel_before_compression), int(state.total_numel_after_compression),
                      int(state.next_stats_report)]}


def restore_powersgd(state: PowerSGDState, saved: dict, device: torch.device) -> None:
    """Set ``state`` to what ``capture_powersgd`` returned, its tensors on ``device``. The warm start's
    P and Q are sized by the rank: saved with another powersgd_rank, they start afresh."""
    on = lambda d: {int(i): t.to(device, copy=True) for i, t in d.items()}  # noqa: E731  (Q is updated in place)
    state.iter = int(saved["iter"])
    state.error_dict, state.p_memory_dict, state.q_memory_dict = on(saved["error"]), on(saved["p"]), on(saved["q"])
    if int(saved["rank"]) != state.matrix_approximation_rank:
        log.warning("PowerSGD state saved with ddp.powersgd_rank=%d, now %d: the warm start starts afresh",
                    int(saved["rank"]), state.matrix_approximation_rank)
        state.p_memory_dict, state.q_memory_dict = {}, {}
    rng = saved["rng"]
    state.rng.set_state(("MT19937", rng["keys"].numpy().astype(np.uint32), int(rng["pos"]), int(rng["has_gauss"]),
                         float(rng["cached_gaussian"])))
    before, after, next_report = saved["stats"]
    state.total_numel_before_compression, state.total_numel_after_compression = int(before), int(after)
    state.next_stats_report = int(next_report)


class CommHook:
    """The communication hook of the ``ddp`` section's ``comm_hook`` and, for PowerSGD, its state
    (seeded by ``seed``, the run's ``train.seed``): a Stateful
    whose ``state_dict`` gathers every rank's state (a collective) and whose ``load_state_dict``
    keeps this rank's until ``register`` creates the hook, before the first step."""

    Config = DDPSection  # the configuration's ``ddp`` section, its first argument

    def __init__(self, ddp, *, env, seed: int):
        self.name, self.ddp, self.env, self.seed = ddp.comm_hook, ddp, env, seed
        self.state: PowerSGDState | None = None
        self._saved: dict | None = None
        self._wait = True

    def warm_ups(self, static_graph: bool) -> int:
        """Synced backwards to run before ``register``: PowerSGD's state must only ever see DDP's
        rebuilt buckets (see the module docstring)."""
        return (2 if static_graph else 1) if self.name == "powersgd" else 0

    def register(self, ddp_model) -> None:
        """Register the hook on ``ddp_model``; healing in place (a breaker armed), ``breakable``."""
        guarded = (collectives.BREAKER is not None and self.env.device.type == "cpu"
                   and dist.is_initialized() and dist.get_backend() == "gloo")
        wrap = breakable if guarded else (lambda hook: hook)
        if self.name == "none":
            if guarded:
                ddp_model.register_comm_hook(None, wrap(allreduce_hook))
            log.info("DDP communication hook: none (fp32 all-reduce%s)",
                     ", ended at once when a peer is named lost" if guarded else "")
            return
        if self.name in _COMPRESS:
            ddp_model.register_comm_hook(None, wrap(_COMPRESS[self.name]))
            log.info("DDP communication hook: %s (gradients all-reduced in %s, averaged, then cast back)",
                     self.name, self.name)
            return
        self.state = self._new_state()
        if self._saved is not None:
            restore_powersgd(self.state, self._saved, self.env.device)
        self._wait = not (dist.is_initialized() and dist.get_backend() == "nccl")
        ddp_model.register_comm_hook(self.state, wrap(self._powersgd))
        log.info("DDP communication hook: powersgd (rank %d, error feedback, warm start; plain all-reduce until "
                 "iteration %d, now at %d)", self.ddp.powersgd_rank, self.ddp.powersgd_start_iter, self.state.iter)

    def _new_state(self) -> PowerSGDState:
        return PowerSGDState(None, matrix_approximation_rank=self.ddp.powersgd_rank,
                             start_powerSGD_iter=self.ddp.powersgd_start_iter, use_error_feedback=True,
                             warm_start=True, random_seed=self.seed % 2**32)

    def _powersgd(self, state: PowerSGDState, bucket):
        index, size = bucket.index(), bucket.buffer().numel()
        error = state.error_dict.get(index)
        if error is not None and error.numel() != size:  # the bucket layout changed (e.g. bucket_cap_mb)
            log.warning("PowerSGD: bucket %d holds %d elements, its saved error feedback %d: that bucket's state "
                        "starts afresh", index, size, error.numel())
            self._forget(state, index)
        fut = powerSGD_hook(state, bucket).then(lambda fut: self._keep_finite(state, index, fut.value()))
        if self._wait:
            breaker = collectives.BREAKER
            if breaker is None:
                fut.wait()
            else:
                breaker.wait(fut, "PowerSGD's all-reduce")
        return fut

    def _keep_finite(self, state: PowerSGDState, index: int, reduced: torch.Tensor) -> torch.Tensor:
        """A non-finite gradient (a step that will be skipped) would stay in the error feedback and
        the warm-start Q for good, making every later step non-finite: that bucket starts afresh."""
        error = state.error_dict.get(index)
        if error is not None and not bool(torch.isfinite(error).all()):
            log.warning("PowerSGD: non-finite gradients in bucket %d: its error feedback and warm start are reset",
                        index)
            self._forget(state, index)
        return reduced

    @staticmethod
    def _forget(state: PowerSGDState, index: int) -> None:
        # Q is all-reduced, so every rank forgets it alike and draws the new one from the shared rng.
        for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
            memory.pop(index, None)

    def state_dict(self) -> dict:
        """``{"ranks": [each rank's PowerSGD state]}`` on rank 0 ({} without PowerSGD); every rank calls it."""
        if self.state is None:
            return {}
        mine = capture_powersgd(self.state)
        if not self.env.distributed:
            return {"ranks": [mine]}
        ranks = [None] * self.env.world_size if self.env.rank == 0 else None
        dist.gather_object(mine, ranks, dst=0)
        return {"ranks": ranks or []}

    def load_state_dict(self, state: dict) -> None:
        """Keep this rank's saved state for ``register``; once the hook runs (an in-process
        rollback), set its state at once."""
        self._saved = self._this_ranks(state.get("ranks", []))
        if self.state is not None:
            restore_powersgd(self.state, self._saved or capture_powersgd(self._new_state()), self.env.device)

    def _this_ranks(self, ranks: list) -> dict | None:
        if self.name != "powersgd":
            if ranks:
                log.warning("the checkpoint holds PowerSGD state, but ddp.comm_hook=%s: not used", self.name)
            return None
        if not ranks:
            log.warning("the checkpoint holds no PowerSGD state: PowerSGD starts afresh (plain all-reduce for "
                        "ddp.powersgd_start_iter=%d iterations)", self.ddp.powersgd_start_iter)
            return None
        if len(ranks) != self.env.world_size:
            log.warning("the checkpoint holds PowerSGD state for %d ranks, this run has %d: its iteration count is "
                        "kept, error feedback and warm start start afresh", len(ranks), self.env.world_size)
            return {**ranks[0], "error": {}, "p": {}, "q": {}}
        return ranks[self.env.rank]
