"""Checkpoint files: the safe loader, the CPU snapshot, and the checkpoint store.

A checkpoint directory holds ``step_00000042.pt`` files, each the whole training state, and
``manifest.json``, a list of ``{"file", "step", "sha256", "bytes", "lineage", "seq"}`` entries.
Each file is written atomically before the manifest is rewritten (also atomically) to list it,
so the manifest never names a partial file; each file also records its lineage, so that a file
whose writer died before the manifest named it is listed again by its lineage's next write, and a
lost manifest is rebuilt with each file's own lineage. Rank 0 writes, holding ``.lock``; every
rank may load.

Runs are kept apart as lineages: a fresh run, or a rollback to an older checkpoint, starts a new
one, and a restart continues the lineage of the checkpoint it resumes. Pruning (keep_last)
touches only this run's lineage and never the file just written or the one resumed from;
resume=auto takes the newest-written checkpoint (``seq``), not the highest step.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import gc
import hashlib
import io
import json
import logging
import os
import pickle
import re
import socket
import threading
import time
import uuid
import weakref
from pathlib import Path

import torch

from . import atomic

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_STEP_FILE = re.compile(r"step_(\d+)\.pt")
_PLAIN = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)
# What torch.load raises on a truncated or corrupt file.
_LOAD_ERRORS = (RuntimeError, EOFError, pickle.UnpicklingError)
_LINEAGE_KEY = "_checkpoint_lineage"
"""The key of a written file's lineage in its payload; ``load_file`` takes it out again."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: refused by the safe loader, or not fitting the model."""


def load_file(path: str | Path) -> dict:
    """Load a checkpoint onto the CPU with the safe loader; refuse anything but tensors and plain types.

    Raises CheckpointError when the file holds other objects (for example a pickle that would run
    code); truncated or corrupt files raise torch.load's own RuntimeError or EOFError.
    """
    return _load_with_lineage(path)[0]


def _load_with_lineage(path: str | Path, *, mmap: bool = False) -> tuple[dict, str | None]:
    """``load_file``'s state, and the lineage its writer recorded in it (None: another writer's).
    ``mmap``: a file given by its path is mapped, not read (its tensors stay on disk)."""
    source = path if isinstance(path, io.BytesIO) else Path(path)
    try:
        state = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap and isinstance(source, Path))
    except pickle.UnpicklingError as e:
        name = Path(path).name if not isinstance(path, io.BytesIO) else "<bytes>"
        raise CheckpointError(f"{name}: refused: not a plain tensor/dict checkpoint "
                              f"({_unpickling_detail(e)})") from e
    lineage = state.pop(_LINEAGE_KEY, None) if isinstance(state, dict) else None
    return state, lineage if isinstance(lineage, str) else None


def _file_digest(path: Path) -> tuple[int, str]:
    """The size and SHA-256 of the file at ``path``, read in chunks."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256")
        return f.tell(), digest.hexdigest()


def _unpickling_detail(error: pickle.UnpicklingError) -> str:
    # torch's message wraps the reason in advice to retry with weights_only=False; keep the reason only.
    paragraphs = [p.strip() for p in str(error).split("\n\n") if p.strip()]
    detail = [p for p in paragraphs if not p.startswith(("Weights only load failed", "Check the documentation"))]
    if detail:
        return " ".join(detail)
    return paragraphs[0] if paragraphs else type(error).__name__


def to_cpu(obj, where: str = "state", _memo: dict | None = None):
    """A deep copy of ``obj`` with every tensor copied to CPU memory.

    ``obj`` may nest dicts, lists and tuples of tensors and plain values (None, bool, int, float,
    str, bytes, dtype, device); anything else raises CheckpointError naming where it is, since
    the safe loader could not read it back. The same tensor reached twice (tied weights) is
    copied once.
    """
    memo = {} if _memo is None else _memo
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:
            return obj.detach().to("cpu", copy=True)
        key = (obj.data_ptr(), obj.device, obj.dtype, obj.storage_offset(), tuple(obj.shape), obj.stride())
        if key not in memo:
            memo[key] = obj.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(obj, dict):
        out = collections.OrderedDict() if isinstance(obj, collections.OrderedDict) else {}
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(f"{where}: key {k!r} of type {type(k).__name__} cannot be saved; "
                                      f"use str or int keys")
            out[k] = to_cpu(v, f"{where}[{k!r}]", memo)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # module versions, read back by load_state_dict
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v, f"{where}[{i}]", memo) for i, v in enumerate(obj))
    if type(obj) in _PLAIN:
        return obj
    raise CheckpointError(f"{where}: {type(obj).__module__}.{type(obj).__qualname__} cannot be saved in a "
                          f"checkpoint the safe loader reads; convert it to a tensor or a plain Python value")


def step_file(step: int) -> str:
    """The file name of the checkpoint of ``step``."""
    return f"step_{step:08d}.pt"


class CheckpointUnreadable(OSError):
    """No checkpoint could be read for an error that may pass (EIO, ESTALE, EACCES): not a FATAL one."""


class CheckpointDirLocked(RuntimeError):
    """Another run (or another CheckpointStore of this process) holds the checkpoint directory's lock."""


