"""DDPTrainer: composes config, distributed setup, model, data, DDP policy, the step, checkpoints
and metrics into a training run, and owns the run's lifecycle: start (or resume), the loop, and the
ending (the agreed final evaluation and save, or the preempted save, then the export and summary)."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from .config import TrainConfig, resolve_config
from .data.batch_stream import BatchStream, build_stream
from .data.batches import num_tokens
from .data.datasets import builtin_datasets, check_same_datasets
from .data.iterable_stream import IterableStream, StreamPosition
from .data.sampler import ResumableDistributedSampler
from .ddp import collectives, policy, process_group
from .ddp.comm_hooks import CommHook
from .ddp.compile import compile_model
from .ddp.heal import Growing, Healing, NothingToHealFrom, newest_state
from .ddp.membership import REMOTE_SILENT_S, ProposerLost, RunFinished
from .model.activation_checkpointing import Checkpointing, enable_checkpointing
from .model.gpt import GPT, GPTConfig, lm_loss
from .model.tiled_mlp import tile_user_mlps
from .observability.logs import DETAIL, log_file_stream, setup_logging
from .observability.metrics import SampleLog, StartupClock, StepLog, log_run_start, summary_line
from .resilience import markers
from .resilience.consistency import ConsistencyCheck, model_sha256
from .resilience.markers import FatalError
from .resilience.peers import PeerMonitor
from .resilience.memory import GcPolicy
from .resilience.preemption import PreemptionHandler
from .resilience.spike_guard import SpikeGuard
from .resilience.straggler import StragglerMonitor
from .resilience.watchdog import Watchdog
from .state import atomic, export, rng
from .state.checkpoint_files import CheckpointDirLocked, CheckpointError
from .state.checkpointer import StepStartBuffers, Checkpointer, guard_restart_loop, open_store
from .resilience.faults import FaultPlan
from .train.callbacks import UserCallbacks, user_stateful
from .train.events import EventBus, StepResult
from .train.agreement import Agreement, agree
from .train.evaluation import Evaluator
from .train.optim import LRSchedule, Precision, UserSchedule, optimizer_and_schedule
from .train.step import SkipBudget, TrainStep, apply_recorded_micro_batch, oom_recovery_enabled, prepare_model

log = logging.getLogger(__name__)

# Errors that leave a FATAL marker: retrying cannot help.
NON_RETRIABLE = (FatalError, policy.DDPConfigurationError, CheckpointError)


class _Saved:
    """A Stateful made of two functions: the trainer's own part of the checkpoint ("trainer")."""

    def __init__(self, state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None]):
        self.state_dict, self.load_state_dict = state_dict, load_state_dict


