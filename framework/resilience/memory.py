"""Memory readings per rank and the garbage-collection policy during training."""

from __future__ import annotations

import gc

import psutil
import torch

GIB = 1024 ** 3


def memory_stats(device: torch.device) -> dict[str, float]:
    """RSS of this process and the system's available memory, plus CUDA allocator figures, in GiB."""
    stats = {"rss_gb": psutil.Process().memory_info().rss / GIB,
             "system_available_gb": psutil.virtual_memory().available / GIB}
    if device.type == "cuda":
        stats.update(cuda_allocated_gb=torch.cuda.memory_allocated(device) / GIB,
                     cuda_reserved_gb=torch.cuda.memory_reserved(device) / GIB,
                     cuda_peak_gb=torch.cuda.max_memory_allocated(device) / GIB)
    return stats


# Allocation failures that CUDA libraries report as plain RuntimeErrors.
_OOM_MESSAGES = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "CUDA error: out of memory")


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is an out-of-memory error: torch's own, or one a CUDA library raised."""
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and any(m in str(err) for m in _OOM_MESSAGES))


def in_use_gb(stats: dict[str, float]) -> float:
    return stats.get("cuda_reserved_gb", stats["rss_gb"])


class GcPolicy:
    """Automatic gc off while training; a young-generation collection every ``interval`` steps,
    at the same step on every rank so no rank stalls the others at a random moment."""

    def __init__(self, interval: int, device: torch.device):
        self.interval = interval
        self.device = device
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> "GcPolicy":
        gc.disable()
        return self

    def step(self, step: int) -> None:
        if step % self.interval == 0:
            gc.collect(1)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def __exit__(self, *exc) -> None:
        if self._was_enabled:
            gc.enable()
