"""Fault injection, for rehearsing failures: ``fault_inject`` / DDP_FAULT_INJECT, e.g.
``nan@step=5,rank=1; oom@step=8; sigterm@step=4; sigkill@step=6,rank=1; hang@step=10,rank=0``.

A fault fires once, at the given step, on the given rank (all ranks if none), and only in the
first incarnation of the group (TORCHELASTIC_RESTART_COUNT=0) unless it says ``restart=N``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from dataclasses import dataclass

log = logging.getLogger(__name__)

KINDS = ("nan", "oom", "kill_worker", "hang", "sigterm", "sigkill", "ulp")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None
    restart: int = 0
    micro: int | None = None  # oom: the micro-step whose backward fails (default: the last)


def parse(spec: str) -> list[Fault]:
    """Parse a fault spec; raises ValueError naming the bad part and what is allowed."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, at, args = part.partition("@")
        kind = kind.strip()
        if kind not in KINDS:
            raise ValueError(f"fault {part!r}: unknown kind {kind!r}; allowed: {', '.join(KINDS)}")
        fields: dict[str, int] = {}
        for item in filter(None, (a.strip() for a in args.split(","))):
            key, eq, value = item.partition("=")
            if key not in ("step", "rank", "restart", "micro") or not eq or not value.strip().isdigit():
                raise ValueError(f"fault {part!r}: {item!r} must be step=N, rank=N, restart=N or micro=N")
            fields[key] = int(value)
        if "step" not in fields:
            raise ValueError(f"fault {part!r}: needs step=N, e.g. {kind}@step=5")
        faults.append(Fault(kind, fields["step"], fields.get("rank"), fields.get("restart", 0), fields.get("micro")))
    return faults


class FaultPlan:
    def __init__(self, spec: str, rank: int, restart_count: int | None = None):
        self.rank = rank
        self.restart_count = (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
                              if restart_count is None else restart_count)
        self.faults = parse(spec) if spec else []
        self.fired: set[Fault] = set()

    def due(self, kind: str, step: int, micro: int | None = None, last_micro: int = 0) -> bool:
        """True once for each fault of ``kind`` planned for ``step`` (and micro-step) on this rank
        and incarnation."""
        for fault in self.faults:
            if (fault.kind == kind and fault.step == step and fault not in self.fired
                    and fault.rank in (None, self.rank) and fault.restart == self.restart_count
                    and (micro is None or micro == (last_micro if fault.micro is None else fault.micro))):
                self.fired.add(fault)
                log.warning("fault injection: %s at step %d on rank %d", kind, step, self.rank)
                return True
        return False

    def fire_process_faults(self, step: int) -> None:
        """The faults that act on the whole process, at the start of ``step``."""
        if self.due("sigterm", step):
            os.kill(os.getpid(), signal.SIGTERM)
        if self.due("sigkill", step):
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.due("hang", step):
            # sleep(3) through ctypes.PyDLL keeps the GIL: no Python thread can run, only faulthandler.
            ctypes.PyDLL(None).sleep(10**6)


def oom_on_backward_of(module):
    """Make ``module``'s next forward output raise torch.OutOfMemoryError when backward reaches it
    (an injected OOM in the middle of a backward pass). Remove the returned handle after the forward."""
    import torch

    def raise_oom(grad):
        raise torch.OutOfMemoryError("injected OOM (fault_inject) in backward")

    def on_forward(mod, args, output):
        out = output[0] if isinstance(output, tuple) else output
        if out.requires_grad:
            out.register_hook(raise_oom)

    return module.register_forward_hook(on_forward)


def middle_module(model):
    """The middle one of the model's leaf-holding children, e.g. the middle transformer block."""
    blocks = getattr(model, "blocks", None)
    if blocks is not None and len(blocks):
        return blocks[len(blocks) // 2]
    modules = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    return modules[len(modules) // 2]


def nudge_one_ulp(model) -> str:
    """Move the first element of the first parameter by one ulp; returns the parameter's name."""
    import torch

    name, p = next(iter(model.named_parameters()))
    with torch.no_grad():
        flat = p.view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=p.dtype, device=p.device))
    return name
