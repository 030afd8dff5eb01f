"""Checkpoint I/O: atomic writes, the model fingerprint, and unwrapping DDP."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import torch


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside any stack of wrappers exposing ``.module`` (DDP, compile, ...)."""
    seen = set()
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module) and id(model) not in seen:
        seen.add(id(model))
        model = model.module
    return getattr(model, "_orig_mod", model)


def model_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over the state_dict's tensors in key order, as raw bytes: equal iff bit-identical."""
    digest = hashlib.sha256()
    for key, tensor in unwrap(model).state_dict().items():
        digest.update(key.encode())
        t = tensor.detach().cpu().contiguous()
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, rename over ``path``, fsync the dir."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(obj, path: str | Path) -> str:
    """torch.save ``obj`` atomically; returns the SHA-256 of the bytes written."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).hexdigest()


def load(path: str | Path, map_location="cpu"):
    return torch.load(path, map_location=map_location, weights_only=True)
