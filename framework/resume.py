"""The training state on disk: what a checkpoint holds, which one to resume from, and restoring it.

A checkpoint is the union of the stateful pieces' ``state_dict()``s plus every rank's RNG state,
gathered to rank 0, which writes it. Everything is plain (tensors, ints, floats, strings, lists,
dicts) so it loads under ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch.distributed as dist

from . import __version__, rng
from .checkpoint import (FATAL, CheckpointManager, atomic_write_bytes, check_model_shapes, clear_marker,
                         load_file, read_marker)
from .config import as_dict

log = logging.getLogger(__name__)

FORMAT = 1


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def gather_rng(distributed: bool, world_size: int) -> list[dict]:
    """Every rank's RNG state, in rank order (a collective: all ranks must call it)."""
    mine = rng.capture()
    if not distributed:
        return [mine]
    states: list = [None] * world_size
    dist.all_gather_object(states, mine)
    return states


def training_state(trainer) -> dict:
    """The whole state of ``trainer`` (a collective: every rank calls it; rank 0 saves it)."""
    return {
        "format": FORMAT,
        "framework_version": __version__,
        "step": trainer.step,
        "model": trainer.raw_model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scaler": trainer.scaler.state_dict(),
        "schedule": {"total_steps": trainer.total_steps, "warmup_steps": trainer.cfg.warmup_steps},
        "sampler": trainer.sampler.state_dict(),
        "micro_batch_size": trainer.sampler.batch_size,
        "accumulation_steps": trainer.sampler.accumulation,
        "skipped_this_epoch": list(trainer.skipped_this_epoch),
        "tokens_total": trainer.tokens_total,
        "rng": gather_rng(trainer.env.distributed, trainer.env.world_size),
        "config": as_dict(trainer.cfg),
        "world_size": trainer.env.world_size,
    }


def choose_checkpoint(resume: str, manager: CheckpointManager, env) -> dict | None:
    """Rank 0 picks the checkpoint (``resume`` = auto | none | PATH) and broadcasts the choice;
    every rank then loads that same file. Returns the loaded state, or None to start fresh."""
    if resume == "none":
        return None
    choice: list = [None]
    if env.is_main:
        if resume == "auto":
            found = manager.latest_valid()
            choice[0] = str(found[0]) if found else None
        else:
            choice[0] = resume
        if choice[0] is not None:
            manager.mark_resumed(choice[0])
    if env.distributed:
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    return load_file(Path(choice[0]))


def restore(trainer, state: dict) -> None:
    """Load ``state`` into ``trainer`` (all but the RNG, which ``restore_rng`` sets last)."""
    check_model_shapes(state["model"], trainer.raw_model)
    trainer.raw_model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scaler.load_state_dict(state["scaler"])
    trainer.step = int(state["step"])
    trainer.sampler.load_state_dict(state["sampler"])
    trainer.skipped_this_epoch = list(state["skipped_this_epoch"])
    trainer.tokens_total = int(state["tokens_total"])
    same_world = int(state["world_size"]) == trainer.env.world_size
    if same_world:
        trainer.sampler.batch_size = int(state["micro_batch_size"])
        trainer.sampler.accumulation = int(state["accumulation_steps"])
    else:
        log.warning("resuming a world-size-%d checkpoint on %d ranks: model and optimizer resume, the data "
                    "continues at global sample %d of epoch %d, but the run is no longer bitwise equal to "
                    "an uninterrupted one", state["world_size"], trainer.env.world_size,
                    trainer.sampler.consumed, trainer.sampler.epoch)


def restore_rng(trainer, state: dict) -> None:
    if int(state["world_size"]) == trainer.env.world_size:
        rng.restore(state["rng"][trainer.env.rank])
    else:
        rng.seed_all(trainer.cfg.seed + 1 + trainer.env.rank + 7919 * trainer.step)


MICRO_BATCH_FILE = "MICRO_BATCH.json"


def record_micro_batch(checkpoint_dir: str, batch_size: int, accumulation: int, reason: str) -> None:
    """Remember a smaller micro-batch for the next incarnation (after an OOM a restart must fix)."""
    atomic_write_bytes(Path(checkpoint_dir) / MICRO_BATCH_FILE, json.dumps(
        {"micro_batch_size": batch_size, "accumulation_steps": accumulation, "reason": reason}).encode())


def apply_recorded_micro_batch(trainer) -> None:
    path = Path(trainer.cfg.checkpoint_dir) / MICRO_BATCH_FILE
    if not path.is_file():
        return
    rec = json.loads(path.read_text())
    trainer.sampler.batch_size = int(rec["micro_batch_size"])
    trainer.sampler.accumulation = int(rec["accumulation_steps"])
    log.warning("micro-batch %d x %d accumulation steps, recorded after: %s", trainer.sampler.batch_size,
                trainer.sampler.accumulation, rec["reason"])


def check_fatal_marker(checkpoint_dir: str, *, is_main: bool) -> None:
    """A restarted group stops at once on an earlier incarnation's FATAL marker; a fresh launch
    (restart count 0) clears it."""
    from .recovery import FatalError
    message = read_marker(checkpoint_dir, FATAL)
    if message is None:
        return
    if restart_count() > 0:
        raise FatalError(f"an earlier incarnation of this run failed and a restart cannot help: {message}")
    log.warning("clearing the FATAL marker of an earlier run: %s", message)
    if is_main:
        clear_marker(checkpoint_dir, FATAL)
