"""The training state on disk: what a checkpoint holds, when to save one, which one to resume
from, and restoring it.

A checkpoint is the union of the stateful pieces' ``state_dict()``s (as in torchtitan) plus
every rank's RNG state, gathered to rank 0, which writes it. Everything is plain (tensors, ints,
floats, strings, lists, dicts) so it loads under ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from .. import __version__
from ..config import RESUME, TrainConfig, as_dict, dotted
from ..ddp import process_group
from ..ddp.policy import unwrap
from ..resilience import markers
from ..resilience.markers import FatalError
from ..train.events import Listener
from . import checkpoint_files, export, rng
from .checkpoint_files import CheckpointDirLocked, CheckpointError, CheckpointStore, CheckpointUnreadable

log = logging.getLogger(__name__)

FORMAT = 2
"""The checkpoint format written; format 1 (framework 0.1.0 before the state had owners) is read too."""


def _unreadable(message: str, env) -> OSError | CheckpointError:
    """The error for a checkpoint that cannot be read now (EIO, ESTALE, EACCES), raised on every rank
    (a collective). It may pass, so while torchrun has a restart left the run fails retriably and
    the restart reads again; the last restart stops with a CheckpointError (a FATAL)
    instead, which names the file, rather than fail the same way once more with a traceback (or
    start afresh beside a checkpoint it never read). The fewest restarts any node's agent has left
    decides: the agents count their own, and an agent restarted for another node's failure does
    not count it (see process_group.agent_restarts)."""
    left = torch.tensor([process_group.agent_restarts_left()], device=env.device)
    if env.distributed:
        dist.all_reduce(left, op=dist.ReduceOp.MIN)
    if int(left) > 0:
        return CheckpointUnreadable(f"{message}; a restart tries again")
    return CheckpointError(f"{message}; no restart is left to try again (torchrun --max-restarts), and the run "
                           "does not start afresh beside a checkpoint it could not read: make it readable, or "
                           "move it out of the checkpoint directory, and launch again")


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def check_model_shapes(model_state: dict, model: torch.nn.Module) -> None:
    """Raise CheckpointError listing every key of ``model_state`` that is missing, unexpected, or
    shaped differently from ``model``'s state_dict."""
    expected = {k: tuple(v.shape) for k, v in unwrap(model).state_dict().items()}
    found = {k: tuple(v.shape) for k, v in model_state.items()}
    problems = [f"{k} is {found[k]} in the checkpoint but {expected[k]} in the model"
                for k in expected if k in found and found[k] != expected[k]]
    problems += [f"{k} is missing from the checkpoint" for k in expected if k not in found]
    problems += [f"{k} is in the checkpoint but not in the model" for k in found if k not in expected]
    if not problems:
        return
    shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
    hint = ""
    prefixes = [p for p in ("module.", "_orig_mod.") if found and all(k.startswith(p) for k in found)]
    if prefixes:
        hint = (f" Every checkpoint key starts with {prefixes[0]!r}: it was saved from a wrapped model;"
                f" save unwrap(model).state_dict() instead.")
    raise CheckpointError("checkpoint does not fit the model: " + "; ".join(shown) + "." + hint)


# Parts added to format 2 after its first release: a file without them loads them empty.
_LATER_PARTS = {"comm_hook": {}, "spike_guard": {}}


def upgrade(state: dict) -> dict:
    """``state`` in the current format; CheckpointError for a format this version cannot read."""
    version = state.get("format")
    if version == FORMAT:
        return {**_LATER_PARTS, **state}
    if version == 1:
        return {**_LATER_PARTS, **state, "format": FORMAT,
                "sampler": {**state["sampler"], "batch_size": state["micro_batch_size"],
                            "accumulation": state["accumulation_steps"], "world_size": state["world_size"]},
                "stream": {"restarts_this_epoch": 0},
                "trainer": {"step": state["step"], "tokens_total": state["tokens_total"]},
                "skips": {"steps": state["skipped_this_epoch"]}}
    raise CheckpointError(f"checkpoint format {version!r} is unknown to framework {__version__} (it reads formats "
                          f"1 to {FORMAT}); was it written by a newer version?")


