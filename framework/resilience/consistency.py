"""The model fingerprint and the cross-rank consistency check: every rank's parameters must stay
bitwise equal under DDP."""

from __future__ import annotations

import contextlib
import hashlib
import logging

import torch
import torch.distributed as dist

from .config import RecoverySection
from ..ddp.policy import unwrap
from ..train.events import Listener
from .markers import FatalError

log = logging.getLogger(__name__)

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIX = 0x9E3779B97F4A7C15 - 2**64  # odd, as a signed int64


def model_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over the state_dict's tensors in key order, as raw bytes: equal iff bit-identical."""
    digest = hashlib.sha256()
    for key, tensor in unwrap(model).state_dict().items():
        digest.update(key.encode())
        t = tensor.detach().cpu().contiguous()
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def parameter_hashes(model: torch.nn.Module) -> torch.Tensor:
    """One int64 per parameter: a position-weighted sum of the raw bits, so a 1-ulp change in
    any element changes it (a float sum could round the difference away)."""
    hashes = []
    for p in model.parameters():
        bits = p.detach().reshape(-1).view(_INT_VIEW[p.element_size()]).to(torch.int64)
        weights = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) * _MIX + 1
        hashes.append((bits * weights).sum())  # wraps modulo 2**64, deterministically
    return torch.stack(hashes).cpu()


def first_divergent(model: torch.nn.Module, device: torch.device) -> str | None:
    """The first parameter whose bits differ between ranks, or None; one all-reduce (MAX of the
    hashes and of their negations gives the maximum and the minimum at once)."""
    hashes = parameter_hashes(model)
    both = torch.cat([hashes, -hashes]).to(device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    both = both.cpu()
    n = hashes.numel()
    differs = (both[:n] != -both[n:]).nonzero()
    if differs.numel() == 0:
        return None
    names = [name for name, _ in model.named_parameters()]
    return names[int(differs[0])]



class ConsistencyCheck(Listener):
    """Every ``interval`` steps (0: never), one all-reduce checks that every rank holds
    bit-identical parameters; a difference is fatal and names the first parameter. On the event
    bus: at a step's end, in ``phase("consistency check")`` (the watchdog's)."""

    Config = RecoverySection  # the configuration's ``recovery`` section, its first argument

    def __init__(self, section, *, model: torch.nn.Module, device: torch.device, distributed: bool, phase=None,
                 skip=lambda: False):
        """``section``: the configuration's recovery section (``consistency_check_interval``);
        ``skip()``: True for a step about to be undone (a loss-spike rollback restores every rank's
        weights from one checkpoint), which is not checked."""
        self.phase = phase or (lambda name: contextlib.nullcontext())
        self.skip = skip
        self.model = model
        interval = section.consistency_check_interval
        self.interval = interval if distributed else 0
        self.device = device

    def step_end(self, result, model) -> None:
        if self.should_run(result.step) and not self.skip():
            with self.phase("consistency check"):
                self.maybe_check(result.step)

    def should_run(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    def maybe_check(self, step: int) -> None:
        if not self.should_run(step):
            return
        name = first_divergent(self.model, self.device)
        if name is not None:
            raise FatalError(f"ranks diverged by step {step}: parameter {name!r} differs between ranks")
