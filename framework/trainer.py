"""DDPTrainer: composes config, distributed setup, model, data, DDP policy, the step, checkpoints
and metrics into a training run."""

from __future__ import annotations

import contextlib
import logging
import signal
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import ddp_policy, distributed, ending, markers, rng
from .activation import enable_checkpointing, tile_user_mlps
from .checkpoint import CheckpointDirLocked, CheckpointError
from .compiling import compile_model
from .comm_hooks import CommHook
from .config import TrainConfig, resolve_config
from .control import Agreement
from .data import builtin_datasets, check_same_datasets
from .evaluation import Evaluator
from .faults import FaultPlan
from .health import ConsistencyCheck, Watchdog
from .loader import build_stream
from .logs import log_file_stream, setup_logging
from .markers import FatalError
from .memory import GcPolicy
from .metrics import SampleLog, StepLog, log_run_start
from .batches import num_tokens
from .callbacks import Callbacks, user_stateful
from .model import GPT, GPTConfig, lm_loss
from .optim import optimizer_and_schedule, precision
from .preemption import PreemptionHandler
from .resume import Checkpointer, guard_restart_loop, open_manager
from .spike import SpikeGuard
from .straggler import StragglerMonitor
from .step import SkipBudget, TrainStep, apply_recorded_micro_batch, prepare_model

log = logging.getLogger(__name__)

# Errors that leave a FATAL marker: retrying cannot help.
NON_RETRIABLE = (FatalError, ddp_policy.DDPConfigurationError, CheckpointError)


