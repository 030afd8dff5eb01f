"""DDPTrainer: composes config, distributed setup, model, data, DDP policy, checkpoints and
metrics into a training run."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from . import ddp_policy, distributed, resume, rng
from .activation import apply_checkpointing
from .checkpoint import (FATAL, PREEMPTED, CheckpointError, CheckpointManager, atomic_torch_save,
                         atomic_write_bytes, model_sha256, unwrap, write_marker)
from .config import TrainConfig, resolve_config
from .control import agree
from .data import (MarkovDataset, ResumableDistributedSampler, TokenWindows, build_datasets, fetch, make_loader,
                   workers_per_rank)
from . import faults as fault_tools
from .evaluation import validation_loss
from .faults import FaultPlan
from .health import Watchdog, first_divergent
from .loader import BatchStream
from .logs import setup_logging
from .memory import GcPolicy
from .metrics import Metrics, StepLog, log_run_start
from .model import GPT, GPTConfig, lm_loss
from .optim import build_optimizer, lr_at
from .preemption import PreemptionHandler
from .recovery import FatalError, MicroBatchOOM, SyncedBackwardOOM, forward_backward_with_retry

log = logging.getLogger(__name__)


# Errors that leave a FATAL marker: retrying cannot help.
NON_RETRIABLE = (FatalError, ddp_policy.DDPConfigurationError, CheckpointError)


class DDPTrainer:
    """Train the built-in GPT, or a user's ``model`` on ``train_dataset`` with ``loss_fn``, on
    1..N processes. ``config`` is a dict, a TrainConfig or None (defaults). ``rank`` and
    ``world_size`` default to torchrun's environment, or to a single process without it.

    A user's dataset yields ``(inputs, targets)``; ``loss_fn(model(inputs), targets)`` returns
    the mean loss of the batch. ``doctor=True`` only runs the DDP preflight (``report`` and
    ``decision``) and does not wrap the model.
    """

    def __init__(self, config: TrainConfig | dict | None = None, *, rank: int | None = None,
                 world_size: int | None = None, model: torch.nn.Module | None = None,
                 train_dataset=None, val_dataset=None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, debug: bool = False,
                 doctor: bool = False):
        cfg = resolve_config(config)
        self._owns_process_group = not dist.is_initialized()
        self.log_path = setup_logging(distributed.read_env(rank, world_size)[0], cfg.log_dir, debug=debug)
        self.env = env = distributed.setup(cfg.backend, cfg.timeout_s, rank=rank, world_size=world_size)
        resume.check_fatal_marker(cfg.checkpoint_dir, is_main=env.is_main)
        if cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False

        if train_dataset is None:
            bundle = build_datasets(cfg)
            train_dataset, val_dataset = bundle.train, bundle.val
            if bundle.vocab_size != cfg.vocab_size:
                log.info("vocab_size set to %d from the data", bundle.vocab_size)
                cfg = dataclasses.replace(cfg, vocab_size=bundle.vocab_size)
            log.info("data: %s", bundle.description)
            if bundle.loss_floor is not None and cfg.target_loss and cfg.target_loss < bundle.loss_floor:
                log.warning("target_loss=%g is below this data's loss floor %.4f: it cannot stop the run",
                            cfg.target_loss, bundle.loss_floor)
        self.cfg = cfg
        self.train_dataset, self.val_dataset = train_dataset, val_dataset

        torch.manual_seed(cfg.seed)
        if model is None:
            model = GPT(GPTConfig.from_train_config(cfg))
        elif cfg.tiled_mlp_chunks:
            log.warning("tiled_mlp_chunks applies to the built-in model only; use framework.activation.tiled_mlp "
                        "in your model's MLP")
        self.raw_model = model.to(env.device)
        targets = [t.strip() for t in cfg.checkpoint_modules.split(",") if t.strip()]
        self.checkpointed, self.offload_stats = apply_checkpointing(self.raw_model, cfg.gradient_checkpointing,
                                                                    targets)
        self.loss_fn = loss_fn or lm_loss
        # Model init used the shared seed; dropout and everything after draw per-rank streams.
        rng.seed_all(cfg.seed + 1 + env.rank)

        self.amp = cfg.use_amp == "true" or (cfg.use_amp == "auto" and env.device.type == "cuda")
        self.amp_dtype = torch.bfloat16 if cfg.amp_dtype == "bf16" else torch.float16
        self.scaler = torch.amp.GradScaler(env.device.type, enabled=self.amp and self.amp_dtype == torch.float16)
        self.params = [p for p in self.raw_model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.raw_model, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                         betas=(cfg.beta1, cfg.beta2))

        self.sampler = ResumableDistributedSampler(len(train_dataset), env.world_size, env.rank, cfg.batch_size,
                                                   cfg.gradient_accumulation_steps, cfg.seed)
        if self.sampler.steps_per_epoch == 0:
            raise ValueError(f"dataset_size: {len(train_dataset)} training samples are fewer than one global "
                             f"batch of {self.sampler.global_batch} (batch_size x world_size x accumulation)")
        # The built-in datasets are in memory and batch in one vectorised read: a worker process
        # would only add the cost of shipping each batch back (measured: ~1.5 ms a step on CPU).
        in_memory = isinstance(train_dataset, (MarkovDataset, TokenWindows))
        self.num_workers = 0 if in_memory else workers_per_rank(cfg.num_workers, env.local_world_size)
        self.stream = BatchStream(
            lambda: make_loader(train_dataset, self.sampler, num_workers=self.num_workers,
                                pin_memory=cfg.pin_memory and env.device.type == "cuda",
                                seed=cfg.seed + env.rank, timeout_s=cfg.timeout_s),
            self.sampler, max_restarts=cfg.max_loader_restarts)
        self.oom_recovery = cfg.oom_recovery == "true" or (cfg.oom_recovery == "auto" and env.device.type == "cuda")
        self.step = 0
        self.tokens_total = 0
        self.skipped_this_epoch: list[int] = []
        self.total_steps = self._total_steps()
        self.checkpoints = CheckpointManager(cfg.checkpoint_dir, keep_last=cfg.keep_last, rank=env.rank)
        state = None if doctor else resume.choose_checkpoint(cfg.resume, self.checkpoints, env)
        if state is not None:
            resume.restore(self, state)
            resume.apply_recorded_micro_batch(self)
            log.info("resumed from step %d (epoch %d, sample %d of the epoch)", self.step, self.sampler.epoch,
                     self.sampler.consumed)
        log_run_start(self)

        self.report = self.decision = None
        if doctor:
            self.model = self.raw_model
            self.report, self.decision = ddp_policy.preflight(self.raw_model, self.probe_batches(), self.loss_fn,
                                                              self._autocast, cfg)
        elif env.distributed:
            self.model, self.report, self.decision = ddp_policy.wrap_for_training(
                self.raw_model, self.probe_batches(), self.loss_fn, self._autocast, cfg, env.device)
        else:
            self.model = self.raw_model
        if state is not None:
            resume.restore_rng(self, state)
        self.faults = FaultPlan(cfg.fault_inject, env.rank)
        self.watchdog = Watchdog(step_timeout_s=cfg.step_timeout_s, factor=cfg.step_timeout_factor,
                                 log_file=self._log_file(), rank=env.rank, world_size=env.world_size,
                                 store=distributed.STORE)

    @property
    def loader(self):
        return self.stream.loader

    # --- construction helpers ----------------------------------------------------------------
    def _log_file(self):
        handler = next((h for h in logging.getLogger().handlers
                        if getattr(h, "baseFilename", None) == str(self.log_path.resolve())), None)
        return handler.stream if handler is not None else None

    def probe_batches(self, n: int = 2) -> list:
        """This rank's next ``n`` micro-batches, read without consuming them."""
        indices = list(itertools.islice(iter(self.sampler), n))
        self.sampler.delivered.clear()
        return [self._to_device(fetch(self.train_dataset, batch)) for batch in indices]

    def _total_steps(self) -> int:
        by_epochs = self.cfg.num_epochs * self.sampler.steps_per_epoch
        return min(self.cfg.max_steps, by_epochs) if self.cfg.max_steps else by_epochs

    # --- one step ----------------------------------------------------------------------------
    def _autocast(self):
        return torch.autocast(self.env.device.type, dtype=self.amp_dtype, enabled=self.amp)

    def _to_device(self, batch):
        return tuple(t.to(self.env.device, non_blocking=True) for t in batch)

    def forward_backward(self, micro_batches: list) -> torch.Tensor:
        """Accumulate gradients over ``micro_batches``; only the last backward all-reduces.
        Returns this rank's mean loss over them as a (device) tensor.

        With oom_recovery, an out-of-memory error in a no_sync() micro-step is agreed on by all
        ranks (one small all-reduce before the last micro-step) and raised as MicroBatchOOM
        everywhere; one in the last (synced) micro-step is SyncedBackwardOOM, because the other
        ranks are then already inside DDP's all-reduce. In one process every OOM is retried."""
        n = len(micro_batches)
        total = torch.zeros((), device=self.env.device)
        agree_oom = self.oom_recovery and self.env.distributed
        oom = False
        try:
            for i, batch in enumerate(micro_batches):
                last = i == n - 1
                inputs, targets = self._to_device(batch)
                sync = last or not isinstance(self.model, DDP)
                if last and agree_oom:
                    # Before the last forward: DDP's synced forward prepares its reducer, so every
                    # rank must either run it or skip it.
                    oom = agree(loss=total, world_size=1, distributed=True, oom=oom).oom
                if oom:
                    if last or not agree_oom:
                        raise MicroBatchOOM(f"out of memory at step {self.step}")
                    continue
                with contextlib.nullcontext() if sync else self.model.no_sync():
                    try:
                        hook = (fault_tools.oom_on_backward_of(fault_tools.middle_module(self.raw_model))
                                if self.faults.due("oom", self.step, i, n - 1) else None)
                        with self._autocast():
                            loss = self.loss_fn(self.model(inputs), targets) / n
                        if hook is not None:
                            hook.remove()
                        if last and self.faults.due("kill_worker", self.step):
                            loss.register_hook(self._kill_worker_hook)
                        self.scaler.scale(loss).backward()
                    except torch.OutOfMemoryError:
                        if last and self.env.distributed:
                            raise SyncedBackwardOOM(f"out of memory in the synced forward/backward of step "
                                                    f"{self.step}") from None
                        oom = self._oom_seen(i)
                        if not agree_oom:
                            raise MicroBatchOOM(f"out of memory at step {self.step}") from None
                        continue
                    total += loss.detach()
        except RuntimeError as err:
            diagnosed = ddp_policy.diagnose(err)
            if diagnosed is None:
                raise
            raise diagnosed from err
        return total

    def _kill_worker_hook(self, grad: torch.Tensor) -> None:
        """Fault injection: kill a DataLoader worker while the main thread is in backward."""
        log.warning("fault injection: killed DataLoader worker %s during backward", self.stream.kill_a_worker())

    def _oom_seen(self, micro: int) -> bool:
        log.warning("out of memory in micro-step %d of step %d (micro-batch %d)", micro,
                    self.step, self.sampler.batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        if self.env.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    def optimizer_step(self, loss: torch.Tensor, *, stop: bool = False, preempt: bool = False):
        """Clip, agree with the other ranks, then step (or skip a non-finite step everywhere)."""
        cfg = self.cfg
        lr = lr_at(self.step, lr=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
                   total_steps=self.total_steps, min_lr=cfg.min_lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self.params if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, cfg.grad_clip, grad_norm)
        # With a GradScaler, overflow is the scaler's to handle; otherwise a non-finite step is skipped.
        nonfinite = (~torch.isfinite(grad_norm) | ~torch.isfinite(loss)) if not self.scaler.is_enabled() else False
        agreed = agree(loss=loss, world_size=self.env.world_size, distributed=self.env.distributed,
                       nonfinite=nonfinite, stop=stop, preempt=preempt)
        skip = agreed.nonfinite if cfg.agree_nonfinite else bool(nonfinite)
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.update()
            self._record_skip()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        return agreed, lr, grad_norm

    def _record_skip(self) -> None:
        self.skipped_this_epoch.append(self.step)
        log.warning("step %d: non-finite loss or gradients on some rank; step skipped on all ranks",
                    self.step)
        if len(self.skipped_this_epoch) > self.cfg.max_errors_per_epoch:
            raise FatalError(f"non-finite loss or gradients at steps {self.skipped_this_epoch}: more than "
                             f"max_errors_per_epoch={self.cfg.max_errors_per_epoch} in epoch {self.sampler.epoch}")

    def _inject_nan(self) -> None:
        if self.faults.due("nan", self.step):
            next(p for p in self.raw_model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")

    # --- evaluation --------------------------------------------------------------------------
    def evaluate(self) -> float | None:
        """Mean validation loss over the first ``eval_steps * batch_size`` validation samples,
        exact for any world size (see framework/evaluation.py)."""
        was_training = self.model.training
        self.model.eval()
        try:
            return validation_loss(self.raw_model, self.val_dataset, self.loss_fn,
                                   limit=self.cfg.eval_steps * self.cfg.batch_size, batch_size=self.cfg.batch_size,
                                   rank=self.env.rank, world_size=self.env.world_size, device=self.env.device,
                                   autocast=self._autocast, distributed=self.env.distributed)
        finally:
            self.model.train(was_training)

    # --- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, *, blocking: bool = False) -> None:
        """Every rank calls this at the same step (the RNG states are gathered); rank 0 writes."""
        self.checkpoints.save(resume.training_state(self), self.step, blocking=blocking)

    def _save_due(self, epoch_ended: bool) -> bool:
        cfg = self.cfg
        return bool((cfg.save_every_steps and self.step % cfg.save_every_steps == 0)
                    or (epoch_ended and cfg.save_interval and (self.sampler.epoch + 1) % cfg.save_interval == 0))

    # --- the loop ----------------------------------------------------------------------------
    def train(self) -> dict:
        """Run to max_steps, num_epochs or target_loss, or until preempted; returns the summary
        (rank 0 also writes it). A non-retriable error leaves a FATAL marker in checkpoint_dir."""
        try:
            return self._train()
        except NON_RETRIABLE as err:
            message = f"rank {self.env.rank}: {type(err).__name__}: {err}"
            log.error("fatal, not retriable (FATAL marker written): %s", message)
            write_marker(self.cfg.checkpoint_dir, FATAL, message)
            raise
        finally:
            self.close()

    def _train(self) -> dict:
        cfg, env = self.cfg, self.env
        metrics = Metrics(enabled=env.is_main, log_dir=cfg.log_dir, tensorboard=cfg.tensorboard,
                          progress_bar=cfg.progress_bar, total_steps=self.total_steps, initial_step=self.step)
        steps = StepLog(self, metrics)
        # Line-buffered: a process killed with -9 keeps every line it wrote.
        samples_log = (open(Path(cfg.log_dir) / f"samples_rank_{env.rank}.jsonl", "a", buffering=1)
                       if cfg.record_samples else None)
        self.model.train()
        stop = self.step >= self.total_steps
        preempted = False
        on_main_thread = threading.current_thread() is threading.main_thread()
        try:
            with (PreemptionHandler() if on_main_thread else contextlib.nullcontext()) as preemption, \
                    GcPolicy(cfg.cleanup_interval, env.device) as gc_policy:
                if preemption is not None:
                    self.watchdog.dump_on(signal.SIGTERM)
                while not stop and self.sampler.epoch < cfg.num_epochs:
                    self.stream.start_epoch()
                    while self.sampler.steps_remaining() > 0:
                        self.watchdog.arm(self.step)
                        self.faults.fire_process_faults(self.step)
                        micro = self.stream.next_step()
                        loss = forward_backward_with_retry(self, micro)
                        self._inject_nan()
                        agreed, lr, grad_norm = self.optimizer_step(
                            loss, preempt=preemption is not None and preemption.requested is not None)
                        indices = self.sampler.advance()
                        self.step += 1
                        self.watchdog.disarm()
                        if self.faults.due("ulp", self.step):
                            log.warning("fault injection: %s nudged by one ulp",
                                        fault_tools.nudge_one_ulp(self.raw_model))
                        step_tokens = sum(b[0].numel() for b in micro) * env.world_size
                        self.tokens_total += step_tokens
                        if samples_log is not None:
                            samples_log.write(json.dumps({"epoch": self.sampler.epoch, "step": self.step,
                                                          "indices": indices}) + "\n")
                        steps.record(agreed.loss, lr, grad_norm, step_tokens)
                        gc_policy.step(self.step)
                        self._check_consistency()
                        epoch_ended = self.sampler.steps_remaining() == 0
                        if agreed.preempt:
                            self.save_checkpoint(blocking=True)
                            if env.is_main:
                                write_marker(cfg.checkpoint_dir, PREEMPTED, f"preempted at step {self.step}")
                            log.warning("preempted: checkpoint of step %d saved; exiting", self.step)
                            preempted = stop = True
                            break
                        stop = (self.step >= self.total_steps or agreed.stop
                                or (cfg.target_loss > 0 and agreed.loss <= cfg.target_loss))
                        if not stop and self._save_due(epoch_ended):
                            self.save_checkpoint()
                        if cfg.eval_interval and self.step % cfg.eval_interval == 0 and not stop:
                            with steps.paused():
                                steps.val_loss = self._eval_and_log(metrics)
                        if stop:
                            break
                    if not stop:
                        self.sampler.set_epoch(self.sampler.epoch + 1)
                        self.skipped_this_epoch = []
            self.watchdog.close()
            if not preempted:
                if steps.loss is not None and cfg.target_loss > 0 and steps.loss <= cfg.target_loss:
                    log.info("target_loss %g reached at step %d (loss %.4f)", cfg.target_loss, self.step, steps.loss)
                steps.val_loss = self._eval_and_log(metrics)
                self.save_checkpoint(blocking=True)
            self.checkpoints.close()
        finally:
            metrics.close()
            if samples_log is not None:
                samples_log.close()
        return self._finish(steps, preempted)

    def _check_consistency(self) -> None:
        interval = self.cfg.consistency_check_interval
        if not (interval and self.env.distributed and self.step % interval == 0):
            return
        name = first_divergent(self.raw_model, self.env.device)
        if name is not None:
            raise FatalError(f"ranks diverged by step {self.step}: parameter {name!r} differs between ranks")

    def _eval_and_log(self, metrics: Metrics) -> float | None:
        val_loss = self.evaluate()
        if val_loss is not None:
            log.info("step %d | val_loss %.4f", self.step, val_loss)
            metrics.scalars(self.step, {"val/loss": val_loss})
        return val_loss

    def _finish(self, steps: StepLog, preempted: bool) -> dict:
        cfg, env = self.cfg, self.env
        per_epoch = self.sampler.steps_per_epoch * self.sampler.global_batch
        summary = {
            "first_train_loss": steps.first_loss,
            "final_train_loss": steps.loss,
            "final_val_loss": steps.val_loss,
            "steps": self.step,
            "epochs": self.sampler.epoch + self.sampler.consumed / per_epoch,
            "tokens_per_sec": steps.tokens_per_sec(),
            "wall_s": steps.wall_s(),
            "world_size": env.world_size,
            "model_sha256": model_sha256(self.raw_model),
            "preempted": preempted,
        }
        if env.is_main:
            if not preempted:
                atomic_torch_save(unwrap(self.model).state_dict(), Path(cfg.checkpoint_dir) / "final_model.pt")
            atomic_write_bytes(Path(cfg.log_dir) / "summary.json", json.dumps(summary, indent=2).encode())
        log.info("%s: %s", "preempted" if preempted else "done", json.dumps(summary))
        return summary

    def close(self) -> None:
        """Release the loader's workers and, if this trainer created it, the process group."""
        if getattr(self, "stream", None) is not None:
            self.stream.shutdown()
        if getattr(self, "watchdog", None) is not None:
            self.watchdog.close()
        if self._owns_process_group:
            distributed.teardown()
