"""Atomic file writes: a crash leaves either the old file or the new one, never a partial one."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, rename over ``path``, fsync the dir."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # A partial temp file of a failed write (a full disk, say) would hold on to the space
        # that the error report (the FATAL marker) needs.
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(obj, path: str | Path) -> str:
    """torch.save ``obj`` atomically; returns the SHA-256 of the bytes written."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    write_bytes(path, data)
    return hashlib.sha256(data).hexdigest()
