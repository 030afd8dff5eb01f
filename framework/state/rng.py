"""This process's random number generators: seeding, and capturing/restoring their states.

``capture()`` returns plain types only (lists, ints, floats, strings, tensors), so the state
loads under ``torch.load(weights_only=True)`` as part of a checkpoint.
"""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import torch

log = logging.getLogger(__name__)

_GENERATOR = np.random.Generator(np.random.PCG64(0))
_REQUIRED = ("python", "torch", "numpy", "numpy_generator")


def numpy_generator() -> np.random.Generator:
    """The framework's own numpy Generator (PCG64); its state is part of ``capture()``."""
    return _GENERATOR


def seed_all(seed: int) -> None:
    """Seed Python's ``random``, numpy's global generator, torch (CPU and CUDA) and ``numpy_generator()``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    _GENERATOR.bit_generator.state = np.random.PCG64(seed).state


def seed_step(seed: int, rank: int, step: int) -> None:
    """Seed this rank's generators from ``(seed, rank, step)`` alone, before the step after
    ``step`` finished steps: what any rank draws in a step (dropout, a new epoch's loader seed)
    is then known without any saved state, to a restart at any world size too. About 20 us
    (CUDA's generators only once CUDA is initialised; torch.manual_seed checks every backend, 90 us)."""
    derived = int(np.random.SeedSequence([seed, rank, step]).generate_state(1, np.uint64)[0]) >> 1
    random.seed(derived)
    np.random.seed(derived % 2**32)
    torch.default_generator.manual_seed(derived)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(derived)
    _GENERATOR.bit_generator.state = np.random.PCG64(derived).state


def use_deterministic_kernels() -> None:
    """Deterministic kernels only (bit-reproducible runs; slower on CUDA)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def _plain(obj):
    """``obj`` with numpy arrays and scalars turned into Python lists and numbers."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def capture() -> dict:
    """The states of this process's generators: python, torch, cuda (if available), numpy, numpy_generator."""
    version, internal, gauss_next = random.getstate()
    state = {
        "python": [version, list(internal), gauss_next],
        "torch": torch.get_rng_state(),
        "numpy": _plain(np.random.get_state(legacy=False)),
        "numpy_generator": _plain(_GENERATOR.bit_generator.state),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict) -> None:
    """Set every generator to the state ``capture()`` returned."""
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise ValueError(f"RNG state lacks {missing}: it was not written by framework.state.rng.capture()")
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state({**np_state, "state": {**np_state["state"],
                                               "key": np.asarray(np_state["state"]["key"], dtype=np.uint32)}})
    _GENERATOR.bit_generator.state = state["numpy_generator"]
    _restore_cuda(state.get("cuda"))


def _restore_cuda(cuda_states) -> None:
    if cuda_states is None:
        return
    if not torch.cuda.is_available():
        log.warning("the RNG state holds %d CUDA generator states, but CUDA is not available: not restored",
                    len(cuda_states))
        return
    devices = torch.cuda.device_count()
    if len(cuda_states) != devices:
        log.warning("the RNG state holds %d CUDA generator states for %d visible devices: restoring the first %d",
                    len(cuda_states), devices, min(devices, len(cuda_states)))
    torch.cuda.set_rng_state_all(cuda_states[:devices])
