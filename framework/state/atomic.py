"""Atomic file writes: a crash leaves either the old file or the new one, never a partial one.

The temp file is made by ``tempfile.mkstemp`` in the target's directory (``.NAME.tmp.XXXXXXXX``: an
unpredictable name, created with O_CREAT|O_EXCL|O_NOFOLLOW), so a symlink that another user plants
in a shared directory cannot redirect the write; the rename replaces a symlink at the final name
instead of following it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

# mkstemp creates 0600 files; the files written here get the mode open() would give them. Read once,
# in the importing (main) thread: os.umask can only be read by setting it.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[BinaryIO]:
    """A new temp file, open for writing, that replaces ``path`` when the block ends without an
    error (flushed, fsynced, renamed, the directory fsynced); after an error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp.", dir=path.parent)
    try:
        with open(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # A partial temp file of a failed write (a full disk, say) would hold on to the space
        # that the error report (the FATAL marker) needs.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: str | Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see ``replacing``)."""
    with replacing(path) as f:
        f.write(data)


class _Hashing:
    """A write-only file object that counts and hashes what passes through it to ``file``, and keeps
    the OSError of a failed write: torch.save's zip writer turns it into a RuntimeError ("unexpected
    pos ..."), which would hide a full disk (ENOSPC, EFBIG) behind a generic error."""

    def __init__(self, file: BinaryIO):
        self.file = file
        self.sha256 = hashlib.sha256()
        self.bytes = 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            written = self.file.write(view)
        except OSError as err:
            self.error = err
            raise
        if written != len(view):  # a buffered file in blocking mode writes all or raises
            self.error = OSError(errno.EIO, f"short write: {written} of {len(view)} bytes")
            raise self.error
        self.sha256.update(view)
        self.bytes += len(view)
        return written

    def flush(self) -> None:
        self.file.flush()


def torch_save(obj, path: str | Path) -> tuple[str, int]:
    """torch.save ``obj`` atomically, streamed into the file (no serialised copy in memory);
    returns the SHA-256 and the size of the bytes written. A failed write raises its OSError."""
    import torch

    with replacing(path) as f:
        out = _Hashing(f)
        try:
            torch.save(obj, out)
        except Exception:  # re-raised below: the failed write's OSError rather than torch's RuntimeError
            if out.error is not None:
                raise out.error from None
            raise
        if out.error is not None:
            raise out.error
    return out.sha256.hexdigest(), out.bytes