class DDPTrainer:
    """Train the built-in GPT, or a user's ``model`` on ``train_dataset``, on 1..N processes.
    ``config`` is a dict, a TrainConfig or None (defaults); ``rank`` and ``world_size`` default to
    torchrun's environment, or to one process without it. Batches and ``loss_fn``: see
    framework/batches.py. ``optimizer`` (an Optimizer or a factory ``params -> Optimizer``),
    ``lr_scheduler`` (a factory ``optimizer -> LRScheduler``), ``callbacks`` (framework/callbacks.py)
    and ``stateful`` ({name: object with state_dict/load_state_dict}) are saved and restored with
    the run. ``doctor=True`` only runs the DDP preflight (``report``, ``decision``). A non-retriable
    error, here or in ``train``, leaves a FATAL marker in checkpoint_dir."""

    eval_owed = -1  # the step whose evaluation a preemption request stopped: a run resumed there runs it first

    def __init__(self, config: TrainConfig | dict | None = None, *, rank: int | None = None,
                 world_size: int | None = None, model: torch.nn.Module | None = None,
                 train_dataset=None, val_dataset=None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, debug: bool = False,
                 doctor: bool = False, optimizer=None, lr_scheduler: Callable | None = None, callbacks=(),
                 stateful: dict[str, Any] | None = None):
        self.preemption = PreemptionHandler().install()
        self._user_optim, self.callbacks = (optimizer, lr_scheduler), Callbacks(callbacks)
        self.user_state = user_stateful(stateful)
        try:
            self.cfg = cfg = resolve_config(config)
        except BaseException:
            self.preemption.restore()
            raise
        self._owns_process_group = not dist.is_initialized()
        self.log_path = setup_logging(distributed.read_env(rank, world_size)[0], cfg.logging.dir, debug=debug)
        self.env = distributed.setup(cfg.ddp.backend, cfg.ddp.init_timeout_s or cfg.ddp.timeout_s, rank=rank,
                                     world_size=world_size, log_dir=cfg.logging.dir)
        with self._fatal_on_error():
            self._build(model, train_dataset, val_dataset, loss_fn, doctor)

    @contextlib.contextmanager
    def _fatal_on_error(self):
        try:
            yield
        except CheckpointDirLocked:  # checkpoint_dir, and its markers, are another live run's
            self.close()
            raise
        except NON_RETRIABLE as err:
            markers.write_fatal(self.cfg.checkpoint.dir, self.env.rank, err)
            self.close()
            raise
        except BaseException as err:
            markers.record_error(self.cfg.checkpoint.dir, self.env.rank, err)
            self.close()
            raise

    def _build(self, model, train_dataset, val_dataset, loss_fn, doctor: bool) -> None:
        builtin_data = train_dataset is None  # checkpoint_dir's lock first: its markers may be a live run's
        self.checkpoints = Checkpointer(self.cfg, self.env, open_manager(self.cfg, self.env), {},
                                        builtin_data=builtin_data, on_save=lambda s: self.callbacks("on_save", self, s))
        markers.check_at_start(self.cfg.checkpoint.dir, restart_count=distributed.incarnation(),
                               is_main=self.env.is_main)
        if self.cfg.train.deterministic:
            rng.use_deterministic_kernels()
        if builtin_data:
            self.cfg, train_dataset, val_dataset = builtin_datasets(self.cfg)
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self._build_model(model)
        self.loss_fn = lm_loss if model is None and loss_fn is None else loss_fn
        # Model init used the shared seed; dropout and everything after draw per-rank streams.
        rng.seed_all(self.cfg.train.seed + 1 + self.env.rank)
        self.amp, self.amp_dtype, self.scaler = precision(self.cfg, self.env.device)
        self.optimizer, self.schedule = optimizer_and_schedule(self.cfg, self.raw_model, *self._user_optim)
        self._build_data()
        state = self._restore(load=not doctor)
        self.total_steps = self.schedule.total_steps = self.sampler.last_step(self.step, self.cfg)
        log_run_start(self.cfg, self.env, self.sampler, model=self.raw_model, amp=self.amp,
                      total_steps=self.total_steps, num_workers=self.num_workers)
        self._wrap(doctor)
        if state is not None:
            self.checkpoints.restore_rng(state, self.step)
        self._build_run_health()

    def _restore(self, *, load: bool) -> dict | None:
        """The checkpoint to resume from, loaded into every stateful piece (the RNG comes last,
        after the DDP preflight, which must not consume it)."""
        cfg, env = self.cfg, self.env
        self.step = self.tokens_total = 0
        self.skips = SkipBudget(cfg.recovery.max_errors_per_epoch)
        self.spikes = SpikeGuard(cfg, is_main=env.is_main)
        self.spikes.attach(self.sampler)
        self.comm_hook = CommHook(cfg, env)
        self.checkpoints.attach(cfg, {
            "trainer": self, "model": self.raw_model, "optimizer": self.optimizer, "scaler": self.scaler,
            "schedule": self.schedule, "sampler": self.sampler, "stream": self.stream, "skips": self.skips,
            "spike_guard": self.spikes, "comm_hook": self.comm_hook, **self.user_state, **self.callbacks.stateful()})
        state = self.checkpoints.load() if load else None
        if state is not None:
            self.checkpoints.restore(state)
            log.info("resumed from step %d (epoch %d, sample %d of the epoch)", self.step, self.sampler.epoch,
                     self.sampler.consumed)
            self.spikes.adopt_recorded()
        if load:
            guard_restart_loop(cfg, env, self.step)
        if self.sampler.steps_remaining() == 0:  # saved at the end of an epoch
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self.skips.new_epoch()
        if distributed.incarnation() > 0:
            apply_recorded_micro_batch(self.sampler, cfg.checkpoint.dir)
        return state

    def _build_model(self, model: torch.nn.Module | None) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.train.seed)
        self.raw_model = (GPT(GPTConfig.from_train_config(cfg)) if model is None else model).to(self.env.device)
        if model is not None:  # the built-in GPT tiles its own MLP
            tile_user_mlps(self.raw_model, cfg.memory.tiled_mlp_chunks, cfg.memory.tiled_mlp_modules)
        self.checkpointing = enable_checkpointing(self.raw_model, cfg.memory.activation_checkpointing,
                                                  cfg.memory.activation_checkpointing_modules)
        self.checkpointed, self.offload_stats = self.checkpointing.wrapped, self.checkpointing.stats

    def _build_data(self) -> None:
        if self.env.distributed:
            check_same_datasets(self.train_dataset, self.val_dataset)
        self.sampler, self.stream, self.num_workers = build_stream(self.train_dataset, self.cfg, self.env,
                                                                   self.val_dataset)

    def _wrap(self, doctor: bool) -> None:
        cfg, env = self.cfg, self.env
        self.oom_recovery = cfg.recovery.oom == "true" or (cfg.recovery.oom == "auto" and env.device.type == "cuda")
        self.model, self.report, self.decision = prepare_model(
            lambda: ddp_policy.prepare(self.raw_model, self._peek, self.loss_fn, self._autocast, cfg,
                                       env.device, distributed=env.distributed, doctor=doctor,
                                       comm_hook=self.comm_hook),
            self.sampler, cfg.checkpoint.dir, oom_recovery=self.oom_recovery)
        self.model = self.model if doctor else compile_model(self.model, cfg.compile)

    def _build_run_health(self) -> None:
        cfg, env = self.cfg, self.env
        self.faults = FaultPlan(cfg.recovery.fault_inject, env.rank, distributed.incarnation())
        self.stragglers = StragglerMonitor(cfg.straggler, env)
        self.watchdog = Watchdog(step_timeout_s=cfg.recovery.step_timeout_s, factor=cfg.recovery.step_timeout_factor,
                                 log_file=log_file_stream(self.log_path), rank=env.rank, world_size=env.world_size,
                                 store=distributed.STORE)
        self.steps = TrainStep(model=self.model, raw_model=self.raw_model, optimizer=self.optimizer,
                               scaler=self.scaler, schedule=self.schedule, loss_fn=self.loss_fn,
                               autocast=self._autocast, env=env, sampler=self.sampler, stream=self.stream,
                               faults=self.faults, skips=self.skips, cfg=cfg, oom_recovery=self.oom_recovery,
                               lr_factor=self.spikes.lr_factor, timer=self.stragglers.timer)
        self.evaluator = Evaluator(self.raw_model, self.val_dataset, self.loss_fn, cfg=cfg, env=env,
                                   autocast=self._autocast, sampler=self.sampler, faults=self.faults)
        self.consistency = ConsistencyCheck(self.raw_model, interval=cfg.recovery.consistency_check_interval,
                                            device=env.device, distributed=env.distributed)

    def _peek(self) -> list:
        return self.stream.peek(2, self.env.device)

    def _autocast(self):
        return torch.autocast(self.env.device.type, dtype=self.amp_dtype, enabled=self.amp)

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_total": self.tokens_total, "eval_owed": self.eval_owed}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_total = int(state["step"]), int(state["tokens_total"])
        self.eval_owed = int(state.get("eval_owed", -1))

    @property
    def loader(self):
        return self.stream.loader

    @property
    def skipped_this_epoch(self) -> list[int]:
        return self.skips.steps

    def forward_backward(self, micro_batches: list) -> torch.Tensor:
        return self.steps.forward_backward(micro_batches, self.step)

    def optimizer_step(self, loss: torch.Tensor, *, stop: bool = False, preempt: bool = False):
        return self.steps.optimizer_step(loss, self.step, stop=stop, preempt=preempt)

    def evaluate(self) -> float | None:
        return self.evaluator.run(self.step)

    def save_checkpoint(self, *, blocking: bool = False) -> None:
        self.checkpoints.save(self.step, blocking=blocking)

    def train(self) -> dict:
        """Run to max_steps, num_epochs or target_loss, or until preempted; returns the summary
        (rank 0 also writes it)."""
        with self._fatal_on_error():
            summary = self._train()
        self.close()
        return summary

    def _train(self) -> dict:
        cfg, env = self.cfg, self.env
        steps = StepLog.open(cfg, env, total_steps=self.total_steps, initial_step=self.step)
        samples_log = SampleLog(Path(cfg.logging.dir) / f"samples_rank_{env.rank}.jsonl"
                                if cfg.logging.record_samples else None)
        self.model.train()
        if self.preemption.installed:
            self.watchdog.dump_on(signal.SIGTERM)
        self.callbacks("on_train_start", self)
        try:
            with GcPolicy(cfg.memory.cleanup_interval, env.device) as gc_policy:
                preempted = (self.eval_owed == self.step and ending.evaluate_mid_run(self, steps)) or self._loop(
                    steps, gc_policy, samples_log)
            if not preempted:
                preempted = ending.final_evaluation_and_save(self, steps)
            self.checkpoints.close()
            self.watchdog.close()
        finally:
            steps.close()
            samples_log.close()
        return ending.finish(self, steps, preempted)

    def _loop(self, steps: StepLog, gc_policy: GcPolicy, samples_log: SampleLog) -> bool:
        """Train until the run stops; True when it stopped because of a preemption request."""
        while self.step < self.total_steps and self.sampler.epoch < self.cfg.train.num_epochs:
            self.stream.start_epoch()
            while self.sampler.steps_remaining() > 0:
                agreed = self._train_step(steps, samples_log)
                if agreed is None:  # a stream ran out (on some rank): its epoch ended with the last step
                    self._save(epoch_ended=True)
                    break
                if self.spike is not None and self._roll_back(steps):
                    continue
                gc_policy.step(self.step)
                if self.consistency.should_run(self.step):
                    with self.watchdog.phase("consistency check"):
                        self.consistency.maybe_check(self.step)
                if agreed.preempt:
                    ending.save_preempted(self)
                    return True
                if self._should_stop(agreed):
                    return False
                self._save(epoch_ended=self.sampler.steps_remaining() == 0)
                if self.evaluator.should_run(self.step) and ending.evaluate_mid_run(self, steps):
                    return True
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self.skips.new_epoch()
        return False

    def _roll_back(self, steps: StepLog) -> bool:
        spike, self.spike = self.spike, None
        restored = self.checkpoints.roll_back(before=spike.step)
        self.spikes.roll_back(spike, restored)
        if restored is not None:
            self.stream.rewind()
            steps.purge_from(self.step + 1)
            self.total_steps = self.schedule.total_steps = self.sampler.last_step(self.step, self.cfg)
        return restored is not None  # False: nothing to go back to, and the step's bookkeeping runs

    def _save(self, *, epoch_ended: bool) -> None:
        if self.checkpoints.should_save(self.step, self.sampler.epoch, epoch_ended):
            with self.watchdog.phase("checkpoint save", scale=10):
                self.checkpoints.maybe_save(self.step, self.sampler.epoch, epoch_ended)
                self.faults.fire_process_faults(self.step, at="save")

    def _train_step(self, steps: StepLog, samples_log: SampleLog) -> Agreement | None:
        self.watchdog.arm(self.step)
        self.faults.fire_process_faults(self.step)
        self.stragglers.begin_step(self.step)
        micro = self.stream.next_step()
        self.stragglers.timer.lap("data")
        if micro is None:
            self.watchdog.disarm()
            return None
        loss = self.steps.forward_backward_with_retry(micro, self.step)
        self.faults.on_gradients(self.step, self.raw_model)
        agreed, lr, grad_norm = self.optimizer_step(loss, preempt=self.preemption.requested is not None)
        self.stragglers.timer.end()
        distributed.set_steady_timeout(self.cfg.ddp.init_timeout_s or self.cfg.ddp.timeout_s, self.cfg.ddp.timeout_s)
        indices = self.sampler.advance()
        self.step += 1
        self.watchdog.disarm()
        self.faults.on_step_end(self.step, self.raw_model)
        if self.stragglers.should_check(self.step):
            with self.watchdog.phase("straggler check"):
                self.stragglers.check(self.step)
        step_tokens = sum(num_tokens(b) for b in micro) * self.env.world_size
        self.tokens_total += step_tokens
        samples_log.write(self.sampler.epoch, self.step, indices)
        self.spike = self.spikes.observe(self.step, agreed.loss, skipped=agreed.nonfinite)
        steps.record(self.step, self.sampler.epoch, agreed.loss, lr, grad_norm, step_tokens,
                     health={**self.spikes.scalars(), **self.stragglers.scalars(),
                             "health/skipped_steps": self.skips.total})
        if self.callbacks:
            metrics = {"loss": agreed.loss, "lr": lr, "grad_norm": float(grad_norm), "tokens": step_tokens}
            self.callbacks("on_step_end", self, self.step, metrics)
        return agreed

    def _should_stop(self, agreed: Agreement) -> bool:
        target = self.cfg.train.target_loss
        return self.step >= self.total_steps or agreed.stop or (target > 0 and agreed.loss <= target)

    def close(self) -> None:
        """Wait for the checkpoint write in flight, release the loader's workers and, if this
        trainer created it, the process group. Safe to call more than once."""
        if getattr(self, "checkpoints", None) is not None:
            try:
                self.checkpoints.close()
            except (OSError, FatalError) as err:  # raised already where it mattered; the run is ending anyway
                log.error("the last checkpoint write failed: %s", err)
        if getattr(self, "stream", None) is not None:
            self.stream.shutdown()
        if getattr(self, "watchdog", None) is not None:
            self.watchdog.close()
        if self._owns_process_group:
            distributed.teardown()
        self.preemption.restore()  # last: a signal until here is recorded, not fatal