class CheckpointStore:
    """Save training states asynchronously to ``directory``, prune this run's old ones, and find the
    newest-written one that is intact.

    The manifest lists ``{"file", "step", "sha256", "bytes", "lineage", "seq"}`` entries, oldest-written
    first. ``seq`` counts the writes to the directory; ``lineage`` names the run that wrote the entry:
    a new id for each store, or the lineage of the checkpoint it resumed from when that checkpoint
    is the newest of its lineage (see ``mark_resumed``). A save prunes only this store's lineage,
    keeping its newest ``keep_last`` entries and the file the run resumed from; other lineages'
    files are kept until deleted by hand. Entries written before lineages existed, and step files
    found without a manifest, belong to lineage ``"legacy"``.

    Rank 0 holds an exclusive lock on ``directory/.lock`` from construction until ``close`` or
    ``release`` (or until the store is garbage-collected, or its process dies), so that a second
    run writing the same directory fails at once with CheckpointDirLocked.

    Only ``rank`` 0 writes: on other ranks ``save``, ``wait``, ``close`` and ``mark_resumed`` do
    nothing and return None, and no lock is taken. Every rank may call ``latest_valid`` and
    ``load_file``.
    """

    LOCK = ".lock"

    def __init__(self, directory: str | Path, keep_last: int = 3, rank: int = 0, *, wait_for_run_s: float = 0):
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last={keep_last}: must be at least 1")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.rank = rank
        self.lineage: str = uuid.uuid4().hex[:12]
        """The lineage this store's saves belong to."""
        self.resumed_from: str | None = None
        # The checkpoint outside ``directory`` this lineage began from (resume=PATH), recorded in
        # its manifest entries: where a resume goes back to when all of them are unusable.
        self.began_from: str | None = None
        """The name of the file in ``directory`` this run resumed from, which pruning never deletes."""
        self.last_wait_s: float | None = None
        """Seconds the last ``save`` waited for the previous write to finish."""
        self.last_stall_s: float | None = None
        """Seconds the last ``save`` held the caller while copying the state to CPU memory."""
        self.last_write_s: float | None = None
        """Seconds the last background write took: serialise, hash, write, manifest, prune."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock: _DirLock | None = None
        self._reported_other_lineages = False
        self._examined: set[str] = set()  # unlisted step files looked at for this lineage's (``_adopted``)
        self._unreadable: list[str] = []  # what the last latest_valid could not read, for its error
        if rank == 0:
            self._acquire(wait_for_run_s)

    load_file = staticmethod(load_file)

    @property
    def manifest_path(self) -> Path:
        return self.directory / MANIFEST

    @property
    def lock_path(self) -> Path:
        return self.directory / self.LOCK

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- writing (rank 0) --------------------------------------------------------------------
    def mark_resumed(self, path: str | Path) -> None:
        """Record that this run resumes from ``path`` (call before the first ``save``).

        A file in ``directory`` is never pruned by this store. When it is the newest-written
        entry of its lineage (a restart after a crash or preemption), this store continues that
        lineage, so its saves prune the older checkpoints of that run; otherwise (a rollback to an
        older checkpoint) this store keeps its new lineage and the rolled-back-over files stay.
        """
        if self.rank != 0:
            return
        self.wait()
        path = Path(path)
        if path.resolve().parent != self.directory.resolve():
            self.began_from = str(path.resolve())
            return
        self.resumed_from = path.name
        entries = self._listed()
        entry = next((e for e in entries if e["file"] == path.name), None)
        if entry is None:
            log.info("resuming from %s, which the manifest does not list: this run starts lineage %s",
                     path, self.lineage)
            return
        newest = max((e for e in entries if e["lineage"] == entry["lineage"]), key=lambda e: e["seq"])
        if newest is entry:
            self.lineage, self.began_from = entry["lineage"], entry.get("began_from")
            log.info("resuming from %s, the newest checkpoint of lineage %s: continuing it", path, self.lineage)
        else:
            log.info("resuming from %s, older than %s of its lineage %s: this run starts lineage %s and "
                     "keeps both", path, newest["file"], entry["lineage"], self.lineage)

    def save(self, state: dict, step: int, *, blocking: bool = False) -> Path | None:
        """Copy ``state`` to CPU memory, then write it as ``step``'s checkpoint in a background thread.

        The caller waits only for the previous write to finish and for the copy; with
        ``blocking=True`` it also waits for this write. An error of the previous write is raised
        here. Returns the path being written (None on ranks other than 0): ``step_file(step)``,
        or ``step_<step>-<lineage>.pt`` when that name belongs to another lineage, to the file the
        run resumed from, or to a file the manifest does not list. After ``close`` or ``release``,
        a save takes the directory lock again.
        """
        if self.rank != 0:
            return None
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: must be a non-negative int")
        start = time.perf_counter()
        self.wait()
        self.last_wait_s = time.perf_counter() - start
        if self._lock is None:
            self._acquire()
        snapshot = self._snapshot(state)
        path = self.directory / self._file_name(step)
        self._thread = threading.Thread(target=self._write_guarded, args=(snapshot, step, path),
                                        name=f"checkpoint-writer-{step}")
        self._thread.start()
        if blocking:
            self.wait()
        return path

    def write_survivor(self, state: dict, step: int, *, lineage: str, began_from: str | None = None) -> Path | None:
        """Write ``state`` as ``step``'s checkpoint of ``lineage`` now, from any rank, without a
        collective and without pruning: the save of a rank whose peers are gone (see
        Checkpointer.save_survivor). On rank 0 the pending write finishes first. Returns the path
        written, or None (logged) when another process holds the directory's lock (or, on
        another rank, where the file system cannot lock it), or the lineage already has a
        checkpoint of ``step`` or later (another survivor wrote it). ``began_from``: the
        checkpoint outside the directory the lineage began from, for its first entry."""
        if self.rank == 0:
            try:
                self.wait()
            except Exception as err:  # noqa: BLE001  (logged by the writer; the save below is independent)
                log.warning("the checkpoint write before it failed (%s); writing step %d anyway", err, step)
        took_lock = self._lock is None
        if took_lock:
            try:
                self._acquire()
            except CheckpointDirLocked as err:
                log.info("not saving step %d: %s", step, err)
                return None
            if self.rank != 0 and not self._lock.held:  # two survivors would write side by side
                self.release()
                log.info("not saving step %d: %s cannot be locked", step, self.lock_path)
                return None
        try:
            entries = self._listed()
            ours = [e for e in entries if e["lineage"] == lineage]
            if any(int(e["step"]) >= step for e in ours):
                log.info("not saving step %d: lineage %s already has a checkpoint of it or later", step, lineage)
                return None
            self.lineage = lineage
            if self.began_from is None:
                self.began_from = ours[-1].get("began_from") if ours else began_from
            path = self.directory / self._file_name(step)
            self._write(self._snapshot(state), step, path, prune=False)
            return path
        finally:
            if took_lock:
                self.release()

    def wait(self) -> None:
        """Block until the background write finishes; re-raise the exception it failed with, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def release(self) -> None:
        """Let the pending write finish, then release the directory lock (its error stays for ``wait``)."""
        if self._thread is not None:
            self._thread.join()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def close(self) -> None:
        """Wait for the pending write (raising its error, if any) and release the directory lock."""
        try:
            self.wait()
        finally:
            self.release()

    def start_lineage(self) -> None:
        """Write from now on under a new lineage (as a new process would), until ``mark_resumed``
        continues another."""
        self.wait()
        self.lineage, self.began_from = uuid.uuid4().hex[:12], None

    def take_over(self, *, lineage: str | None, began_from: str | None, wait_for_run_s: float = 10.0) -> None:
        """Become the writer of a run whose rank 0 was lost (healing in place): take the lock its
        death freed and continue its ``lineage``."""
        self.rank = 0
        if lineage is not None:
            self.lineage, self.began_from = lineage, began_from
        self._acquire(wait_for_run_s)

    def _acquire(self, wait_for_run_s: float = 0) -> None:
        """Take the directory's lock. ``wait_for_run_s``: how long to wait for a holder of this
        same torchrun run (a survivor of the last restart still writing its survivor checkpoint); a
        holder of another run fails at once."""
        self._lock = _DirLock(self.lock_path, wait_for_run_s)
        # Only under the lock: another live run's temp files are its writes in progress.
        self._remove_stale_temp_files()

    def _listed(self) -> list[dict]:
        """The manifest's entries; none when it is missing or unreadable."""
        try:
            return _read_manifest(self.manifest_path)
        except (FileNotFoundError, ValueError):
            return []

    def _snapshot(self, state: dict) -> dict:
        """``state`` copied to CPU memory (the caller's stall, timed)."""
        start = time.perf_counter()
        snapshot = to_cpu(state)
        self.last_stall_s = time.perf_counter() - start
        return snapshot

    def _file_name(self, step: int) -> str:
        entries = self._listed()
        owners = {e["file"]: e["lineage"] for e in entries}

        def ours(name: str) -> bool:
            if name == self.resumed_from:
                return False
            if name in owners:
                return owners[name] == self.lineage
            return not (self.directory / name).exists()

        plain = step_file(step)
        if ours(plain):
            return plain
        n = 1
        while not ours(name := f"{plain[:-3]}-{self.lineage}{'' if n == 1 else f'-{n}'}.pt"):
            n += 1
        return name

    def _write_guarded(self, snapshot: dict, step: int, path: Path) -> None:
        try:
            self._write(snapshot, step, path)
        except BaseException as e:  # handed to wait(), which re-raises it in the caller's thread
            log.error("writing checkpoint %s failed: %s: %s", path, type(e).__name__, e)
            self._error = e

    def _write(self, snapshot: dict, step: int, path: Path, *, prune: bool = True) -> None:
        start = time.perf_counter()
        # Streamed: the snapshot is the one copy in memory. Its lineage goes in with it (``_adopted``).
        sha256, size = atomic.torch_save({**snapshot, _LINEAGE_KEY: self.lineage}, path)
        entries = self._read_manifest_for_update(path.name)
        entry = {"file": path.name, "step": step, "sha256": sha256, "bytes": size,
                 "lineage": self.lineage, "seq": max((e["seq"] for e in entries), default=0) + 1,
                 **({"began_from": self.began_from} if self.began_from else {})}
        entries = [e for e in entries if e["file"] != path.name and self._still_there(e)] + [entry]
        mine = [e for e in entries if e["lineage"] == self.lineage]
        keep = {e["file"] for e in mine[-self.keep_last:]} | {path.name, self.resumed_from}
        dropped = [e for e in mine if e["file"] not in keep] if prune else []
        kept = [e for e in entries if e["file"] in keep or e["lineage"] != self.lineage] if prune else entries
        atomic.write_bytes(self.manifest_path, json.dumps(kept, indent=2).encode())
        self._prune(dropped, kept)
        self._report_other_lineages(kept)
        self.last_write_s = time.perf_counter() - start
        log.info("checkpoint step %d written: %s, %.1f MB, stall %.3f s, write %.3f s", step, path,
                 size / 2**20, self.last_stall_s or 0.0, self.last_write_s)

    def _still_there(self, entry: dict) -> bool:
        if (self.directory / entry["file"]).exists():
            return True
        log.info("%s is gone: dropping it from %s", self.directory / entry["file"], MANIFEST)
        return False

    def _read_manifest_for_update(self, new_file: str) -> list[dict]:
        try:
            entries = _read_manifest(self.manifest_path)
        except FileNotFoundError:
            return self._entries_from_files(new_file)
        except ValueError as e:
            log.warning("%s is unreadable (%s): rebuilding it", self.manifest_path, e)
            return self._entries_from_files(new_file)
        return entries + self._adopted(entries, new_file)

    def _entries_from_files(self, new_file: str) -> list[dict]:
        """Manifest entries, in step order, for the other step files on disk that load, so that they
        are kept: lineage as the file records it (``_LINEAGE_KEY``), else from its name, else
        ``"legacy"``."""
        entries = []
        for path, step, lineage in sorted(_step_files(self.directory), key=_step_then_mtime):
            if path.name == new_file:
                continue
            entry = self._entry_of(path, step, lineage, seq=len(entries) + 1)
            if entry is not None:
                entries.append(entry)
        if entries:
            log.warning("no usable manifest in %s: listing the %d step files that load", self.directory, len(entries))
        return entries

    def _adopted(self, entries: list[dict], new_file: str) -> list[dict]:
        """Entries for the step files of this store's lineage that the manifest does not list, past
        its newest listed step: their writer died between a file's rename and the manifest's
        update (rank 0 killed while its background write ran; the rank that took over its lineage
        writes now). Listed, keep_last prunes them; unlisted, they would stay for good. An older
        unlisted file (one that pruning could not delete) is left as it is. A file's lineage is read
        without loading its tensors (mmap); each file that shows another lineage is looked at once."""
        listed = {e["file"] for e in entries} | {new_file}
        top = max((int(e["step"]) for e in entries if e["lineage"] == self.lineage), default=-1)
        seq, adopted = max((e["seq"] for e in entries), default=0), []
        for path, step, lineage in sorted(_step_files(self.directory), key=_step_then_mtime):
            if (path.name in listed or path.name in self._examined or step <= top
                    or lineage not in (_LEGACY, self.lineage)):
                continue
            try:
                recorded = _load_with_lineage(path, mmap=True)[1]
                if recorded != self.lineage:
                    self._examined.add(path.name)  # another lineage's, or none's: for good
                    continue
                size, digest = _file_digest(path)
            except (CheckpointError, *_LOAD_ERRORS):
                self._examined.add(path.name)  # unusable: left as it is, as a lost manifest's rebuild does
                continue
            except OSError as e:  # looked at again at the next save: the error may pass
                log.warning("%s is unreadable (%s): left in place, unlisted", path, _os_reason(e))
                continue
            seq += 1
            adopted.append({"file": path.name, "step": step, "sha256": digest, "bytes": size,
                            "lineage": self.lineage, "seq": seq})
        if adopted:
            log.warning("%s: listing %s again in lineage %s: written before its writer died, never listed",
                        self.directory, ", ".join(e["file"] for e in adopted), self.lineage)
        return adopted

    def _entry_of(self, path: Path, step: int, lineage: str, *, seq: int) -> dict | None:
        """The manifest entry of the step file ``path`` when it loads, else None; its lineage as
        it records it, else ``lineage``."""
        try:
            data = path.read_bytes()
        except OSError as e:
            log.warning("%s is unreadable (%s): left in place, unlisted", path, _os_reason(e))
            return None
        found = self._loaded(path, io.BytesIO(data), lineage=True)
        if found is None:
            return None
        return {"file": path.name, "step": step, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                "lineage": found[1] or lineage, "seq": seq}

    def _prune(self, dropped: list[dict], kept: list[dict]) -> None:
        """Delete the files of this lineage's entries that the manifest no longer lists."""
        listed = {e["file"] for e in kept}
        for entry in dropped:
            if entry["file"] not in listed:
                path = self.directory / entry["file"]
                log.info("removing old checkpoint %s (checkpoint.keep_last=%d)", path, self.keep_last)
                try:
                    path.unlink(missing_ok=True)
                except OSError as e:
                    # The new checkpoint and the manifest are written: a file left behind fails no save.
                    log.warning("could not remove old checkpoint %s (%s): left in place", path, _os_reason(e))

    def _report_other_lineages(self, entries: list[dict]) -> None:
        others = [e for e in entries if e["lineage"] != self.lineage]
        if self._reported_other_lineages or not others:
            return
        self._reported_other_lineages = True
        lineages = sorted({e["lineage"] for e in others})
        log.warning("%s: %d checkpoints of %d other runs (lineages %s) are kept; this run (lineage %s) never "
                    "deletes them: delete them by hand when they are no longer needed", self.directory,
                    len(others), len(lineages), ", ".join(lineages), self.lineage)

    def _remove_stale_temp_files(self) -> None:
        """Remove the temp files of interrupted writes (framework.state.atomic's ``.NAME.tmp.XXXXXXXX``)."""
        if not self.directory.is_dir():
            return
        for path in self.directory.glob(".*.tmp.*"):
            if path.is_dir() and not path.is_symlink():
                continue  # atomic writes only leave files (or links planted at their names)
            log.warning("removing %s, left by an interrupted write", path)
            path.unlink(missing_ok=True)

    # --- reading (any rank) ------------------------------------------------------------------
    def latest_valid(self, before: int | None = None, *, lineages=None, files=()) -> tuple[Path, dict] | None:
        """The newest-written checkpoint that is intact (and of a step before ``before``, when
        given), as ``(path, state)``, or None when there is none. With ``lineages``, only the
        checkpoints of those lineages, or named in ``files``, are candidates.

        Goes newest-first (by ``seq``, whatever the step) through the manifest, checking each file's
        size and SHA-256 and that it loads; without a readable manifest, goes through the
        ``step_*.pt`` files from the highest step down, checking that each loads. Every rejected
        file is logged as a WARNING with the reason. A file that cannot be read (an OSError such as
        EIO or ESTALE, which may pass) is skipped like a damaged one; when no candidate is left and
        one was skipped so, CheckpointUnreadable: the caller retries, rather than starting afresh.
        """
        if self.rank == 0:
            self.wait()
        self._unreadable = []

        def candidate(name: str, lineage: str) -> bool:
            return lineages is None or lineage in lineages or name in files

        try:
            entries = _read_manifest(self.manifest_path)
        except FileNotFoundError:
            found = self._latest_by_scan(f"{self.manifest_path} is missing", before, candidate)
        except (ValueError, OSError) as e:
            found = self._latest_by_scan(f"{self.manifest_path} is unreadable ({e})", before, candidate)
        else:
            self._warn_unlisted(entries)
            found = next(((self.directory / e["file"], state) for e in reversed(entries)
                          if (before is None or e["step"] < before) and candidate(e["file"], e["lineage"])
                          and (state := self._verified(self.directory / e["file"], e)) is not None), None)
        if found is None and self._unreadable:
            raise CheckpointUnreadable(f"no checkpoint in {self.directory} could be read: "
                                       f"{'; '.join(self._unreadable)}")
        return found

    def beginning_of_newest(self) -> Path | None:
        """Where the newest-written lineage of the manifest began, when that was a checkpoint
        outside ``directory`` (resume=PATH) that still exists; None otherwise."""
        try:
            entries = _read_manifest(self.manifest_path)
        except (ValueError, OSError):
            return None
        began = entries[-1].get("began_from") if entries else None
        return Path(began) if began and Path(began).is_file() else None

    def lineage_of(self, path: str | Path) -> str | None:
        """The lineage the manifest gives ``path`` (a file in ``directory``), or None when it lists none."""
        try:
            entries = _read_manifest(self.manifest_path)
        except (ValueError, OSError):
            return None
        return next((e["lineage"] for e in entries if self.directory / e["file"] == Path(path)), None)

    def _verified(self, path: Path, entry: dict) -> dict | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return self._reject(path, "missing")
        except OSError as e:
            return self._unreadable_file(path, e)
        if len(data) < entry["bytes"]:
            return self._reject(path, f"truncated ({len(data)} of {entry['bytes']} bytes)")
        if len(data) > entry["bytes"]:
            return self._reject(path, f"size mismatch ({len(data)} bytes, the manifest says {entry['bytes']})")
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            return self._reject(path, "checksum mismatch")
        return self._loaded(path, io.BytesIO(data))

    def _latest_by_scan(self, why: str, before: int | None, candidate=lambda name, lineage: True
                        ) -> tuple[Path, dict] | None:
        files = sorted((f for f in _step_files(self.directory)
                        if (before is None or f[1] < before) and candidate(f[0].name, f[2])),
                       key=_step_then_mtime, reverse=True)
        if files:
            log.warning("%s: falling back to scanning %d step_*.pt files in %s", why, len(files), self.directory)
        for path, _, _ in files:
            state = self._loaded(path, path)
            if state is not None:
                return path, state
        return None

    def _loaded(self, path: Path, source, *, lineage: bool = False):
        """The state in ``source`` (with ``lineage``: and the lineage it records), or None
        (logged) when it cannot be used."""
        try:
            return _load_with_lineage(source) if lineage else load_file(source)
        except CheckpointError as e:
            return self._reject(path, str(e).split(": ", 1)[-1])
        except _LOAD_ERRORS as e:
            return self._reject(path, f"truncated or corrupt: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
        except FileNotFoundError:
            return self._reject(path, "missing")
        except OSError as e:
            return self._unreadable_file(path, e)

    def _reject(self, path: Path, reason: str) -> None:
        log.warning("checkpoint %s is unusable: %s", path, reason)
        return None

    def _unreadable_file(self, path: Path, error: OSError) -> None:
        reason = _os_reason(error)
        self._unreadable.append(f"{path.name}: {reason}")
        return self._reject(path, f"unreadable ({reason}); trying the one before it")

    def _warn_unlisted(self, entries: list[dict]) -> None:
        listed = {e["file"] for e in entries}
        for path, _, _ in _step_files(self.directory):
            if path.name not in listed:
                log.warning("%s is not listed in the manifest (a crash between writing it and the manifest?): "
                            "ignored", path)


_LEGACY = "legacy"
_ANY_STEP_FILE = re.compile(r"step_(\d+)(?:-([0-9a-z]+))?(?:-\d+)?\.pt")


def _complete_entry(entry) -> bool:
    return (isinstance(entry, dict) and {"file", "step", "sha256", "bytes"} <= entry.keys()
            and isinstance(entry["step"], int) and isinstance(entry.get("seq", 0), int)
            and isinstance(entry.get("lineage", ""), str))


def _read_manifest(path: Path) -> list[dict]:
    """The manifest's entries, oldest-written first; ValueError when it is not a list of complete entries.

    Entries without ``seq`` (written before lineages existed) are numbered in step order before all
    the others; entries without ``lineage`` get lineage ``"legacy"``.
    """
    entries = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(entries, list) or not all(_complete_entry(e) for e in entries):
        raise ValueError("not a list of {file, step, sha256, bytes[, lineage, seq]} entries")
    undated = sorted((e for e in entries if "seq" not in e), key=lambda e: e["step"])
    first = min((e["seq"] for e in entries if "seq" in e), default=len(undated) + 1)
    for i, entry in enumerate(undated):
        entry["seq"] = first - len(undated) + i
    for entry in entries:
        entry.setdefault("lineage", _LEGACY)
    return sorted(entries, key=lambda e: (e["seq"], e["step"]))


def _os_reason(error: OSError) -> str:
    """``EISDIR: Is a directory``: the errno's name and its text."""
    return f"{errno.errorcode.get(error.errno, error.errno)}: {error.strerror or error}"


def _step_files(directory: Path) -> list[tuple[Path, int, str]]:
    """``(path, step, lineage)`` of the step files in ``directory``; lineage ``"legacy"`` for plain names."""
    if not directory.is_dir():
        return []
    return [(p, int(m.group(1)), m.group(2) or _LEGACY) for p in directory.iterdir()
            if (m := _ANY_STEP_FILE.fullmatch(p.name))]


def _step_then_mtime(item: tuple[Path, int, str]) -> tuple[int, float]:
    path, step, _ = item
    try:
        return step, path.stat().st_mtime
    except FileNotFoundError:
        return step, 0.0


class _DirLock:
    """An exclusive ``flock`` on ``path``, written with the holder's pid and host. Released by
    ``release()``, when the object is garbage-collected, or by the kernel when the process dies."""

    def __init__(self, path: Path, wait_for_run_s: float = 0):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _locked_fd(path, wait_for_run_s)
        self._finalizer = None if fd is None else weakref.finalize(self, _unlock, fd, path, os.getpid())

    @property
    def held(self) -> bool:
        """False where the file system cannot lock (the lock was skipped with a warning)."""
        return self._finalizer is not None and self._finalizer.alive

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


def _locked_fd(path: Path, wait_for_run_s: float = 0) -> int | None:
    collected = False
    deadline = time.monotonic() + wait_for_run_s
    waiting_since = None
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder, run_id = _lock_holder(fd), _lock_run_id(fd)
            os.close(fd)
            if not collected and "this process" in holder:
                # An earlier trainer of this process that nobody closed: its store may be garbage
                # in a reference cycle, whose collection releases the lock.
                gc.collect()
                collected = True
                continue
            if run_id is not None and run_id == os.environ.get("TORCHELASTIC_RUN_ID") and time.monotonic() < deadline:
                # A process of this same run, from its last restart: a survivor still writing
                # the step it saves alone. The new round waits for it (bounded) instead of failing.
                if waiting_since is None:
                    waiting_since = time.monotonic()
                    log.warning("checkpoint.dir %s is locked by %s of this run (a survivor saving alone?): waiting "
                                "up to %.0f s for it", path.parent, holder, deadline - waiting_since)
                time.sleep(0.1)
                continue
            waited = "" if waiting_since is None else f" (waited {time.monotonic() - waiting_since:.0f} s for it)"
            raise CheckpointDirLocked(f"checkpoint.dir {path.parent} is in use by another run ({holder}){waited}: "
                                      f"wait for it to finish, or use another checkpoint.dir") from None
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            log.warning("cannot lock %s (%s): nothing stops a second run from writing %s at the same time",
                        path, e.strerror, path.parent)
            return None
        if _same_file(fd, path):
            break
        # The holder removed the file between our open and our lock: lock the file now at ``path``.
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}).encode())
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0))
    except ValueError:  # empty while the holder is writing it, or not ours
        return "holder unknown"
    if not (isinstance(info, dict) and isinstance(info.get("pid"), int) and isinstance(info.get("host"), str)):
        return "holder unknown"
    holder = f"pid {info['pid']} on {info['host']}"
    if info["pid"] == os.getpid() and info["host"] == socket.gethostname():
        holder += ", this process: close its other CheckpointStore first"
    return holder


def _lock_run_id(fd: int) -> str | None:
    """The torchrun run id the lock's holder recorded, if any."""
    try:
        info = json.loads(os.pread(fd, 4096, 0))
    except ValueError:
        return None
    run_id = info.get("run_id") if isinstance(info, dict) else None
    return run_id if isinstance(run_id, str) else None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _unlock(fd: int, path: Path, owner_pid: int) -> None:
    # Remove the file while still holding the lock, so that nobody can lock it after we let go;
    # a forked child closes its copy of the descriptor only.
    try:
        if os.getpid() == owner_pid and _same_file(fd, path):
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)