def config_changes(saved: dict, cfg: TrainConfig, *, builtin_data: bool,
                   builtin_model: bool = True) -> tuple[list[str], list[str]]:
    """The changes from the checkpoint's configuration that cannot be honoured, and those that
    change the result; each as ``key: saved -> now``. Each field declares its class (``RESUME``);
    ``saved`` is nested by section, or flat as checkpoints before sections wrote it. Only the keys
    that apply to this run are compared (a key the checkpoint left out is not)."""
    before = dotted(saved)
    refused, changed = [], []
    for key, value in dotted(as_dict(cfg, builtin_model=builtin_model, builtin_data=builtin_data)).items():
        if key not in before or before[key] == value or RESUME[key] == "neutral":
            continue
        line = f"{key}: {before[key]!r} -> {value!r}"
        if RESUME[key] == "refused" or (RESUME[key] == "refused_builtin_data" and builtin_data):
            refused.append(line)
        elif RESUME[key] == "changes":
            changed.append(line)
    return refused, changed


def _saved_global_batch(state: dict) -> int:
    sampler = state["sampler"]
    if "global_batch" in sampler:  # an uneven split's is not world x micro-batch x accumulation
        return int(sampler["global_batch"])
    return int(sampler.get("world_size", state["world_size"])) * int(sampler.get("batch_size", 0)) * int(
        sampler.get("accumulation", 1))


def gather_rng(distributed: bool, world_size: int) -> list[dict]:
    """Every rank's RNG state, in rank order (a collective: all ranks must call it)."""
    mine = rng.capture()
    if not distributed:
        return [mine]
    states: list = [None] * world_size
    dist.all_gather_object(states, mine)
    return states


def guard_restart_loop(cfg: TrainConfig, env, resumed_step: int) -> None:
    """After an elastic restart: stop with FATAL when more than max_no_progress_restarts restarts
    in a row resumed from the same step (rank 0 counts in checkpoint_dir and tells the others)."""
    if process_group.group_restarts() == 0:
        return
    verdict = [markers.note_restart(cfg.checkpoint.dir, resumed_step, cfg.recovery.max_no_progress_restarts)
               if env.is_main else None]
    if env.distributed:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise FatalError(verdict[0])


def open_store(cfg: TrainConfig, env) -> CheckpointStore:
    """The checkpoint store; rank 0 takes checkpoint_dir's lock, and every rank learns if it
    could not (the others would otherwise wait for it in the first collective). A restart waits
    for a process of its own run that still holds the lock (a survivor of the last restart
    writing its survivor checkpoint, which can outlast the rendezvous's last call) for up to half the
    collective timeout the other ranks wait under meanwhile."""
    error = None
    wait = (cfg.ddp.init_timeout_s or cfg.ddp.timeout_s) / 2 if process_group.group_restarts() > 0 else 0
    try:
        store = CheckpointStore(cfg.checkpoint.dir, keep_last=cfg.checkpoint.keep_last, rank=env.rank,
                                    wait_for_run_s=wait)
    except CheckpointDirLocked as err:
        error = str(err)
    if env.distributed and not process_group.joining():  # a newcomer's rank 0 holds the lock already
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise CheckpointDirLocked(error)
    return store


class StepStartBuffers(Listener):
    """The model's state other than its parameters (persistent buffers and modules' extra state)
    as it stood at the current step's start, for a survivor checkpoint. A step's forward changes some of it
    before any collective can fail: BatchNorm's running statistics in place (in C++ kernels that
    do not bump the tensors' versions), a buffer reassigned out of place (``self.n = self.n + 1``),
    a module's ``get_extra_state()`` that returns a new object each call (fp8 scaling histories).
    So at each step's start the state is read anew by name from ``state_dict`` and copied (a few
    KB for BatchNorm; nothing for the many transformers without such state), with the copy of the
    step before, which tells whether it changes at all. Beyond ``LIMIT`` bytes, or for an extra
    state that cannot be copied, nothing is copied and a survivor checkpoint is not made. On the event bus:
    read at each step's start."""

    LIMIT = 64 * 2**20

    def step_start(self, step: int) -> None:
        self.at_step_start()

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        self.bytes = 0
        self.copies: dict | None = None
        self.before: dict | None = None  # the copies at the previous step's start
        self.why_not: str | None = "no step started yet"
        self.watched = bool(self.read())  # a model with no such state reads nothing at each step

    def read(self) -> dict:
        """The model's state other than its parameters, now, by name (what ``state_dict`` holds)."""
        return {name: v for name, v in self.model.state_dict(keep_vars=True).items() if name not in self.params}

    @property
    def buffers(self) -> dict:
        return self.read()

    def at_step_start(self) -> None:
        if not self.watched:
            return
        state = self.read()
        leaves = [leaf for v in state.values() for leaf in torch.utils._pytree.tree_leaves(v)]
        self.bytes = sum(t.numel() * t.element_size() for t in leaves if torch.is_tensor(t))
        self.before = self.copies
        if self.bytes > self.LIMIT:
            self.copies, self.why_not = None, f"its buffers ({self.bytes / 2**20:.0f} MB) are not copied at each step"
            return
        try:
            self.copies = {name: v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)
                           for name, v in state.items()}
            self.why_not = None
        except Exception as err:  # noqa: BLE001  (an extra state deepcopy cannot copy: no survivor checkpoint)
            self.copies, self.why_not = None, f"its extra state cannot be copied ({type(err).__name__}: {err})"

    def model_state(self, *, is_main: bool) -> tuple[dict | None, str | None]:
        """The model's state_dict with its buffers and extra state as at the step's start, or None
        and why not. Off rank 0 only when they do not change in a step: DDP's buffers are rank 0's."""
        if not self.watched:
            return self.model.state_dict(), None
        if self.copies is None:
            return None, self.why_not
        if not is_main and (self.before is None or self.before.keys() != self.copies.keys()
                            or not all(_same(self.before[name], self.copies[name]) for name in self.copies)):
            return None, "the buffers that a step changes (BatchNorm statistics) are rank 0's"
        return {**self.model.state_dict(), **self.copies}, None


