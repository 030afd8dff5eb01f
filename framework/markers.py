"""What a run leaves in checkpoint_dir for its restart: the FATAL and PREEMPTED markers and the
micro-batch an out-of-memory error forced, and the check a new incarnation makes at start.

A FATAL marker stops every later incarnation of the same launch at once (torchrun would
otherwise retry a deterministic failure --max-restarts times); a fresh launch clears it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from . import atomic

log = logging.getLogger(__name__)

FATAL = "FATAL"
PREEMPTED = "PREEMPTED"
MICRO_BATCH = "MICRO_BATCH.json"


class FatalError(RuntimeError):
    """An error that a restart cannot fix; it leaves a FATAL marker so a restarted group stops at once."""


def write(directory: str | Path, name: str, message: str) -> None:
    """Atomically write the marker ``directory/name`` holding ``message``."""
    atomic.write_bytes(Path(directory) / name, message.encode("utf-8"))


def read(directory: str | Path, name: str) -> str | None:
    """The marker's message, or None when there is no such marker."""
    try:
        return (Path(directory) / name).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None


def clear(directory: str | Path, name: str) -> None:
    (Path(directory) / name).unlink(missing_ok=True)


def write_fatal(directory: str | Path, rank: int, err: BaseException) -> None:
    message = f"rank {rank}: {type(err).__name__}: {err}"
    try:
        write(directory, FATAL, message)
    except OSError as write_err:  # e.g. the disk that failed the checkpoint is full: still report the error
        log.error("fatal, not retriable (no FATAL marker: %s): %s", write_err, message)
        return
    log.error("fatal, not retriable (FATAL marker written): %s", message)


def record_micro_batch(directory: str | Path, batch_size: int, accumulation: int, reason: str) -> None:
    """Remember a smaller micro-batch for the next incarnation (after an OOM only a restart can fix)."""
    write(directory, MICRO_BATCH, json.dumps(
        {"micro_batch_size": batch_size, "accumulation_steps": accumulation, "reason": reason}))


def recorded_micro_batch(directory: str | Path) -> dict | None:
    """``{"micro_batch_size", "accumulation_steps", "reason"}`` recorded by an earlier incarnation."""
    text = read(directory, MICRO_BATCH)
    return None if text is None else json.loads(text)


def check_at_start(directory: str | Path, *, restart_count: int, is_main: bool) -> None:
    """A restarted group stops at once on an earlier incarnation's FATAL marker. A fresh launch
    (restart count 0) clears it, and the micro-batch an earlier launch recorded: the user's
    configuration decides again."""
    if restart_count == 0 and is_main and read(directory, MICRO_BATCH) is not None:
        log.warning("clearing %s of an earlier launch", MICRO_BATCH)
        clear(directory, MICRO_BATCH)
    message = read(directory, FATAL)
    if message is None:
        return
    if restart_count > 0:
        raise FatalError(f"an earlier incarnation of this run failed and a restart cannot help: {message}")
    log.warning("clearing the FATAL marker of an earlier run: %s", message)
    if is_main:
        clear(directory, FATAL)
