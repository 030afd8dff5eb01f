"""What a run leaves in checkpoint_dir for its restart: the FATAL and PREEMPTED markers, the
micro-batch an out-of-memory error forced, the restart-loop count with the last error, and the
check a new restart makes at start.

A FATAL marker stops every later restart of the same launch at once (torchrun would
otherwise retry a deterministic failure --max-restarts times); a fresh launch clears it.
LINEAGE.json names the lineages this launch writes (framework/state/checkpoint_files.py): a restart continues
them whatever ``resume`` says, and a rollback's recorded exclusions belong to them.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ..state import atomic

log = logging.getLogger(__name__)

FATAL = "FATAL"
PREEMPTED = "PREEMPTED"
NODE_LOST = "NODE_LOST"  # a node of the run was lost: the launcher exits 75 (docs/clusters.md)
MICRO_BATCH = "MICRO_BATCH.json"
LAST_ERROR = "LAST_ERROR"
RESTARTS = "RESTARTS.json"
LINEAGE = "LINEAGE.json"


class FatalError(RuntimeError):
    """An error that a restart cannot fix; it leaves a FATAL marker so a restarted group stops at once,
    unless ``blocks_restarts`` is False: then a restart on other terms (another world size) may."""

    blocks_restarts = True


class WorldSizeMismatch(FatalError):
    """A stop that only this world size causes (a global batch that does not split over it, a
    stream's shards saved at another): one line, but no FATAL marker, since a restart at another
    world size (a node back in an elastic range) can continue."""

    blocks_restarts = False


class EarlierFatal(FatalError):
    """A restart stopping on the FATAL marker of an earlier restart, which stays as it is."""


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
    if isinstance(err, EarlierFatal):  # the marker already holds the cause; rewriting it would nest it
        log.error("fatal, not retriable: %s", err)
        return
    message = f"rank {rank}: {type(err).__name__}: {err}"
    try:
        write(directory, FATAL, message)
    except OSError as write_err:  # e.g. the disk that failed the checkpoint is full: still report the error
        log.error("fatal, not retriable (no FATAL marker: %s): %s", write_err, message)
        return
    log.error("fatal, not retriable (FATAL marker written): %s", message)


# What a rank sees when a peer died: the peer's own error is the cause worth naming.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
              "given up: peer rank(s)")  # the last: a breaker's PeerLostError, as DDP's backward passes it on


def _recorded_by_this_restart(path: Path) -> bool:
    """Whether ``path`` was written after this process started: every rank of a restart
    starts after the previous restart's ranks have all exited."""
    import psutil

    try:
        return path.stat().st_mtime >= psutil.Process().create_time()
    except FileNotFoundError:
        return False


def clear_if_earlier(directory: str | Path, name: str) -> None:
    """Remove the marker ``name`` if an earlier restart wrote it (before this process started):
    one that a peer of this restart wrote already stays."""
    path = Path(directory) / name
    if path.exists() and not _recorded_by_this_restart(path):
        path.unlink(missing_ok=True)


def peer_lost(err: BaseException) -> bool:
    """Whether ``err`` is what a rank sees when a peer process went away (gloo's "Connection closed
    by peer", NCCL's DistBackendError): a consequence, whose cause is on the peer's side."""
    return (type(err).__name__ in ("DistBackendError", "PeerLostSilently", "PeerLostError")
            or any(s in str(err) for s in _PEER_LOST))


def timed_out(err: BaseException) -> bool:
    """Whether ``err`` is a collective that timed out (gloo's "Timed out waiting ..."; ddp.timeout_s),
    not a deliberate stop (FatalError) or any other error."""
    return isinstance(err, RuntimeError) and not isinstance(err, FatalError) and "Timed out waiting" in str(err)


def record_error(directory: str | Path, rank: int, err: BaseException) -> None:
    """The error a rank is exiting with, for the restart-loop guard to name. A rank that only saw
    a peer go away (gloo's "Connection closed by peer", NCCL's DistBackendError) does not replace
    the error another rank of this restart recorded: that one is the cause."""
    if peer_lost(err) and _recorded_by_this_restart(Path(directory) / LAST_ERROR):
        return
    try:
        write(directory, LAST_ERROR, f"rank {rank}: {type(err).__name__}: {(str(err).splitlines() or [''])[0]}")
    except OSError as write_err:
        log.error("could not record the error in %s: %s", directory, write_err)


def note_restart(directory: str | Path, resumed_step: int, limit: int) -> str | None:
    """Count the restarts in a row that resumed from ``resumed_step`` (RESTARTS.json); the
    message of the FATAL stop once there are more than ``limit`` of them, else None."""
    try:
        last = json.loads(read(directory, RESTARTS) or '{"step": -1, "count": 0}')
        count = int(last["count"]) + 1 if last["step"] == resumed_step else 1
    except (ValueError, KeyError, TypeError) as err:
        log.warning("%s is unreadable (%s): counting restarts afresh", Path(directory) / RESTARTS, err)
        count = 1
    try:
        write(directory, RESTARTS, json.dumps({"step": resumed_step, "count": count}))
    except OSError as err:  # the run goes on; only the count is lost
        log.error("cannot record the restart in %s: %s", Path(directory) / RESTARTS, err)
    if count <= limit:
        return None
    error = read(directory, LAST_ERROR) or "none recorded (killed by a signal? see the rank logs)"
    return (f"{count} restarts in a row resumed from step {resumed_step} with no progress in between "
            f"(recovery.max_no_progress_restarts={limit}); the last error: {error}")


def record_micro_batch(directory: str | Path, batch_size: int, accumulation: int, reason: str) -> None:
    """Remember a smaller micro-batch for the next restart (after an OOM only a restart can fix)."""
    write(directory, MICRO_BATCH, json.dumps(
        {"micro_batch_size": batch_size, "accumulation_steps": accumulation, "reason": reason}))


def recorded_micro_batch(directory: str | Path) -> dict | None:
    """``{"micro_batch_size", "accumulation_steps", "reason"}`` recorded by an earlier restart."""
    text = read(directory, MICRO_BATCH)
    return None if text is None else json.loads(text)


def check_at_start(directory: str | Path, *, group_restarts: int, is_main: bool, is_local_main: bool = False) -> None:
    """A restarted group stops at once on an earlier restart's FATAL marker. A fresh launch
    (restart count 0) clears it, the micro-batch an earlier launch recorded (the user's
    configuration decides again) and the earlier launch's lineages. A restart that starts
    clears NODE_LOST on each node (``is_local_main``): the loss an earlier restart recorded
    was survived, so the launcher's exit says what the last restart met, not the first.
    Call it holding checkpoint_dir's lock: the markers may be a live run's."""
    if group_restarts > 0 and (is_main or is_local_main):
        clear_if_earlier(directory, NODE_LOST)
    if group_restarts == 0 and is_main:
        if read(directory, MICRO_BATCH) is not None:
            log.warning("clearing %s of an earlier launch", MICRO_BATCH)
        for name in (MICRO_BATCH, RESTARTS, LAST_ERROR, LINEAGE):
            clear(directory, name)
    message = read(directory, FATAL)
    if message is None:
        return
    if group_restarts > 0:
        raise EarlierFatal(f"an earlier restart of this run failed and a restart cannot help: {message}")
    log.warning("clearing the FATAL marker of an earlier run: %s", message)
    if is_main:
        clear(directory, FATAL)


def _run_id() -> str | None:
    return os.environ.get("TORCHELASTIC_RUN_ID")


def record_lineages(directory: str | Path, *, current: str, lineages: list[str], resumed: str | None,
                    began_from: str | None = None, origin: str | None = None,
                    resumed_file: str | None = None) -> None:
    """This launch writes lineage ``current``; ``lineages`` are all it has written in (its
    restarts continue them), ``resumed`` the lineage of the checkpoint it started from,
    ``began_from`` the checkpoint outside the directory it started from (resume=PATH), if any.
    ``origin`` and ``resumed_file``: the files in the directory that the launch started from and
    that its writer last resumed from, which pruning spares (a survivor taking over as rank 0
    spares them too)."""
    try:
        write(directory, LINEAGE, json.dumps({"current": current, "lineages": lineages, "resumed": resumed,
                                              "began_from": began_from, "origin": origin,
                                              "resumed_file": resumed_file, "run_id": _run_id()}))
    except OSError as err:  # a restart then resumes as the launch's resume mode says
        log.error("cannot record this launch's lineages in %s: %s", Path(directory) / LINEAGE, err)


def recorded_lineages(directory: str | Path, *, restart: bool = False) -> dict | None:
    """``{"current", "lineages", "resumed", "began_from", "origin", "resumed_file"}`` recorded by
    ``record_lineages`` (the last three None in an older record), or None. With
    ``restart``, None also when the record is another torchrun run id's (an earlier launch's)."""
    try:
        data = json.loads(read(directory, LINEAGE) or "null")
        if data is None:
            return None
        record = {"current": str(data["current"]), "lineages": [str(x) for x in data["lineages"]],
                  "resumed": None if data["resumed"] is None else str(data["resumed"]),
                  **{key: None if data.get(key) is None else str(data[key])
                     for key in ("began_from", "origin", "resumed_file")}}
    except (ValueError, KeyError, TypeError) as err:
        log.warning("%s is unreadable (%s): ignored", Path(directory) / LINEAGE, err)
        return None
    if restart and data.get("run_id") != _run_id():
        log.warning("%s was written by torchrun run %s, not this run (%s): ignored", Path(directory) / LINEAGE,
                    data.get("run_id"), _run_id())
        return None
    return record