def _same(a, b) -> bool:
    """Whether two copies of a buffer or an extra state are equal (False when it cannot tell)."""
    try:
        leaves_a, spec_a = torch.utils._pytree.tree_flatten(a)
        leaves_b, spec_b = torch.utils._pytree.tree_flatten(b)
        if spec_a != spec_b:
            return False
        return all((torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y))
                   or (not torch.is_tensor(x) and not torch.is_tensor(y) and bool(x == y))
                   for x, y in zip(leaves_a, leaves_b, strict=True))
    except Exception:  # noqa: BLE001  (an object whose == is not a bool: taken as changed)
        return False


class Checkpointer:
    """Saves the union of ``components``' states through ``store`` when the configuration says
    so, and restores it. ``components`` maps a name in the checkpoint to a Stateful; "model"
    must be the unwrapped model.

    ``resume`` chooses the checkpoint of a launch; a restart of the launch (torchrun's restart
    > 0) continues the lineages the launch has written (markers.LINEAGE), and only when they hold
    no checkpoint yet does ``resume`` choose again. A rollback takes only these lineages'
    checkpoints, or the one the run started from."""

    def __init__(self, cfg: TrainConfig, env, store: CheckpointStore, components: dict[str, Stateful], *,
                 builtin_data: bool, builtin_model: bool = True, on_save: Callable[[int], None] | None = None):
        self.cfg, self.env, self.store = cfg, env, store
        self.components = components
        self.builtin_data, self.builtin_model = builtin_data, builtin_model
        self.on_save = on_save
        self.lineages: list[str] = []  # rank 0: the lineages this launch has written in, its current one last
        self.origin: str | None = None  # rank 0: the file in checkpoint_dir the launch started from
        # A generation healed in place resumed from the checkpoint (take_over): like a restart, it
        # continues the launch's own lineage whatever checkpoint.resume chose at the launch's start.
        self.healed_from_disk = False
        self.loaded_from: Path | None = None  # the file the last load() read (every rank knows it)
        self.resumed_lineage: str | None = None  # rank 0: that file's lineage
        self._last_save = time.monotonic()  # checkpoint.every_minutes counts from here

    def attach(self, cfg: TrainConfig, components: dict[str, Stateful]) -> None:
        """The resolved configuration and the pieces to save (a store is opened, and its lock
        taken, before anything else is built)."""
        self.cfg = cfg
        self.components.update(components)

    def should_save(self, step: int, epoch: int, epoch_ended: bool, *, timed: bool = False) -> bool:
        """Whether ``step`` (or the end of ``epoch``) is due; ``timed``: the ranks agreed that
        checkpoint.every_minutes has passed since the last save (``time_due`` on rank 0)."""
        cfg = self.cfg
        return bool(timed or (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0)
                    or (epoch_ended and cfg.checkpoint.every_epochs and (epoch + 1) % cfg.checkpoint.every_epochs == 0))

    def start_clock(self) -> None:
        """checkpoint.every_minutes counts training time from here (the start of the loop: building
        the model, loading a checkpoint and the DDP preflight do not count)."""
        self._last_save = time.monotonic()

    def time_due(self) -> bool:
        """Rank 0: checkpoint.every_minutes of training have passed since the start or the last save
        (the other ranks say False; the step's agreement carries rank 0's answer to every rank)."""
        minutes = self.cfg.checkpoint.every_minutes
        return bool(minutes and self.env.is_main and time.monotonic() - self._last_save >= minutes * 60)

    def save(self, step: int, *, blocking: bool = False) -> None:
        """Every rank calls this at the same step (the RNG states are gathered); rank 0 writes."""
        with self._disk_errors_are_fatal():
            self.store.save(self.state(), step, blocking=blocking)
        self._last_save = time.monotonic()
        if self.on_save is not None:
            self.on_save(step)

    def save_final(self, step: int) -> None:
        """The last save of a run, agreed: when rank 0 cannot write it, every rank stops with the
        error. A rank that exited 0 instead would leave the others' agents waiting for it in the
        restart's rendezvous (on 2 nodes: until torchrun's join timeout)."""
        failed = None
        try:
            self.save(step, blocking=True)
        except FatalError as err:
            failed = err
        flag = torch.tensor([float(failed is not None)], device=self.env.device)
        if self.env.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if failed is not None:
            raise failed
        if flag.item():
            raise FatalError(f"rank 0 could not write the final checkpoint of step {step}; see its log")

    @contextlib.contextmanager
    def _disk_errors_are_fatal(self):
        """A full, over-quota or read-only checkpoint_dir (or a file-size limit) stays so after a
        restart: stop, saying so."""
        try:
            yield
        except OSError as err:
            if err.errno not in export.DISK_FULL:
                raise
            raise FatalError(f"checkpoint.dir={self.cfg.checkpoint.dir!r}: {err.strerror} while writing a "
                             f"checkpoint; free space or use another checkpoint.dir, then resume") from err

    def state(self) -> dict:
        """The whole training state (a collective)."""
        return self._state(rngs=gather_rng(self.env.distributed, self.env.world_size))

    def _state(self, *, rngs: list, model_state: dict | None = None, **extra) -> dict:
        parts = {name: model_state if name == "model" and model_state is not None else part.state_dict()
                 for name, part in self.components.items()}
        return {"format": FORMAT, "framework_version": __version__, **parts, "rng": rngs,
                "config": as_dict(self.cfg, builtin_model=self.builtin_model, builtin_data=self.builtin_data),
                "world_size": self.env.world_size, **extra}

    def save_survivor(self, step: int, *, model_state: dict) -> Path | None:
        """Write ``step``'s state from this rank alone, without a collective: for a rank whose peer
        went away in the step after ``step`` (the trainer's ``_if_a_peer_is_lost``).
        The state is the live one, which the interrupted step has not changed. It holds no RNG
        state: every rank's generators are seeded from (seed, rank, step) at each step's start
        (rng.seed_step); ``model_state`` is the model's as it stood at the step's start (see
        StepStartBuffers). Only one survivor writes (see CheckpointStore.write_survivor); returns the
        path, or None when this rank did not write."""
        lineage, began_from = self.store.lineage, self.store.began_from
        if not self.env.is_main:
            record = markers.recorded_lineages(self.store.directory)
            if record is None:
                log.info("no survivor checkpoint of step %d: rank 0 recorded no lineage in %s", step,
                         self.store.directory)
                return None
            lineage, began_from = record["current"], record["began_from"]
        state = self.survivor_state(model_state=model_state)
        with self._disk_errors_are_fatal():
            return self.store.write_survivor(state, step, lineage=lineage, began_from=began_from)

    def survivor_state(self, *, model_state: dict) -> dict:
        """The live state, which the interrupted step has not changed, with ``model_state`` (the
        model's as at the step's start) and no RNG state: see ``save_survivor``. No collective."""
        return self._state(rngs=[None] * self.env.world_size, model_state=model_state, saved_alone_by=self.env.rank)

    def take_over(self, env, *, resuming: bool = False) -> None:
        """After healing in place: this process's place in the new generation. The new rank 0, if it
        was not rank 0 before (rank 0 was lost), takes checkpoint_dir's lock and continues the
        lineage rank 0 recorded, as a survivor checkpoint does. ``resuming``: the generation
        resumes from the checkpoint instead (no member held a state): the lineage is chosen as a
        restarted process chooses it (``load``), which continues the recorded one only from its
        newest checkpoint; one resumed from an older checkpoint must not write over the newer."""
        before, self.env = self.env, env
        self.healed_from_disk |= resuming
        if env.is_main and before.is_main and resuming:
            self.store.start_lineage()  # as a restarted rank 0's own: load() continues the old one from its newest
        if not env.is_main or before.is_main:
            return
        record = markers.recorded_lineages(self.store.directory)
        self.store.take_over(lineage=None if record is None or resuming else record["current"],
                             began_from=None if record is None else record["began_from"])
        self.lineages = [] if record is None else [x for x in record["lineages"] if x != record["current"]] + [
            record["current"]]
        self.resumed_lineage = None if record is None else record.get("resumed")
        if record is not None and not resuming:  # spared from pruning, as rank 0 spared them
            self.origin, self.store.resumed_from = record["origin"], record["resumed_file"]

    def load(self, before: int | None = None) -> dict | None:
        """Rank 0 picks the checkpoint (see the class; with ``before``, the newest of this run's
        of a step before it, for a rollback) and loads it once; the other ranks load the file it
        names. Returns the state, or None to start fresh. An error that may pass (a checkpoint
        that cannot be read now) raises CheckpointUnreadable, any other CheckpointError."""
        choice: list = [None, None, False]  # the path, or the error that every rank raises and if it may pass
        state = None
        if self.env.is_main:
            try:
                path, state = self._choose(before)
                choice[0] = None if path is None else str(path)
            except CheckpointError as err:
                choice[1] = str(err)
            except FileNotFoundError as err:
                choice[1] = f"checkpoint.resume={self.cfg.checkpoint.resume}: {err.strerror}: {err.filename}"
            except OSError as err:
                choice[1:] = [str(err) if isinstance(err, CheckpointUnreadable) else
                              f"checkpoint.resume={self.cfg.checkpoint.resume}: unreadable ({err.strerror or err})",
                              True]
            except (RuntimeError, EOFError) as err:
                first_line = (str(err).splitlines() or [""])[0]
                choice[1] = (f"checkpoint.resume={self.cfg.checkpoint.resume}: unreadable: {type(err).__name__}: "
                             f"{first_line}")
        if self.env.distributed:
            dist.broadcast_object_list(choice, src=0)
        if choice[1] is not None:
            raise _unreadable(choice[1], self.env) if choice[2] else CheckpointError(choice[1])
        self.loaded_from = None if choice[0] is None else Path(choice[0])
        if choice[0] is None:
            return None
        return upgrade(state if state is not None else checkpoint_files.load_file(Path(choice[0])))

    def _choose(self, before: int | None = None) -> tuple[Path | None, dict | None]:
        if before is not None:
            files = {self.origin, self.store.resumed_from} - {None}
            found = self.store.latest_valid(before, lineages={*self.lineages, self.store.lineage}, files=files)
            if found is not None:
                self.store.mark_resumed(found[0])
                self._record_lineages(self.lineages)
            return found or (None, None)
        ours = self._launch_lineages()
        found = self.store.latest_valid(lineages=ours) if ours else None
        if found is not None:
            restarts = process_group.group_restarts()
            log.info("%s: continuing its own lineage from %s (checkpoint.resume=%s chose the launch's start)",
                     f"restart {restarts} of this launch" if restarts else "a generation healed from the checkpoint",
                     found[0].name, self.cfg.checkpoint.resume)
        elif self.cfg.checkpoint.resume == "auto":
            found = self.store.latest_valid()
        elif self.cfg.checkpoint.resume != "none":
            found = Path(self.cfg.checkpoint.resume), checkpoint_files.load_file(self.cfg.checkpoint.resume)
        if found is None and self.cfg.checkpoint.resume != "none" and (began := self.store.beginning_of_newest()):
            # Every checkpoint this directory's newest run wrote is unusable, and that run began
            # from a checkpoint elsewhere (resume=PATH): going back there loses only its own steps,
            # where starting afresh would silently train another model.
            log.warning("no checkpoint in %s is usable; its newest run began from %s: resuming from there",
                        self.store.directory, began)
            found = began, checkpoint_files.load_file(began)
        path, state = found or (None, None)
        if path is not None:
            self.store.mark_resumed(path)  # protected from pruning; a restart continues its lineage
            if path.resolve().parent == self.store.directory.resolve():
                self.origin = path.name
            self.resumed_lineage = self.store.lineage_of(path)
        self._record_lineages(ours)
        return path, state

    def _launch_lineages(self) -> list[str]:
        """A restart's, or a generation's healed in place from the checkpoint: the lineages its
        launch has written in."""
        if process_group.group_restarts() == 0 and not self.healed_from_disk:
            return []
        record = markers.recorded_lineages(self.store.directory, restart=True)
        return [] if record is None else record["lineages"]

    def _record_lineages(self, earlier: list[str]) -> None:
        current = self.store.lineage
        self.lineages = [x for x in earlier if x != current] + [current]
        markers.record_lineages(self.store.directory, current=current, lineages=self.lineages,
                                resumed=self.resumed_lineage, began_from=self.store.began_from, origin=self.origin,
                                resumed_file=self.store.resumed_from)

    def restore(self, state: dict) -> None:
        """Load ``state`` into the components (the RNG is ``restore_rng``'s, last of all)."""
        check_model_shapes(state["model"], self.components["model"])
        refused, changed = config_changes(state.get("config", {}), self.cfg, builtin_data=self.builtin_data,
                                          builtin_model=self.builtin_model)
        if refused:
            raise CheckpointError(f"the checkpoint's run used other data: {'; '.join(refused)}; its sample "
                                  f"position does not apply. Restore these values, or start fresh with "
                                  f"checkpoint.resume=none or another checkpoint.dir")
        if changed:
            log.warning("resuming with a changed configuration (the run differs from an uninterrupted one): %s",
                        "; ".join(changed))
        for name, part in self.components.items():
            try:
                part.load_state_dict(state[name])
            except (KeyError, ValueError) as err:
                raise CheckpointError(f"checkpoint part {name!r} does not load: {err}") from err
            except RuntimeError as err:
                if name != "scaler" or state[name]:
                    raise
                saved = dotted(state.get("config", {}))
                raise CheckpointError(
                    f"checkpoint part 'scaler' does not load: the checkpoint was saved without fp16 loss scaling "
                    f"(precision.autocast={saved.get('precision.autocast', '?')}, precision.dtype="
                    f"{saved.get('precision.dtype', '?')}) and this run scales its fp16 loss: resume with the "
                    f"checkpoint's precision settings, or start fresh with checkpoint.resume=none") from err
        if int(state["world_size"]) != self.env.world_size:
            sampler = self.components["sampler"]
            log.warning("resuming a world-size-%d checkpoint on %d ranks: the data continues at global sample %d "
                        "of epoch %d with %d samples a step (%s); per-rank state that does not map to the new ranks "
                        "starts afresh: PowerSGD's error feedback (if used), the straggler history (never saved); the "
                        "RNG streams are each rank's from (seed, rank, step)", state["world_size"],
                        self.env.world_size, sampler.consumed, sampler.epoch, sampler.global_batch,
                        "the checkpoint's global batch" if sampler.global_batch == _saved_global_batch(state)
                        else "not the checkpoint's: the run differs from an uninterrupted one")

    def roll_back(self, before: int) -> int | None:
        """Restore, in-process, the newest valid checkpoint of a step before ``before`` (every
        rank calls this); returns its step, or None when there is none in the current epoch.
        One of an earlier epoch is not used: the spike's samples, dropped from every epoch's
        permutation, may lie in that epoch's committed part, which would shift."""
        state = self.load(before=before)
        epoch = self.components["sampler"].epoch
        if state is None or int(state["sampler"]["epoch"]) != epoch:
            if state is not None:
                log.warning("the newest checkpoint before step %d is of epoch %s, not of the current epoch %d: "
                            "a rollback stays within an epoch", before, state["sampler"]["epoch"], epoch)
            return None
        self.restore(state)
        step = int(state["trainer"]["step"])
        self.restore_rng(state, step)
        return step

    def restore_rng(self, state: dict, step: int) -> None:
        """This rank's generators as saved. A checkpoint of another world size, or one saved by a
        survivor alone, has none for this rank: the trainer seeds them from (seed, rank, step) at
        the start of each step anyway (rng.seed_step)."""
        saved = state["rng"][self.env.rank] if int(state["world_size"]) == self.env.world_size else None
        if saved is not None:
            rng.restore(saved)

    def close(self) -> None:
        """Wait for the write in flight (raising its error)."""
        with self._disk_errors_are_fatal():
            self.store.close()
