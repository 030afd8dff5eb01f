"""Checkpoint files: the safe loader, the CPU snapshot, and the checkpoint manager.

A checkpoint directory holds ``step_00000042.pt`` files, each the whole training state, and
``manifest.json``, a list of ``{"file", "step", "sha256", "bytes"}`` entries, oldest first. Each
file is written atomically before the manifest is rewritten (also atomically) to list it, so the
manifest never names a partial file. Rank 0 writes; every rank may load.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import logging
import pickle
import re
import threading
import time
from pathlib import Path

import torch

from . import atomic

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_STEP_FILE = re.compile(r"step_(\d+)\.pt")
_PLAIN = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)
# What torch.load raises on a truncated or corrupt file.
_LOAD_ERRORS = (RuntimeError, EOFError, pickle.UnpicklingError)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: refused by the safe loader, or not fitting the model."""


def load_file(path: str | Path) -> dict:
    """Load a checkpoint onto the CPU with the safe loader; refuse anything but tensors and plain types.

    Raises CheckpointError when the file holds other objects (for example a pickle that would run
    code); truncated or corrupt files raise torch.load's own RuntimeError or EOFError.
    """
    source = path if isinstance(path, io.BytesIO) else Path(path)
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        name = Path(path).name if not isinstance(path, io.BytesIO) else "<bytes>"
        raise CheckpointError(f"{name}: refused: not a plain tensor/dict checkpoint "
                              f"({_unpickling_detail(e)})") from e


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


