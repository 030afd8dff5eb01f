"""One optimizer step: forward/backward over the micro-batches with no_sync() accumulation, the
out-of-memory agreement, and the optimizer step with its agreed skip.

An out-of-memory error in a no_sync() micro-step is agreed on by every rank (one small
all-reduce before the last, synced micro-step), and the step is retried with half the
micro-batch and twice the accumulation. One in the synced backward cannot be agreed on: the
other ranks are already inside DDP's all-reduce, so the halved micro-batch is recorded for the
restarted group and the error propagates.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch

from ..data.batches import batch_loss, label_count, to_device
from ..data.sampler import GlobalBatchUnsplittable
from ..ddp import collectives, policy
from ..ddp.compile import is_ddp, uncompiled
from ..model.hf_checkpointing import divides_by_num_items, loss_shifts_labels
from ..model.loss_without_grad import diagnose_loss_without_grad
from ..resilience import markers
from ..resilience.markers import FatalError
from ..resilience.memory import is_oom
from ..resilience.straggler import SectionTimer, off_the_clock_buffer_broadcast
from .agreement import Agreement, agree
from .events import EventBus

log = logging.getLogger(__name__)


class MicroBatchOOM(RuntimeError):
    """Out of memory where every rank can still agree: retry the step with half the micro-batch."""


class SyncedBackwardOOM(RuntimeError):
    """Out of memory inside a synced backward: only a restart (with the halved micro-batch recorded) helps."""


def halve_micro_batch(sampler, reason: str) -> tuple[int, int]:
    """Half the micro-batch, twice the accumulation; the same global batch per step."""
    b, a = sampler.batch_size, sampler.accumulation
    uneven = sampler.uneven is not None  # any cap splits it: up to half, rounded up
    if b == 1 or (b % 2 and not uneven):
        raise FatalError(f"{reason} at micro-batch {b}: cannot halve it further without changing the "
                         f"effective batch; lower model.seq_len or the model size, or set "
                         f"memory.activation_checkpointing")
    try:
        sampler.set_micro_batch((b + 1) // 2 if uneven else b // 2, a * 2)
    except GlobalBatchUnsplittable as err:  # an uneven split's smallest share holds fewer samples than that
        raise FatalError(f"{reason} at micro-batch {b}: cannot halve it further ({err}); lower model.seq_len or "
                         f"the model size, or set memory.activation_checkpointing") from None
    log.warning("%s: micro-batch %d -> %d, gradient accumulation %d -> %d (the effective batch stays %d)",
                reason, b, sampler.batch_size, a, sampler.accumulation, sampler.global_batch)
    return sampler.batch_size, sampler.accumulation


def prepare_model(prepare: Callable[[], tuple], sampler, checkpoint_dir, *, oom_recovery: bool) -> tuple:
    """``prepare()`` (the DDP preflight and wrap), with the out-of-memory policy of a step: an
    OOM in the probe, agreed by every rank, halves the micro-batch and probes again; one in the
    static-graph warm-up, a synced backward, is recorded for the restart and re-raised."""
    while True:
        try:
            return prepare()
        except policy.PreflightOOM as err:
            if not oom_recovery:
                raise FatalError(f"{err}: lower data.batch_size or model.seq_len, or set "
                                 f"memory.activation_checkpointing or recovery.oom=true") from None
            halve_micro_batch(sampler, str(err))
        except RuntimeError as err:
            if not is_oom(err):
                raise
            b, a = halve_micro_batch(sampler, "out of memory in the static-graph warm-up")
            markers.record_micro_batch(checkpoint_dir, b, a, "out of memory in the static-graph warm-up")
            raise SyncedBackwardOOM("out of memory in the static-graph warm-up: the restarted group uses "
                                    f"micro-batch {b} x {a}") from None


def apply_recorded_micro_batch(sampler, checkpoint_dir) -> None:
    """A restarted group takes the micro-batch that an out-of-memory error made it record."""
    rec = markers.recorded_micro_batch(checkpoint_dir)
    if rec is None:
        return
    b, a = int(rec["micro_batch_size"]), int(rec["accumulation_steps"])
    if sampler.uneven is not None:  # cut again in micro-batches of up to b
        sampler.set_micro_batch(b, a)
        log.warning("micro-batch up to %d x %d accumulation steps, recorded after: %s", sampler.batch_size,
                    sampler.accumulation, rec["reason"])
        return
    if b * a != sampler.batch_size * sampler.accumulation:
        log.warning("ignoring %s (%d x %d): this run's per-rank batch is %d", markers.MICRO_BATCH, b, a,
                    sampler.batch_size * sampler.accumulation)
        return
    sampler.set_micro_batch(b, a)
    log.warning("micro-batch %d x %d accumulation steps, recorded after: %s", b, a, rec["reason"])


class SkipBudget:
    """The steps skipped (non-finite) in the current epoch; more than ``limit`` is fatal."""

    def __init__(self, limit: int):
        self.limit = limit
        self.steps: list[int] = []
        self.total = 0  # in the whole run, for the summary

    def record(self, step: int, epoch: int) -> None:
        self.steps.append(step)
        self.total += 1
        log.warning("step %d: non-finite loss or gradients on some rank; step skipped on all ranks", step)
        if len(self.steps) > self.limit:
            raise FatalError(f"non-finite loss or gradients at steps {self.steps}: more than "
                             f"max_errors_per_epoch={self.limit} in epoch {epoch}")

    def new_epoch(self) -> None:
        self.steps = []

    def state_dict(self) -> dict:
        return {"steps": list(self.steps), "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.steps = [int(s) for s in state["steps"]]
        self.total = int(state.get("total", len(self.steps)))


def oom_recovery_enabled(cfg, device) -> bool:
    """recovery.oom: true, false, or auto (on CUDA)."""
    return cfg.recovery.oom == "true" or (cfg.recovery.oom == "auto" and device.type == "cuda")


class TrainStep:
    """Runs optimizer steps on ``model`` (DDP-wrapped or not; ``raw_model`` is the unwrapped one).
    ``cfg``: the run's configuration, for ``optim.grad_clip``, ``recovery.agree_nonfinite`` and
    ``recovery.oom``, ``train.loss_average`` and ``checkpoint.dir`` (where a synced backward's OOM
    records the halved micro-batch); ``precision``: framework/train/optim.py's Precision."""

    def __init__(self, cfg, *, model, raw_model, optimizer, precision, schedule, loss_fn, env, sampler, stream,
                 events: EventBus, skips: SkipBudget, lr_factor: Callable[[int], float] = lambda s: 1.0,
                 timer: SectionTimer | None = None, reseed: Callable[[int], None] = lambda s: None):
        self.model, self.raw_model = model, raw_model
        self.optimizer, self.scaler, self.schedule = optimizer, precision.scaler, schedule
        self.loss_fn, self.autocast, self.env = loss_fn, precision.context, env
        self.sampler, self.stream, self.events, self.skips = sampler, stream, events, skips
        self.grad_clip, self.agree_nonfinite = cfg.optim.grad_clip, cfg.recovery.agree_nonfinite
        self.checkpoint_dir = cfg.checkpoint.dir
        self.loss_average = loss_average = cfg.train.loss_average
        oom_recovery = oom_recovery_enabled(cfg, env.device)
        # transformers' own way to average over tokens: the model sums its loss and divides it by
        # num_items_in_batch (transformers.Trainer passes it to such models); other models' mean
        # loss is weighted by their micro-batch's share of the tokens instead.
        self.model_divides = loss_average != "micro_batch" and loss_fn is None and divides_by_num_items(raw_model)
        self.shifted = loss_average != "micro_batch" and loss_shifts_labels(raw_model)
        self._weights: list[tuple[dict, torch.Tensor | float]] | None = None  # the current step's, per micro-batch
        self.oom_recovery = oom_recovery
        self.lr_factor = lr_factor  # a loss-spike rollback's learning-rate cooldown
        self.timer = timer or SectionTimer(env.device)  # the straggler scores' section timings
        self.reseed = reseed  # the generators as at the step's start, for its retry (the trainer's _seed_step)
        off_the_clock_buffer_broadcast(model, self.timer)
        self.params = [p for p in raw_model.parameters() if p.requires_grad]

    def forward_backward_with_retry(self, micro: list, step: int) -> torch.Tensor:
        """``forward_backward``, retrying the same samples with half the micro-batch after an
        agreed OOM; after an OOM in the synced backward, record the halved micro-batch and re-raise."""
        while True:
            try:
                return self.forward_backward(micro, step)
            except MicroBatchOOM as err:
                self.optimizer.zero_grad(set_to_none=True)  # every rank: some hold finished micro-steps
                halve_micro_batch(self.sampler, str(err))
                self.reseed(step)  # the retry draws as a run that started with this split would
                micro = self.stream.refetch_step()
            except SyncedBackwardOOM as err:
                b, a = halve_micro_batch(self.sampler, str(err))
                markers.record_micro_batch(self.checkpoint_dir, b, a, str(err))
                log.error("%s: the other ranks are inside DDP's all-reduce, so this rank exits; the restarted "
                          "group resumes from the last checkpoint with micro-batch %d x %d", err, b, a)
                raise

    def forward_backward(self, micro_batches: list, step: int) -> torch.Tensor:
        """Accumulate gradients over ``micro_batches``; only the last backward all-reduces.
        Returns this rank's mean loss over them as a (device) tensor."""
        try:
            return self._accumulate(micro_batches, step)
        except RuntimeError as err:
            diagnosed = self.diagnose(err, micro_batches[0])
            if diagnosed is None:
                raise
            raise diagnosed from err

    def diagnose(self, err: RuntimeError, batch) -> FatalError | None:
        """The diagnosis of a raw error that a restart cannot fix (the module, the cause and the
        setting that fixes it), or None: DDP's errors, and autograd's for a loss without a gradient,
        whose module is found by running ``batch`` forward once more."""
        def forward() -> torch.Tensor:
            model_kwargs = self._weights[0][0] if self._weights is not None else {}
            with policy.preserved_state(self.raw_model), self.autocast():
                return batch_loss(self.raw_model, to_device(batch, self.env.device), self.loss_fn, model_kwargs)
        return policy.diagnose(err, self.model) or diagnose_loss_without_grad(err, self.raw_model, forward)

    def _token_weights(self, micro_batches: list) -> list[tuple[dict, torch.Tensor | float]]:
        """For ``loss_average`` tokens or rank_tokens: per micro-batch, the model's extra keyword
        arguments and the factor its loss is multiplied by, so that the step's gradient is the
        mean over the labelled tokens of the global batch (tokens: a SUM all-reduce of the count
        before the first forward, the same point on every rank; DDP then averages over the W ranks,
        which the factor W undoes) or of this rank's micro-batches (rank_tokens; a rank's share of an
        uneven split weighs by its samples)."""
        try:
            counts = [label_count(batch, shifted=self.shifted).to(self.env.device) for batch in micro_batches]
        except ValueError as err:  # no labels to count: every step would fail the same way
            raise FatalError(str(err)) from None
        total = torch.stack(counts).sum()
        world = 1
        if self.loss_average == "tokens" and self.env.distributed:
            collectives.all_reduce(total, breaker=collectives.BREAKER, what="the token count")
            world = self.env.world_size
        elif shares := self.sampler.micro_weights():  # rank_tokens, uneven: a rank weighs by its samples
            world = sum(shares)
        total = total.clamp(min=1)
        if self.model_divides:
            return [({"num_items_in_batch": total}, world) for _ in counts]
        return [({}, count * world / total) for count in counts]

    def _accumulate(self, micro_batches: list, step: int) -> torch.Tensor:
        n = len(micro_batches)
        if self.loss_average != "micro_batch":
            self._weights = self._token_weights(micro_batches)
        else:  # an uneven split's micro-batches weigh by their samples (even: 1 / n each)
            shares = self.sampler.micro_weights()
            self._weights = None if shares is None else [({}, share) for share in shares]
        total = torch.zeros((), device=self.env.device)
        agree_oom = self.oom_recovery and self.env.distributed
        oom = False
        for i, batch in enumerate(micro_batches):
            last = i == n - 1
            if last and agree_oom:
                # Before the last forward: DDP's synced forward prepares its reducer, so every
                # rank must either run it or skip it.
                self.timer.lap("forward_backward")
                oom = agree(loss=total, world_size=1, distributed=True, oom=oom).oom
                self.timer.lap(None)  # a collective: waiting for the others
            if oom:
                if last or not agree_oom:
                    raise MicroBatchOOM(f"out of memory at step {step}")
                continue
            loss = self._guarded_micro_step(batch, step, i, n)
            if loss is not None:
                total += loss
                continue
            oom = True
            self._release_after_oom(i, step)
            if not agree_oom:
                raise MicroBatchOOM(f"out of memory at step {step}")
        return total

    def _guarded_micro_step(self, batch, step: int, i: int, n: int) -> torch.Tensor | None:
        """The micro-step's loss, or None after an out-of-memory error in a micro-step that
        other ranks can still agree on."""
        last = i == n - 1
        sync = last or not is_ddp(self.model)
        try:
            with contextlib.nullcontext() if sync else self.model.no_sync():
                return self._micro_step(batch, step, i, n)
        except RuntimeError as err:
            if not is_oom(err):
                raise
            if last and self.env.distributed:
                raise SyncedBackwardOOM(f"out of memory in the synced forward/backward of step {step}") from None
        return None

    def _micro_step(self, batch, step: int, i: int, n: int) -> torch.Tensor:
        batch = self.events.micro_batch(step, i, to_device(batch, self.env.device))
        with self.events.micro_step(step, i, n - 1, self.raw_model, self.stream.kill_a_worker) as on_loss:
            self.timer.lap("forward_backward")  # before DDP's buffer broadcast (off_the_clock_buffer_broadcast)
            model_kwargs, factor = self._weights[i] if self._weights is not None else ({}, 1 / n)
            with self.autocast():
                loss = batch_loss(uncompiled(self.model) if self.events.eager_now else self.model, batch,
                                  self.loss_fn, model_kwargs)
            # A micro-batch with no labelled token has a NaN mean (0/0) and weighs nothing: its
            # gradient is zero, and so is its share of the loss.
            loss = torch.where(factor > 0, loss * factor, 0.0) if torch.is_tensor(factor) else loss * factor
            on_loss(loss)
            self.timer.lap("forward_backward")
            self.scaler.scale(loss).backward()
        self.timer.lap("synced_backward" if i == n - 1 and is_ddp(self.model) else "forward_backward")
        return loss.detach()

    def _release_after_oom(self, micro: int, step: int) -> None:
        """Free what the failed micro-step held. Called outside the ``except`` block: until it
        ends, the traceback keeps the failed forward's activations alive."""
        log.warning("out of memory in micro-step %d of step %d (micro-batch %d)", micro, step,
                    self.sampler.batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        if self.env.device.type == "cuda":
            torch.cuda.empty_cache()

    def optimizer_step(self, loss: torch.Tensor, step: int, *, stop: bool = False, preempt: bool = False,
                       save_due: bool = False, grow: bool = False) -> tuple[Agreement, float, torch.Tensor]:
        """Clip, agree with the other ranks, then step (or skip a non-finite step everywhere)."""
        lr = self.schedule.apply(self.optimizer, step)
        factor = self.lr_factor(step)
        rates = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.grad_clip, grad_norm)
        # With a GradScaler, overflowing gradients are the scaler's to handle (it skips the step and
        # lowers the scale); a non-finite loss is a diverged run either way, and counts.
        nonfinite = ~torch.isfinite(loss)
        if not self.scaler.is_enabled():
            nonfinite |= ~torch.isfinite(grad_norm)
        self.timer.lap("optimizer")
        agreed = agree(loss=loss, world_size=self.env.world_size, distributed=self.env.distributed,
                       nonfinite=nonfinite, stop=stop, preempt=preempt, save_due=save_due, grow=grow)
        self.timer.lap(None)  # a collective: time spent waiting for the others
        skip = agreed.nonfinite if self.agree_nonfinite else bool(nonfinite)
        if not skip:
            self.scaler.step(self.optimizer)
        for group, rate in zip(self.optimizer.param_groups, rates, strict=True):
            group["lr"] = rate  # before a user's scheduler reads the rate back
        self.scaler.update()
        self.schedule.after_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.timer.lap("optimizer")
        if skip:
            self.skips.record(step, self.sampler.epoch)
        return agreed, lr * factor, grad_norm