class DDPTrainer:
    """Train the built-in GPT, or a user's ``model`` on ``train_dataset``, on 1..N processes.
    ``config`` is a dict, a TrainConfig or None (defaults); ``rank`` and ``world_size`` default to
    torchrun's environment, or to one process without it. Batches and ``loss_fn``: see
    framework/data/batches.py. ``optimizer`` (an Optimizer or a factory ``params -> Optimizer``),
    ``lr_scheduler`` (a factory ``optimizer -> LRScheduler``), ``callbacks`` (framework/train/callbacks.py)
    and ``stateful`` ({name: object with state_dict/load_state_dict}) are saved and restored with
    the run. ``doctor=True`` only runs the DDP preflight (``report``, ``decision``). A non-retriable
    error, here or in ``train``, leaves a FATAL marker in checkpoint_dir.

    Public attributes (the rest is private and may change):

    - ``model``: the model that trains: the DDP wrapper (compiled when ``compile`` says so) or, on
      one process, the model itself;
    - ``raw_model``: the unwrapped model, whose state_dict a checkpoint holds;
    - ``optimizer``: the optimizer (the built-in AdamW or the user's);
    - ``sampler``: the resumable distributed sampler (epoch, samples consumed, steps remaining);
    - ``step``: the number of optimizer steps done (an int);
    - ``config``: the resolved TrainConfig (``cfg`` is a read-only alias);
    - ``env``: the process's place in the run (rank, world_size, device, distributed);
    - ``report``, ``decision``: the DDP preflight's findings and the settings it chose;
    - the components, each built from its configuration section: ``stream`` (each step's
      micro-batches), ``checkpointer`` (what is saved, when, and the resume), ``train_step``,
      ``evaluator``, ``precision`` (autocast, dtype, GradScaler), ``schedule``, ``skips``,
      ``comm_hook``, ``activation_checkpointing``, and what surrounds a step: ``watchdog``,
      ``stragglers``, ``spike_guard``, ``consistency``, ``step_start_buffers``, ``faults``, ``peers``
      (the peer monitor);
    - ``events``: the run's event bus (framework/train/events.py); ``events.attach(listener)``
      adds a ``Listener`` after the others; ``callbacks``: the user's callbacks, one of its listeners.

    Methods: ``train()``, ``evaluate()``, ``save_checkpoint()``, ``request_stop()``, ``close()``, and one step by hand
    with ``forward_backward()`` and ``optimizer_step()``."""

    # The public attributes, typed (built in __init__, _build and _build_training):
    config: TrainConfig
    env: process_group.DistEnv
    model: torch.nn.Module
    raw_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: ResumableDistributedSampler | StreamPosition
    step: int
    stream: BatchStream | IterableStream
    checkpointer: Checkpointer
    train_step: TrainStep
    evaluator: Evaluator
    precision: Precision
    schedule: LRSchedule | UserSchedule
    skips: SkipBudget
    comm_hook: CommHook
    activation_checkpointing: Checkpointing
    watchdog: Watchdog
    stragglers: StragglerMonitor
    spike_guard: SpikeGuard
    consistency: ConsistencyCheck
    step_start_buffers: StepStartBuffers
    faults: FaultPlan
    peers: PeerMonitor
    events: EventBus
    callbacks: UserCallbacks

    _stop_requested = False
    _eval_owed = -1  # the step whose evaluation a preemption request stopped: a run resumed there runs it first
    _evaluated_step = -1  # the step of the last evaluation recorded (the final one is not run twice)
    _evaluated_loss: float | None = None  # its validation loss (the summary's, when a resumed run does not rerun it)
    _final_on_disk = False  # the checkpoint resumed from is the run's final save (a finished run relaunched)
    _heals = 0  # generations formed in place after a lost peer (recovery.heal=in_place)
    _joined = False  # this process joined a running generation (a replica started again)
    _regrouped = ""  # how the current generation formed in this process: "healed in place at", "grew in place at"
    _stopped_at = -1  # the step of an early stop: a run resumed there ends (see _stopped_here)
    _stopped_by = ""  # "a stop requested", or "train.target_loss=T reached"
    _stopped_total = 0  # the run's length (steps) when it stopped: a longer one trains on

    def __init__(self, config: TrainConfig | dict | None = None, *, rank: int | None = None,
                 world_size: int | None = None, model: torch.nn.Module | None = None,
                 train_dataset=None, val_dataset=None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, debug: bool = False,
                 doctor: bool = False, optimizer=None, lr_scheduler: Callable | None = None, callbacks=(),
                 stateful: dict[str, Any] | None = None):
        self._preemption = PreemptionHandler().install()
        self._startup = StartupClock()
        self._user_optim, self.callbacks = (optimizer, lr_scheduler), UserCallbacks(callbacks, owner=self)
        self.events = EventBus()  # the run's event bus: what surrounds a step, fault injection, the callbacks
        self._user_state = user_stateful(stateful)
        try:
            self.config = cfg = resolve_config(config)
        except BaseException:
            self._preemption.restore()
            raise
        self._owns_process_group = not dist.is_initialized()
        process_group.close_at_exit(self._close_at_exit)
        self._debug = debug
        self.log_path = setup_logging(process_group.log_rank(rank, world_size), cfg.logging.dir, debug=debug)
        try:
            self.env = process_group.setup(cfg.ddp.backend, cfg.ddp.init_timeout_s or cfg.ddp.timeout_s, rank=rank,
                                           world_size=world_size, log_dir=cfg.logging.dir,
                                           store_lost_s=cfg.recovery.peer_timeout_s or REMOTE_SILENT_S)
        except process_group.RunStoreLost as err:
            self._end_restart(err.message, stop_agent=True)
        self._startup.mark("process group")
        if cfg.recovery.heal == "in_place" and process_group.MEMBERSHIP is None and self.env.distributed:
            log.warning("recovery.heal=in_place: this process was not started to heal in place (launch_training.sh "
                        "--heal, which starts one torchrun job per rank): a lost peer restarts the group")
        with self._fatal_on_error():
            self._build(model, train_dataset, val_dataset, loss_fn, doctor)

    @property
    def cfg(self) -> TrainConfig:
        """The resolved configuration (``config``'s old name)."""
        return self.config

    @property
    def total_steps(self) -> int:
        """The run's last step: ``train.max_steps``, or where ``train.num_epochs`` ends at the run's
        global batch (a checkpoint's, when resumed at another world size)."""
        return self._total_steps

    def recount(self, *, max_steps: int, eval_interval: int) -> None:
        """Set ``train.max_steps`` and ``eval.interval`` after the build, before ``train()``: for a
        caller that counts them in the run's epochs, whose length is known once the checkpoint
        (its global batch) is loaded (framework.hf: a run resumed at another world size)."""
        self.config.train.max_steps, self.config.eval.interval = max_steps, eval_interval
        self.evaluator.interval = eval_interval
        self._total_steps = self.schedule.total_steps = self.sampler.last_step(self.step, self.config)

    @property
    def report(self):
        """The DDP preflight's findings (a ProbeReport)."""
        return self._report

    @property
    def decision(self):
        """The DDP settings the policy chose, with its reasons."""
        return self._decision

    @contextlib.contextmanager
    def _fatal_on_error(self):
        try:
            yield
        except (CheckpointDirLocked, RunFinished):  # another live run's checkpoint_dir; nothing left to join
            self.close()
            raise
        except NON_RETRIABLE as err:
            if getattr(err, "blocks_restarts", True):
                markers.write_fatal(self.config.checkpoint.dir, self.env.rank, err)
            else:  # a restart on other terms (another world size) may continue
                markers.record_error(self.config.checkpoint.dir, self.env.rank, err)
            self.close()
            raise
        except BaseException as err:
            markers.record_error(self.config.checkpoint.dir, self.env.rank, err)
            self.close()
            raise

    # --- start -------------------------------------------------------------------------------

    def _build(self, model, train_dataset, val_dataset, loss_fn, doctor: bool) -> None:
        builtin_data = train_dataset is None  # checkpoint_dir's lock first: its markers may be a live run's
        self.checkpointer = Checkpointer(self.config, self.env, open_store(self.config, self.env), {},
                                          builtin_data=builtin_data, builtin_model=model is None,
                                          on_save=self.events.saved)
        markers.check_at_start(self.config.checkpoint.dir, group_restarts=process_group.group_restarts(),
                               is_main=self.env.is_main, is_local_main=self.env.local_rank == 0)
        if self.config.train.deterministic:
            rng.use_deterministic_kernels()
        if builtin_data:
            self.config, train_dataset, val_dataset = builtin_datasets(self.config)
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self._build_model(model)
        self.loss_fn = lm_loss if model is None and loss_fn is None else loss_fn
        given = None
        if process_group.joining():  # a spare, or a replica started again: its model and data are built
            import torch._dynamo  # noqa: F401  (the optimizer's first step imports it: 0.7 s the members would wait)
            self.env, given = process_group.join_running(
                self.config.ddp.backend, self.config.ddp.timeout_s, stop=lambda: self._preemption.requested is not None,
                before_restart=lambda: markers.check_at_start(self.config.checkpoint.dir, group_restarts=1,
                                                              is_main=False))
            self._joined = True
            self.log_path = setup_logging(self.env.rank, self.config.logging.dir, debug=self._debug,
                                          file_rank=process_group.MEMBERSHIP.replica)
            self.checkpointer.take_over(self.env, resuming=given is None)
        self._build_training(doctor=doctor, given=given)

    def _build_training(self, *, doctor: bool = False, given: dict | None = None, rebuilt: bool = False) -> None:
        """What trains the model: its optimizer, the data, the state (a checkpoint's, or ``given``,
        a member's in memory), the DDP wrapper and what surrounds a step. ``rebuilt``: again, in
        the same process, for a new generation of the group (healing in place)."""
        # Model init used the shared seed; dropout and everything after draw per-rank streams.
        rng.seed_all(self.config.train.seed + 1 + self.env.rank)
        self.precision = Precision(self.config.precision, device=self.env.device)
        self.optimizer, self.schedule = optimizer_and_schedule(self.config, self.raw_model, *self._user_optim)
        self._build_data()
        if process_group.MEMBERSHIP is not None and getattr(self.stream, "stateful", False):
            raise FatalError("recovery.heal=in_place: the stream's dataset has a state of each rank's, which a "
                             "heal cannot hand to other ranks; allowed with such a stream: recovery.heal=restart")
        self._startup.mark("model and data")
        state = self._restore(load=not doctor, given=given)
        self._startup.mark("checkpoint load")
        self._total_steps = self.schedule.total_steps = self.sampler.last_step(self.step, self.config)
        if not rebuilt:
            self._resumed = state is not None
            log_run_start(self.config, self.env, self.sampler, model=self.raw_model, amp=self.precision.autocast,
                          total_steps=self._total_steps, num_workers=self.num_workers,
                          builtin_model=self.checkpointer.builtin_model, builtin_data=self.checkpointer.builtin_data)
        self._wrap(doctor)
        self._startup.mark("DDP preflight")
        if state is not None:
            self.checkpointer.restore_rng(state, self.step)
        self._build_run_health()

    def _restore(self, *, load: bool, given: dict | None = None) -> dict | None:
        """The checkpoint to resume from (or ``given``, a state healing in place brought), loaded
        into every stateful piece (the RNG comes last, after the DDP preflight, which must not
        consume it)."""
        cfg, env = self.config, self.env
        self.step = self._tokens_total = 0
        self.skips = SkipBudget(cfg.recovery.max_errors_per_epoch)
        self.spike_guard = SpikeGuard(cfg.spike, checkpoint_dir=cfg.checkpoint.dir,
                                       exclude_samples=cfg.data.exclude_samples, is_main=env.is_main)
        self.spike_guard.attach(self.sampler)
        self.comm_hook = CommHook(cfg.ddp, env=env, seed=cfg.train.seed)
        self.checkpointer.attach(cfg, {
            "trainer": _Saved(self._state_dict, self._load_state_dict), "model": self.raw_model,
            "optimizer": self.optimizer, "scaler": self.precision.scaler, "schedule": self.schedule,
            "sampler": self.sampler, "stream": self.stream, "skips": self.skips, "spike_guard": self.spike_guard,
            "comm_hook": self.comm_hook, **self._user_state, **self.callbacks.stateful()})
        state = given if given is not None else self.checkpointer.load() if load else None
        if state is not None:
            self.checkpointer.restore(state)
            log.info("%s step %d (epoch %d, sample %d of the epoch)", "resumed from" if given is None else
                     self._regrouped or "joined the run in place at", self.step, self.sampler.epoch,
                     self.sampler.consumed)
            self.spike_guard.adopt_recorded()
        if load and given is None:
            guard_restart_loop(cfg, env, self.step)
        if self.sampler.steps_remaining() == 0:  # saved at the end of an epoch
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self.skips.new_epoch()
        if process_group.group_restarts() > 0 and given is None:
            apply_recorded_micro_batch(self.sampler, cfg.checkpoint.dir)
        return state

    def _say_where_the_run_starts(self, *, resumed: bool) -> None:
        """One line when ``checkpoint.resume`` found nothing to continue: no checkpoint, or a run
        that has finished (a run to continue is named by the checkpoint's "resumed from" line)."""
        ckpt = self.config.checkpoint
        if not resumed:
            if ckpt.resume == "auto":
                log.info("checkpoint.resume=auto: no checkpoint in %s; starting a new run at step 0", ckpt.dir)
            return
        if self._stopped_here():
            log.info("the run in %s stopped early at step %d (%s): nothing to do but its final save (raise "
                     "train.max_steps to go on, or set checkpoint.resume=none to start afresh)", ckpt.dir, self.step,
                     self._stopped_by)
        elif self._stopped_at == self.step < self._total_steps:
            changed = (f"the run is now {self._total_steps} steps long" if self._total_steps != self._stopped_total
                       else f"train.target_loss is now {self.config.train.target_loss!r}")
            log.info("the run in %s stopped early at step %d (%s); %s: training on", ckpt.dir, self.step,
                     self._stopped_by, changed)
        elif self._finished():
            log.info("the run in %s finished at step %d: nothing to do (raise train.max_steps or train.num_epochs "
                     "to go on, or set checkpoint.resume=none to start afresh)", ckpt.dir, self.step)

    def _global_tokens(self, mine: int) -> int:
        """The step's tokens on every rank, from this rank's: times the world size, or for an uneven
        split (a rank holds more or fewer samples than others) scaled by the global batch's samples."""
        if self.sampler.uneven is None:
            return mine * self.env.world_size
        return round(mine * self.sampler.global_batch / self.sampler.rank_batch)

    def _finished(self) -> bool:
        """The run has trained all its steps (not an early stop: see _stopped_here)."""
        return self.step >= self._total_steps or self.sampler.epoch >= self.config.train.num_epochs

    def _build_model(self, model: torch.nn.Module | None) -> None:
        cfg = self.config
        torch.manual_seed(cfg.train.seed)
        self.raw_model = (GPT(GPTConfig.from_train_config(cfg)) if model is None else model).to(self.env.device)
        if model is not None:  # the built-in GPT tiles its own MLP
            tile_user_mlps(self.raw_model, cfg.memory.tiled_mlp_chunks, cfg.memory.tiled_mlp_modules)
        self.activation_checkpointing = enable_checkpointing(self.raw_model, cfg.memory.activation_checkpointing,
                                                              cfg.memory.activation_checkpointing_modules)

    def _build_data(self) -> None:
        if self.env.distributed:
            check_same_datasets(self.train_dataset, self.val_dataset)
        self.sampler, self.stream, self.num_workers = build_stream(self.train_dataset, self.config, self.env,
                                                                     self.val_dataset)

    def _wrap(self, doctor: bool) -> None:
        cfg, env = self.config, self.env
        self.model, self._report, self._decision = prepare_model(
            lambda: policy.prepare(self.raw_model, self._peek, self.loss_fn, self._autocast, cfg,
                                   env.device, distributed=env.distributed, doctor=doctor,
                                   comm_hook=self.comm_hook),
            self.sampler, cfg.checkpoint.dir, oom_recovery=oom_recovery_enabled(cfg, env.device))
        self.model = self.model if doctor else compile_model(self.model, cfg.compile)

    def _build_run_health(self) -> None:
        """What surrounds a step, on the event bus in this order (framework/train/events.py): the
        peer monitor (first, so that it beats before anything else runs at the start), the
        step-start buffers, the watchdog (armed at a step's start, disarmed first at its end), the
        straggler timing and check, the spike guard; then (in ``train``) the sample and step logs;
        then fault injection, the user's callbacks, the start-up clock and the consistency check,
        which so sees a fault or a callback of the same step (and skips a step about to be rolled
        back, as the loop did before it listened)."""
        cfg, env = self.config, self.env
        self.watchdog = Watchdog(cfg.recovery, log_file=log_file_stream(self.log_path), rank=env.rank,
                                 world_size=env.world_size, store=process_group.STORE)
        self.stragglers = StragglerMonitor(cfg.straggler, env=env, phase=self.watchdog.phase)
        self.step_start_buffers = StepStartBuffers(self.raw_model)
        self.consistency = ConsistencyCheck(cfg.recovery, model=self.raw_model, device=env.device,
                                            distributed=env.distributed, phase=self.watchdog.phase,
                                            skip=lambda: self.spike_guard.pending is not None)
        # A heal counts as a restart: a planned fault fires in the first generation only.
        self.faults = FaultPlan(cfg.recovery.fault_inject, env.rank,
                                process_group.group_restarts() + self._heals + self._joined)
        self.peers = PeerMonitor(cfg.recovery, env=env, store=process_group.STORE, checkpoint_dir=cfg.checkpoint.dir,
                                 on_silent=process_group.stop_silent_peer if process_group.MEMBERSHIP else None,
                                 breaker=collectives.BREAKER)
        for listener in (self.peers, self.step_start_buffers, self.watchdog, self.stragglers, self.spike_guard,
                         self.faults, self.callbacks, self._startup, self.consistency):
            self.events.attach(listener)
        self.train_step = TrainStep(cfg, model=self.model, raw_model=self.raw_model, optimizer=self.optimizer,
                                    precision=self.precision, schedule=self.schedule, loss_fn=self.loss_fn, env=env,
                                    sampler=self.sampler, stream=self.stream, events=self.events, skips=self.skips,
                                    lr_factor=self.spike_guard.lr_factor, timer=self.stragglers.timer,
                                    reseed=self._seed_step)
        self.evaluator = Evaluator(cfg.eval, model=self.raw_model, dataset=self.val_dataset, loss_fn=self.loss_fn,
                                   batch_size=cfg.data.batch_size, env=env, autocast=self._autocast,
                                   sampler=self.sampler, events=self.events)

    def _peek(self) -> list:
        return self.stream.peek(2, self.env.device)

    def _autocast(self):
        return self.precision.context()

    def _state_dict(self) -> dict:
        return {"step": self.step, "tokens_total": self._tokens_total, "eval_owed": self._eval_owed,
                "evaluated_step": self._evaluated_step, "evaluated_loss": self._evaluated_loss,
                "stopped_at": self._stopped_at, "stopped_by": self._stopped_by, "stopped_total": self._stopped_total}

    def _load_state_dict(self, state: dict) -> None:
        self.step, self._tokens_total = int(state["step"]), int(state["tokens_total"])
        self._eval_owed = int(state.get("eval_owed", -1))
        self._evaluated_step = int(state.get("evaluated_step", -1))
        self._evaluated_loss = state.get("evaluated_loss")
        self._stopped_at, self._stopped_by = int(state.get("stopped_at", -1)), str(state.get("stopped_by", ""))
        self._stopped_total = int(state.get("stopped_total", 0))

    # --- the public steps --------------------------------------------------------------------

    def _joiners_waiting(self) -> bool:
        """Rank 0 of a run that heals in place: a replica asks to join (one store lookup a step)."""
        membership = process_group.MEMBERSHIP
        return bool(membership is not None and self.env.is_main and membership.wanted(process_group.GENERATION))

    def forward_backward(self, micro_batches: list) -> torch.Tensor:
        return self.train_step.forward_backward(micro_batches, self.step)

    def optimizer_step(self, loss: torch.Tensor, *, stop: bool = False, preempt: bool = False):
        return self.train_step.optimizer_step(loss, self.step, stop=stop, preempt=preempt,
                                               save_due=self.checkpointer.time_due(), grow=self._joiners_waiting())

    def evaluate(self) -> float | None:
        return self.evaluator.run(self.step)

    def save_checkpoint(self, *, blocking: bool = False) -> None:
        self.checkpointer.save(self.step, blocking=blocking)

    def request_stop(self) -> None:
        """End the run after the current step, with the final evaluation and save. Every rank must
        call it at the same step (a callback that decides on one rank agrees with the others first)."""
        self._stop_requested = True
        self._record_stop(requested=True)  # in any checkpoint of this step from now on

    # --- the loop ----------------------------------------------------------------------------

    def train(self) -> dict:
        """Run to max_steps, num_epochs or target_loss, or until preempted; returns the summary
        (rank 0 also writes it)."""
        with self._fatal_on_error():
            while True:
                try:
                    summary = self._train()
                    break
                except Healing as healing:
                    self._heal(healing)
                except Growing:
                    self._grow()
        self.close()
        if summary["agent_lost"]:
            saved = "saved a checkpoint of" if summary["preempted"] else "finished at"
            raise process_group.PeerLost(
                f"a torchrun agent of this run died; the run {saved} step {summary['steps']}: exiting with "
                f"{process_group.EXIT_PEER_LOST} so that the surviving agents restart or end now")
        return summary

    def _train(self) -> dict:
        cfg, env = self.config, self.env
        if not self._heals:
            self._say_where_the_run_starts(resumed=self._resumed)
        # A relaunch of a finished run whose checkpoint in checkpoint.dir holds its last step's
        # evaluation: that checkpoint is the final save, not written again (the export is: it may
        # have been cut short). One read from elsewhere (resume=PATH) is written here.
        loaded = self.checkpointer.loaded_from
        self._final_on_disk = (self._resumed and not self._heals and not self._stopped_here() and self._finished()
                               and self._evaluated_step == self.step and loaded is not None
                               and loaded.resolve().parent == Path(self.config.checkpoint.dir).resolve())
        self.checkpointer.start_clock()
        step_log = StepLog.open(cfg, env, total_steps=self._total_steps, initial_step=self.step, health=lambda: {
            **self.spike_guard.scalars(), **self.stragglers.scalars(), "health/skipped_steps": self.skips.total})
        if self._evaluated_step == self.step:  # this step's evaluation is in the checkpoint: not run again
            step_log.val_loss = self._evaluated_loss
        membership, generation = process_group.MEMBERSHIP, process_group.GENERATION
        samples_log = SampleLog(Path(cfg.logging.dir) / f"samples_rank_{env.rank}.jsonl"
                                if cfg.logging.record_samples else None, sampler=self.sampler,
                                world_size=env.world_size if env.is_main else None,
                                outdated=(lambda: membership.outdated(generation)) if generation is not None else None)
        if cfg.logging.record_samples and env.is_main:
            SampleLog.purge_absent_ranks(Path(cfg.logging.dir), env.world_size, self.step + 1)
        self.model.train()
        self._preemption.started = True
        if self._preemption.installed and self._debug:
            # Only with --debug: faulthandler reads the other threads' frames while they run, and
            # segfaulted a worker in 1 of 4 SIGTERMs here, before its preemption save.
            self.watchdog.dump_on(signal.SIGTERM)
        for listener in (samples_log, step_log):
            self.events.attach(listener, before=self.faults)
        if self._heals:  # the others (the user's callbacks) heard it at the start
            self.peers.train_start()
        else:
            self.events.train_start()
        try:
            with GcPolicy(cfg.memory.cleanup_interval, env.device) as gc_policy:
                # An owed evaluation may ask for a stop (transformers' EarlyStoppingCallback): then
                # the run ends at this step, as it would have without the preemption.
                preempted = (self._eval_owed == self.step and self._evaluate_mid_run(step_log)) or (
                    not self._stopped_here() and self._loop(step_log, gc_policy))
            if not preempted:
                preempted = self._final_evaluation_and_save(step_log)
            self.checkpointer.close()
            self.watchdog.close()
        finally:
            for listener in (samples_log, step_log):
                self.events.detach(listener)
            step_log.close()
            samples_log.close()
        return self._finish(step_log, preempted)

    def _loop(self, step_log: StepLog, gc_policy: GcPolicy) -> bool:
        """Train until the run stops; True when it stopped because of a preemption request."""
        while self.step < self._total_steps and self.sampler.epoch < self.config.train.num_epochs:
            self._seed_step(self.step)  # a new epoch's loader draws its workers' seeds
            self.stream.start_epoch()
            while self.sampler.steps_remaining() > 0:
                result = self._run_step()
                if result is None:  # a stream ran out (on some rank): its epoch ended with the last step
                    self._save(epoch_ended=True)
                    break
                if self.spike_guard.pending is not None and self._roll_back(step_log):
                    continue
                gc_policy.step(self.step)
                agreed = result.agreed
                if agreed.preempt:
                    self._save_preempted()
                    return True
                if self._should_stop(agreed):
                    self._record_stop(requested=agreed.stop or self._stop_requested)
                    return False
                # The evaluation first, as transformers.Trainer does: the step's checkpoint holds what it
                # changed (an EarlyStoppingCallback's counter, the best metric, a stop it asked for).
                if self.evaluator.should_run(self.step) and self._evaluate_mid_run(step_log):
                    return True
                self._save(epoch_ended=self.sampler.steps_remaining() == 0, timed=agreed.save_due)
                if agreed.grow:  # the step is done, and saved if due: the newcomers join here
                    raise Growing(self.step)
                if self._stop_requested:  # asked at the evaluation (transformers' EarlyStoppingCallback)
                    return False
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self.skips.new_epoch()
        return False

    def _roll_back(self, step_log: StepLog) -> bool:
        spike, self.spike_guard.pending = self.spike_guard.pending, None
        restored = self.checkpointer.roll_back(before=spike.step)
        self.spike_guard.roll_back(spike, restored)
        if restored is not None:
            self.stream.rewind()
            step_log.purge_from(self.step + 1)
            self._total_steps = self.schedule.total_steps = self.sampler.last_step(self.step, self.config)
        return restored is not None  # False: nothing to go back to, and the step's bookkeeping runs

    def _save(self, *, epoch_ended: bool, timed: bool = False) -> None:
        if self.checkpointer.should_save(self.step, self.sampler.epoch, epoch_ended, timed=timed):
            with self.watchdog.phase("checkpoint save", scale=10):
                self.checkpointer.save(self.step)
                self.events.save(self.step)

    def _run_step(self) -> StepResult | None:
        """One optimizer step: its data, forward and backward, the optimizer step, then ``step_end``
        on the event bus (the logs, the spike guard, the checks: framework/train/events.py). None
        when the data ran out."""
        self._seed_step(self.step)
        self.events.step_start(self.step)
        micro = self.stream.next_step()
        self.events.data_ready(self.step, micro)
        if micro is None:
            return None
        with self._if_a_peer_is_lost(survivor_checkpoint=True):
            loss = self.train_step.forward_backward_with_retry(micro, self.step)
        self.events.gradients(self.step, self.raw_model)
        with self._if_a_peer_is_lost(survivor_checkpoint=False):  # in the agreement, before the optimizer steps
            agreed, lr, grad_norm = self.optimizer_step(loss, preempt=self._preemption.requested is not None)
        process_group.set_steady_timeout(self.config.ddp.init_timeout_s or self.config.ddp.timeout_s,
                                         self.config.ddp.timeout_s)
        indices = self.sampler.advance()
        self.step += 1
        tokens = self._global_tokens(sum(num_tokens(b) for b in micro))
        self._tokens_total += tokens
        result = StepResult(self.step, self.sampler.epoch, agreed, lr, grad_norm, tokens, indices)
        self.events.step_end(result, self.raw_model)
        return result

    def _seed_step(self, step: int) -> None:
        """Every rank's generators from (train.seed, rank, step), before each step and each retry
        of it (TrainStep's ``reseed``): what a step draws is known without any saved random state
        (a survivor checkpoint has no other rank's), and nothing drawn between steps (an
        evaluation, a callback) shifts it."""
        rng.seed_step(self.config.train.seed, self.env.rank, step)

    @contextlib.contextmanager
    def _if_a_peer_is_lost(self, *, survivor_checkpoint: bool):
        """A step's forward and backward, and its agreement, change nothing that a checkpoint holds
        but buffers that a forward updates, copied at the step's start (StepStartBuffers); the
        generators are seeded anew at each step. When a collective in them fails because a peer
        process went away (killed, or its node lost), this rank still holds the whole state of the
        last step that every rank finished. A run that heals in place goes on from it (``Healing``);
        else, with ``survivor_checkpoint``, this rank writes that step's checkpoint alone before the error
        ends it, so that the restart redoes no step (Checkpointer.save_survivor)."""
        try:
            yield
        except Exception as err:
            # Healing in place, a collective that timed out on a member found stopped (killed by
            # lost_members) is a peer's loss too: with recovery.peer_timeout_s=0, ddp.timeout_s names it.
            if markers.peer_lost(err) or (process_group.MEMBERSHIP is not None and markers.timed_out(err)
                                          and process_group.lost_members(settle_s=2.0)):
                if process_group.MEMBERSHIP is not None:
                    self._raise_healing(err)
                if survivor_checkpoint:
                    with self.peers.holding():
                        self._save_survivor_checkpoint()
            raise

    def _survivor_model_state(self, *, on_disk: bool) -> tuple[dict | None, str | None]:
        """The model's state as at the step's start, or None and why this rank cannot give the
        step's whole state alone."""
        model_state, buffers_not = self.step_start_buffers.model_state(is_main=self.env.is_main)
        why_not = (
            "checkpoint.save_on_peer_loss=false" if on_disk and not self.config.checkpoint.save_on_peer_loss else
            "PowerSGD's state is every rank's" if self.comm_hook.state is not None else
            "a stream's dataset state is every rank's" if getattr(self.stream, "stateful", False) else
            "the state of the user's stateful objects mid-step is unknown"
            if any(getattr(obj, "changes_mid_step", True)
                   for obj in (*self._user_state.values(), *self.callbacks.stateful().values())) else
            buffers_not if model_state is None else None)
        return (model_state, None) if why_not is None else (None, why_not)

    def _raise_healing(self, err: BaseException) -> None:
        model_state, why_not = self._survivor_model_state(on_disk=False)
        state = None if why_not else self.checkpointer.survivor_state(model_state=model_state)
        raise Healing(self.step, state, why_not, err) from err

    def _heal(self, healing: Healing) -> None:
        """Form the next generation with the survivors, take the newest state one of them holds,
        and rebuild what depends on the world size (framework/ddp/heal.py)."""
        started, lost_in = time.monotonic(), healing.step + 1
        old = self.env
        # The failed step's frames (its activations and autograd graph) go now, not after the rebuild.
        healing.__traceback__ = healing.cause = healing.__cause__ = healing.__context__ = None
        self._stop_run_health()
        self._drop_ddp_wrapper()
        process_group.drop_broken_group()  # first: a survivor blocked on this one is released at once
        self.optimizer.zero_grad(set_to_none=True)  # the lost step's partial gradients
        named = collectives.BREAKER.lost() if collectives.BREAKER is not None else []  # silent on another host
        generation = process_group.MEMBERSHIP.after_loss(process_group.GENERATION,
                                                         wait_s=self.config.recovery.peer_timeout_s or 10.0,
                                                         lost=[process_group.GENERATION.members[r] for r in named],
                                                         silent_s=self.peers.dead_after_s)
        replica = process_group.MEMBERSHIP.replica
        if replica not in generation.members:  # e.g. frozen on another host, and continued since
            self._end_restart(
                f"replica {replica} was left out of generation {generation.number} ({list(generation.members)}): its "
                "peers named it lost (frozen, cut off, or too late to say it was alive) and heal in place without it; "
                f"exiting with {process_group.EXIT_PEER_LOST} so that its torchrun starts it again to rejoin")
        self._regrouped = "healed in place at"
        source = self._regroup(generation, healing.state, healing.step)
        formed = self._formed_at
        log.warning("healed in place: a peer was lost in step %d; generation %d goes on with %d of %d ranks (this "
                    "rank %d -> %d) from step %d (rank %d's state) in %.2f s (the group formed in %.2f s)", lost_in,
                    generation.number, self.env.world_size, old.world_size, old.rank, self.env.rank, self.step,
                    source, time.monotonic() - started, formed - started)

    def _grow(self) -> None:
        """After a step every rank agreed to grow at: rank 0 proposes the generation with the
        replicas that asked to join; rank 0's state goes to the newcomers by broadcast
        (``newest_state``), which take it in ``process_group.setup``."""
        started, old = time.monotonic(), self.env
        membership = process_group.MEMBERSHIP
        # Rank 0 proposes while its heartbeat still beats: should it die before, the others find
        # it silent (on another host) instead of waiting for a proposal that never comes.
        proposed = membership.grow(process_group.GENERATION, membership.wanted(process_group.GENERATION)) \
            if self.env.is_main else None
        state = self.checkpointer.survivor_state(model_state=self.raw_model.state_dict())  # the step is done
        self._stop_run_health()
        process_group.release_ddp_holders(dist.group.WORLD)
        self._drop_ddp_wrapper()
        stopped = time.monotonic()
        try:
            generation = proposed or membership.grow(process_group.GENERATION, None)
        except ProposerLost as err:  # a grow has no heal: the old group is whole but for rank 0
            self._end_restart(f"{err}: exiting with {process_group.EXIT_PEER_LOST}, so that every rank restarts "
                              "from the checkpoint through the run's store")
        self._regrouped = "grew in place at"
        self._regroup(generation, state, self.step, broken=False)
        log.warning("grew in place after step %d: generation %d trains on %d ranks (was %d; this rank %d -> %d); the "
                    "members paused %.2f s (stopping %.2f s, the group formed %.2f s, the state sent and the rest "
                    "rebuilt %.2f s)", self.step, generation.number, self.env.world_size, old.world_size, old.rank,
                    self.env.rank, time.monotonic() - started, stopped - started, self._formed_at - stopped,
                    time.monotonic() - self._formed_at)

    def _regroup(self, generation, state: dict | None, step: int, *, broken: bool = True) -> int:
        """Form ``generation``'s group (``broken``: the old one failed, and is parked), take the
        newest state a member holds (this rank's ``state`` of ``step``, or a newer one's) and
        rebuild around it; returns the rank it came from. A member that does not come within
        ``FORM_TIMEOUT_S`` fails the formation: every rank then restarts from the checkpoint."""
        self.env = process_group.form(generation, self.config.ddp.backend,
                                      min(self.config.ddp.timeout_s, process_group.FORM_TIMEOUT_S), broken=broken,
                                      steady_s=self.config.ddp.timeout_s)
        self._formed_at = time.monotonic()
        self.log_path = setup_logging(self.env.rank, self.config.logging.dir, debug=self._debug,
                                      file_rank=process_group.MEMBERSHIP.replica)
        try:
            state, source = newest_state(state, step, rank=self.env.rank, world_size=self.env.world_size)
        except NothingToHealFrom:  # every member sees the same exchange: all resume from the checkpoint
            log.warning("no member of generation %d holds a state to go on from: it resumes from the checkpoint",
                        generation.number)
            state, source = None, -1
        self._heals += 1
        try:
            self.checkpointer.take_over(self.env, resuming=state is None)
        except CheckpointDirLocked as err:  # rank 0 named lost, frozen or cut off, still holds it
            self._end_restart(f"rank 0 was lost, and its process still holds checkpoint.dir's lock ({err}): frozen or "
                              "cut off, it may yet write there, so this generation cannot save; exiting with "
                              f"{process_group.EXIT_PEER_LOST} so that the run restarts once that process is gone")
        self._build_training(given=state, rebuilt=True)
        if self.sampler.uneven is not None:
            log.info("the global batch of %d samples splits unevenly: %s", self.sampler.global_batch,
                     self.sampler.describe())
        return source

    def _end_restart(self, message: str, *, stop_agent: bool = False) -> None:
        """End this process with EXIT_PEER_LOST (``PeerLost``), NODE_LOST saying why: the
        launcher exits 75 naming it. ``stop_agent``: and stop this replica's torchrun (healing in
        place: each replica is a torchrun job of its own), which would start it again in vain."""
        try:
            markers.write(self.config.checkpoint.dir, markers.NODE_LOST, message)
        except OSError as err:
            log.error("could not write %s: %s", markers.NODE_LOST, err)
        if stop_agent:
            if process_group.stop_own_agent():
                message += " and its torchrun with it, instead of restarting it again"
            log.error("%s", message)
        raise process_group.PeerLost(message)

    def _stop_run_health(self) -> None:
        """Detach and stop what surrounds a step (``_build_run_health`` builds it anew)."""
        for listener in (self.peers, self.step_start_buffers, self.watchdog, self.stragglers, self.spike_guard,
                         self.faults, self.callbacks, self._startup, self.consistency):
            self.events.detach(listener)
        self.peers.close()
        self.watchdog.close()
        self.stream.shutdown()

    def _save_survivor_checkpoint(self) -> None:
        step = self.step
        model_state, why_not = self._survivor_model_state(on_disk=True)
        if step == 0 and self.config.checkpoint.save_on_peer_loss:
            why_not = "no step finished since the start"
        if why_not is not None:
            log.info("a peer went away in step %d: no survivor checkpoint of step %d (%s)", step + 1, step, why_not)
            return
        start = time.monotonic()
        try:
            with self.watchdog.phase("survivor checkpoint", scale=10):
                path = self.checkpointer.save_survivor(step, model_state=model_state)
        except Exception as err:  # noqa: BLE001  (best effort: the peer's loss is the error the run ends with)
            log.error("a peer went away in step %d; the survivor checkpoint of step %d failed: %s: %s", step + 1, step,
                      type(err).__name__, err)
            return
        if path is not None:
            log.warning("a peer went away in step %d: this rank saved step %d, the last step every rank finished, "
                        "alone in %.2f s (%s); a restart continues from it", step + 1, step,
                        time.monotonic() - start, path.name)

    def _should_stop(self, agreed: Agreement) -> bool:
        target = self.config.train.target_loss
        return (self.step >= self._total_steps or agreed.stop or self._stop_requested
                or (target > 0 and agreed.loss <= target))

    def _record_stop(self, *, requested: bool) -> None:
        """An early stop (before the run's last step) goes into the trainer's state, so into any
        checkpoint of this step: a preemption before the run's end leaves a checkpoint whose resumed
        run ends there too, rather than training past the stop."""
        if self.step >= self._total_steps:
            return
        self._stopped_at, self._stopped_total = self.step, self._total_steps
        self._stopped_by = ("a stop requested" if requested
                            else f"train.target_loss={self.config.train.target_loss!r} reached")

    def _stopped_here(self) -> bool:
        """The checkpoint's run stopped early at this step: a stop requested (by the user's code, a
        callback), or train.target_loss met while the target is still the same. A run made longer
        (train.max_steps, train.num_epochs), or with another target, trains on: the next step's
        loss, and the callbacks, decide again."""
        return (self._stopped_at == self.step < self._total_steps == self._stopped_total
                and self._stopped_by in ("a stop requested",
                                         f"train.target_loss={self.config.train.target_loss!r} reached"))

    # --- the ending --------------------------------------------------------------------------

    def _final_evaluation_and_save(self, step_log: StepLog) -> bool:
        """The final evaluation and save; True when a preemption request came in after the last
        step or during the evaluation, in which case (agreed by every rank) the evaluation is left
        to the resumed run."""
        cfg, env = self.config, self.env
        if step_log.loss is not None and 0 < cfg.train.target_loss and step_log.loss <= cfg.train.target_loss:
            log.info("target_loss %g reached at step %d (loss %.4f)", cfg.train.target_loss, self.step, step_log.loss)
        preempted = agree(loss=torch.zeros((), device=env.device), world_size=env.world_size,
                          distributed=env.distributed, preempt=self._preemption.requested is not None).preempt
        evaluated = self._evaluated_step == self.step  # a stop requested at this step's evaluation
        if preempted or not (evaluated or self._evaluate_and_record(step_log)):
            self._save_preempted()
            return True
        if self._final_on_disk:
            log.info("the checkpoint of step %d is the run's final save: not written again", self.step)
            return False
        with self.watchdog.phase("checkpoint save", scale=10):
            self.events.save(self.step)
            self.checkpointer.save_final(self.step)
        return False

    def _evaluate_and_record(self, step_log: StepLog) -> bool:
        """Evaluate at this step and record the validation loss; False, with nothing recorded, when
        a preemption request stopped the evaluation (every rank at the same batch)."""
        with self.watchdog.phase("evaluation", scale=self.evaluator.batches):
            val_loss = self.evaluator.run(self.step, stop=lambda: self._preemption.requested is not None)
        if self.evaluator.interrupted:
            return False
        step_log.record_val(self.step, val_loss)
        self._evaluated_step, self._evaluated_loss = self.step, val_loss
        self.events.evaluated(self.step, val_loss)
        return True

    def _evaluate_mid_run(self, step_log: StepLog) -> bool:
        """An evaluation between steps; True when a preemption request stopped it. The step is then
        saved with its evaluation owed (``eval_owed``, in the trainer's state): a run resumed there
        runs it first."""
        with step_log.paused():
            stopped = not self._evaluate_and_record(step_log)
        self._eval_owed = self.step if stopped else -1
        if stopped:
            self._save_preempted()
        return stopped

    def _save_preempted(self) -> None:
        with self.watchdog.phase("preemption save", scale=10):
            self.save_checkpoint(blocking=True)
        if self.env.is_main:
            markers.write(self.config.checkpoint.dir, markers.PREEMPTED, f"preempted at step {self.step}")
        log.warning("preempted: checkpoint of step %d saved; exiting", self.step)

    def _finish(self, step_log: StepLog, preempted: bool) -> dict:
        """Export the final weights (unless preempted) and write summary.json (rank 0); returns the summary."""
        cfg, env = self.config, self.env
        summary = step_log.summary(step=self.step, epochs=self.sampler.epochs_done(), world_size=env.world_size,
                                   model_sha256=model_sha256(self.raw_model), preempted=preempted,
                                   skipped_steps=self.skips.total, restarts=process_group.group_restarts(),
                                   **self.spike_guard.summary())
        # After the last save, so that an agent's death up to here is known to every rank: they all
        # exit non-zero then (train raises PeerLost), and no surviving agent waits in torchrun's
        # exit barrier for the dead one. Before the export, which only rank 0 does: the others
        # would wait for it inside a collective, whose timeout a slow export of a large model
        # could outlast (docs/known-limits.md: an agent's death during the export).
        summary["agent_lost"] = agree(loss=torch.zeros((), device=env.device), world_size=env.world_size,
                                      distributed=env.distributed, agent_lost=process_group.agent_gone()).agent_lost
        if summary["agent_lost"] and env.is_main:
            markers.write(cfg.checkpoint.dir, markers.NODE_LOST, f"a torchrun agent died; the run reached step "
                                                                   f"{self.step}")
        if not preempted:
            self.events.export(self.step)
        if env.is_main and not preempted:
            export.save_final_weights(self.raw_model, cfg)  # final_model.pt and the safetensors export
        if env.is_main:
            atomic.write_bytes(Path(cfg.logging.dir) / "summary.json", json.dumps(summary, indent=2).encode())
            if process_group.MEMBERSHIP is not None and not preempted:
                process_group.MEMBERSHIP.finish(self.step)
        log.info("%s: %s", "preempted" if preempted else "done", json.dumps(summary), extra=DETAIL)
        log.info("%s: %s (all of it in %s)", "preempted" if preempted else "finished", summary_line(summary),
                 Path(cfg.logging.dir) / "summary.json")
        self.events.train_end(summary)
        return summary

    def _drop_ddp_wrapper(self) -> None:
        """The DDP wrapper holds the process group: without it, teardown frees the group (see there)."""
        if getattr(self, "env", None) is not None and self.env.distributed:
            self.model = getattr(self, "raw_model", None)
            if getattr(self, "train_step", None) is not None:
                self.train_step.model = self.raw_model

    def _close_at_exit(self) -> None:
        """At interpreter exit the group goes whoever created it (framework.hf joins it before the
        trainer): a trainer still alive then (a reference cycle not yet collected) must not hold it
        into the finalisation, where torch 2.13 aborts now and then ("terminate called")."""
        self._drop_ddp_wrapper()
        self.close()

    def close(self, *, release_model: bool = False) -> None:
        """Wait for the checkpoint write in flight, release the loader's workers and, if this
        trainer created it, the process group (``model`` is then ``raw_model``). Safe to call more
        than once; called at interpreter exit if still open. ``release_model``: drop the DDP
        wrapper also when the group is the caller's, who may destroy it next (a DDP module freed
        after its group was destroyed hangs or aborts); ``model`` is then ``raw_model``."""
        if release_model:
            self._drop_ddp_wrapper()
        if getattr(self, "checkpointer", None) is not None:
            try:
                self.checkpointer.close()
            except (OSError, FatalError) as err:  # raised already where it mattered; the run is ending anyway
                log.error("the last checkpoint write failed: %s", err)
        if getattr(self, "stream", None) is not None:
            self.stream.shutdown()
        if getattr(self, "watchdog", None) is not None:
            self.watchdog.close()
        if getattr(self, "peers", None) is not None:
            self.peers.close()
        if self._owns_process_group:
            self._drop_ddp_wrapper()
            process_group.teardown()
        self._preemption.restore()  # last: a signal until here is recorded, not fatal