class CheckpointManager:
    """Save training states asynchronously to ``directory``, keep the newest ``keep_last``, and find
    the newest one that is intact.

    Only ``rank`` 0 writes: on other ranks ``save``, ``wait`` and ``close`` do nothing and return
    None. Every rank may call ``latest_valid`` and ``load_file``.
    """

    def __init__(self, directory: str | Path, keep_last: int = 3, rank: int = 0):
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: must be at least 1")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.rank = rank
        self.last_wait_s: float | None = None
        """Seconds the last ``save`` waited for the previous write to finish."""
        self.last_stall_s: float | None = None
        """Seconds the last ``save`` held the caller while copying the state to CPU memory."""
        self.last_write_s: float | None = None
        """Seconds the last background write took: serialise, hash, write, manifest, prune."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if rank == 0:
            self._remove_stale_temp_files()

    load_file = staticmethod(load_file)

    @property
    def manifest_path(self) -> Path:
        return self.directory / MANIFEST

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- writing (rank 0) --------------------------------------------------------------------
    def save(self, state: dict, step: int, *, blocking: bool = False) -> Path | None:
        """Copy ``state`` to CPU memory, then write it as ``step``'s checkpoint in a background thread.

        The caller waits only for the previous write to finish and for the copy; with
        ``blocking=True`` it also waits for this write. An error of the previous write is raised
        here. Returns the path being written (None on ranks other than 0).
        """
        if self.rank != 0:
            return None
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: must be a non-negative int")
        start = time.perf_counter()
        self.wait()
        self.last_wait_s = time.perf_counter() - start
        start = time.perf_counter()
        snapshot = to_cpu(state)
        self.last_stall_s = time.perf_counter() - start
        path = self.directory / step_file(step)
        self._thread = threading.Thread(target=self._write_guarded, args=(snapshot, step, path),
                                        name=f"checkpoint-writer-{step}")
        self._thread.start()
        if blocking:
            self.wait()
        return path

    def wait(self) -> None:
        """Block until the background write finishes; re-raise the exception it failed with, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Wait for the pending write (raising its error, if any)."""
        self.wait()

    def _write_guarded(self, snapshot: dict, step: int, path: Path) -> None:
        try:
            self._write(snapshot, step, path)
        except BaseException as e:  # handed to wait(), which re-raises it in the caller's thread
            log.error("writing checkpoint %s failed: %s: %s", path, type(e).__name__, e)
            self._error = e

    def _write(self, snapshot: dict, step: int, path: Path) -> None:
        start = time.perf_counter()
        buf = io.BytesIO()
        torch.save(snapshot, buf)
        data = buf.getvalue()
        entry = {"file": path.name, "step": step, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        atomic.write_bytes(path, data)
        entries = [e for e in self._read_manifest_for_update(step) if e["step"] != step] + [entry]
        entries.sort(key=lambda e: e["step"])
        kept = entries[-self.keep_last:]
        atomic.write_bytes(self.manifest_path, json.dumps(kept, indent=2).encode())
        self._prune(kept)
        self.last_write_s = time.perf_counter() - start
        log.info("checkpoint step %d written: %s, %.1f MB, stall %.3f s, write %.3f s", step, path,
                 len(data) / 2**20, self.last_stall_s or 0.0, self.last_write_s)

    def _read_manifest_for_update(self, new_step: int) -> list[dict]:
        try:
            return _read_manifest(self.manifest_path)
        except FileNotFoundError:
            return self._entries_from_files(new_step)
        except ValueError as e:
            log.warning("%s is unreadable (%s): rebuilding it", self.manifest_path, e)
            return self._entries_from_files(new_step)

    def _entries_from_files(self, new_step: int) -> list[dict]:
        """Manifest entries for the older step files on disk that load, so that pruning keeps them."""
        entries = []
        for path, step in _step_files(self.directory):
            if step == new_step:
                continue
            data = path.read_bytes()
            if self._loaded(path, io.BytesIO(data)) is not None:
                entries.append({"file": path.name, "step": step, "sha256": hashlib.sha256(data).hexdigest(),
                                "bytes": len(data)})
        if entries:
            log.warning("no usable manifest in %s: listing the %d step files that load", self.directory, len(entries))
        return entries

    def _prune(self, kept: list[dict]) -> None:
        """Delete the step files older than the oldest kept entry (the manifest no longer names them)."""
        oldest = kept[0]["step"]
        for path, step in _step_files(self.directory):
            if step < oldest:
                log.info("removing old checkpoint %s (keep_last=%d)", path, self.keep_last)
                path.unlink(missing_ok=True)

    def _remove_stale_temp_files(self) -> None:
        if not self.directory.is_dir():
            return
        for path in self.directory.glob(".*.tmp.*"):
            log.warning("removing %s, left by an interrupted write", path)
            path.unlink(missing_ok=True)

    # --- reading (any rank) ------------------------------------------------------------------
    def latest_valid(self) -> tuple[Path, dict] | None:
        """The newest checkpoint that is intact, as ``(path, state)``, or None when there is none.

        Goes newest-first through the manifest, checking each file's size and SHA-256 and that it
        loads; without a readable manifest, goes newest-first through the ``step_*.pt`` files,
        checking that each loads. Every rejected file is logged as a WARNING with the reason.
        """
        if self.rank == 0:
            self.wait()
        try:
            entries = _read_manifest(self.manifest_path)
        except FileNotFoundError:
            return self._latest_by_scan(f"{self.manifest_path} is missing")
        except (ValueError, OSError) as e:
            return self._latest_by_scan(f"{self.manifest_path} is unreadable ({e})")
        self._warn_unlisted(entries)
        for entry in reversed(entries):
            path = self.directory / entry["file"]
            state = self._verified(path, entry)
            if state is not None:
                return path, state
        return None

    def _verified(self, path: Path, entry: dict) -> dict | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return self._reject(path, "missing")
        if len(data) < entry["bytes"]:
            return self._reject(path, f"truncated ({len(data)} of {entry['bytes']} bytes)")
        if len(data) > entry["bytes"]:
            return self._reject(path, f"size mismatch ({len(data)} bytes, the manifest says {entry['bytes']})")
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            return self._reject(path, "checksum mismatch")
        return self._loaded(path, io.BytesIO(data))

    def _latest_by_scan(self, why: str) -> tuple[Path, dict] | None:
        files = sorted(_step_files(self.directory), key=lambda item: item[1], reverse=True)
        if files:
            log.warning("%s: falling back to scanning %d step_*.pt files in %s", why, len(files), self.directory)
        for path, _ in files:
            state = self._loaded(path, path)
            if state is not None:
                return path, state
        return None

    def _loaded(self, path: Path, source) -> dict | None:
        try:
            return load_file(source)
        except CheckpointError as e:
            return self._reject(path, str(e).split(": ", 1)[-1])
        except _LOAD_ERRORS as e:
            return self._reject(path, f"truncated or corrupt: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")

    def _reject(self, path: Path, reason: str) -> None:
        log.warning("checkpoint %s is unusable: %s", path, reason)
        return None

    def _warn_unlisted(self, entries: list[dict]) -> None:
        newest = entries[-1]["step"] if entries else -1
        listed = {e["file"] for e in entries}
        for path, step in _step_files(self.directory):
            if step > newest and path.name not in listed:
                log.warning("%s is newer than every manifest entry but not listed (a crash between writing it "
                            "and the manifest?): ignored", path)


def _read_manifest(path: Path) -> list[dict]:
    """The manifest's entries, oldest first; ValueError when it is not a list of complete entries."""
    entries = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and {"file", "step", "sha256", "bytes"} <= e.keys() and isinstance(e["step"], int)
            for e in entries):
        raise ValueError("not a list of {file, step, sha256, bytes} entries")
    return sorted(entries, key=lambda e: e["step"])


def _step_files(directory: Path) -> list[tuple[Path, int]]:
    if not directory.is_dir():
        return []
    return [(p, int(m.group(1))) for p in directory.iterdir() if (m := _STEP_FILE.fullmatch(p.name))]
