"""Fault injection, for rehearsing failures: ``fault_inject`` / DDP_FAULT_INJECT, e.g.
``nan@step=5,rank=1; oom@step=8; sigterm@step=4; sigkill@step=6,rank=1; hang@step=10,rank=0``.

A fault fires once, at the given step, on the given rank (all ranks if none), and only in the
first start of the group (restart 0) unless it says ``restart=N``, or ``restart=*``
(in every restart: a failure that a restart cannot fix). ``slow@step=K,rank=R,ms=M`` is the
exception: it delays every forward from step K on by M ms (a straggler). The process faults
(sigterm, sigkill, sigstop, crash, hang) fire at the start of step K, or with ``at=eval`` at the start of
the evaluation after K steps, or with ``at=save`` once the checkpoint of step K is handed to its
background writer (the final save: before it is written), the final evaluation and save included,
or with ``at=export`` before the final weights of a run that ended at step K are exported.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

from ..train.events import Listener

log = logging.getLogger(__name__)

KINDS = ("nan", "oom", "kill_worker", "hang", "sigterm", "sigkill", "sigstop", "ulp", "bad_data", "crash", "slow")
ANY_RESTART = -1
PROCESS_KINDS = ("sigterm", "sigkill", "sigstop", "crash", "hang")
MOMENTS = ("step", "eval", "save", "export")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None
    restart: int = 0  # ANY_RESTART: every restart
    micro: int | None = None  # oom: the micro-step whose backward fails (default: the last)
    ms: int = 0  # slow: the delay added to each forward from ``step`` on
    at: str = "step"  # process faults: the start of step K, or of the evaluation, checkpoint save or export after it


def parse(spec: str) -> list[Fault]:
    """Parse a fault spec; raises ValueError naming the bad part and what is allowed."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, at, args = part.partition("@")
        kind = kind.strip()
        if kind not in KINDS:
            raise ValueError(f"fault {part!r}: unknown kind {kind!r}; allowed: {', '.join(KINDS)}")
        fields: dict[str, int] = {}
        at = "step"
        for item in filter(None, (a.strip() for a in args.split(","))):
            key, eq, value = item.partition("=")
            if key == "restart" and value.strip() == "*":
                fields[key] = ANY_RESTART
                continue
            if key == "at":
                at = value.strip()
                if at not in MOMENTS or (at != "step" and kind not in PROCESS_KINDS):
                    raise ValueError(f"fault {part!r}: at={at!r}: allowed: at=step, or at=eval|save|export for "
                                     f"{', '.join(PROCESS_KINDS)}")
                if at == "export" and kind in ("hang", "sigstop"):
                    # The export runs after the last collective, with the watchdog closed: rank 0
                    # writes files, and nothing waits on it that a deadline could end.
                    raise ValueError(f"fault {part!r}: {kind} at=export: allowed: sigterm, sigkill or crash at=export "
                                     "(the export runs after the watchdog is closed)")
                continue
            if key not in ("step", "rank", "restart", "micro", "ms") or not eq or not value.strip().isdigit():
                raise ValueError(f"fault {part!r}: {item!r} must be step=N, rank=N, restart=N|*, micro=N, ms=N "
                                 "or at=step|eval|save|export")
            fields[key] = int(value)
        if "step" not in fields:
            raise ValueError(f"fault {part!r}: needs step=N, e.g. {kind}@step=5")
        if (kind == "slow") != ("ms" in fields):
            raise ValueError(f"fault {part!r}: " + ("ms=N is for slow faults only" if "ms" in fields
                                                   else "needs ms=N, e.g. slow@step=5,rank=1,ms=40"))
        faults.append(Fault(kind, fields["step"], fields.get("rank"), fields.get("restart", 0), fields.get("micro"),
                            fields.get("ms", 0), at))
    return faults


class FaultPlan(Listener):
    """The faults planned for this rank and restart, attached to the run's moments
    (framework/train/events.py): the start of a step, a micro-batch, a micro-step's forward and
    backward, the gradients, the end of a step, an evaluation, a checkpoint save, the export."""

    def __init__(self, spec: str, rank: int, group_restarts: int):
        self.rank = rank
        self.group_restarts = group_restarts
        self.faults = parse(spec) if spec else []
        self.fired: set[Fault] = set()
        self.eager_now = False  # an injected OOM hook is on for the current micro-step

    def due(self, kind: str, step: int, micro: int | None = None, last_micro: int = 0, at: str = "step") -> bool:
        """True once for each fault of ``kind`` planned for ``step`` (and micro-step, and moment) on
        this rank and restart."""
        for fault in self.faults:
            if (fault.kind == kind and fault.step == step and fault.at == at and fault not in self.fired
                    and self._mine(fault)
                    and (micro is None or micro == (last_micro if fault.micro is None else fault.micro))):
                self.fired.add(fault)
                during = {"step": "", "eval": " (during the evaluation)", "save": " (during the checkpoint save)",
                          "export": " (before the export)"}
                log.warning("fault injection: %s at step %d on rank %d%s", kind, step, self.rank, during[at])
                return True
        return False

    def _mine(self, fault: Fault) -> bool:
        return fault.rank in (None, self.rank) and fault.restart in (ANY_RESTART, self.group_restarts)

    def step_start(self, step: int) -> None:
        self.fire_process_faults(step)

    def evaluation(self, step: int) -> None:
        self.fire_process_faults(step, at="eval")

    def save(self, step: int) -> None:
        self.fire_process_faults(step, at="save")

    def export(self, step: int) -> None:
        self.fire_process_faults(step, at="export")

    def fire_process_faults(self, step: int, at: str = "step") -> None:
        """The faults that act on the whole process, at the start of ``step``, or at the moment
        ``at`` after ``step`` steps (see the module docstring)."""
        if not self.faults:
            return
        if self.due("sigterm", step, at=at):
            os.kill(os.getpid(), signal.SIGTERM)
        if self.due("sigkill", step, at=at):
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.due("sigstop", step, at=at):  # frozen: a peer hears nothing, not even a closed connection
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.due("crash", step, at=at):
            raise RuntimeError(f"fault injection: crash at step {step}" + ("" if at == "step" else f" ({at})"))
        if self.due("hang", step, at=at):
            # sleep(3) through ctypes.PyDLL keeps the GIL: no Python thread can run, only faulthandler.
            ctypes.PyDLL(None).sleep(10**6)

    @contextlib.contextmanager
    def micro_step(self, step: int, micro: int, last_micro: int, model, kill_worker: Callable[[], int | None]):
        """Around one micro-step's forward and backward: an OOM raised from the backward of the
        model's middle block, and a DataLoader worker killed during the last backward. Yields
        ``on_loss(loss)``, to be called between forward and backward."""
        hook = middle_module(model).register_forward_hook(_raise_oom_in_backward) if (
            self.faults and self.due("oom", step, micro, last_micro)) else None
        # A compiled graph does not see a hook added after compilation: this micro-step runs eagerly.
        self.eager_now = hook is not None
        if self.faults and micro == 0:
            delay = sum(f.ms for f in self.faults if f.kind == "slow" and f.step <= step and self._mine(f))
            time.sleep(delay / 1000)
        kill = bool(self.faults) and micro == last_micro and self.due("kill_worker", step)

        def on_loss(loss) -> None:
            if kill:
                loss.register_hook(lambda grad: log.warning(
                    "fault injection: killed DataLoader worker %s during backward", kill_worker()))
        try:
            yield on_loss
        finally:
            if hook is not None:
                hook.remove()

    def micro_batch(self, step: int, micro: int, batch):
        """Bad data: the step's first micro-batch on this rank gets uniformly random targets (the
        last element of a tuple, or ``labels``), seeded by step and rank, so the loss spike is a
        real one and the same in every rerun."""
        if not (self.faults and micro == 0 and self.due("bad_data", step)):
            return batch
        import torch
        gen = torch.Generator().manual_seed(1_000_003 * step + self.rank)

        def randomized(targets):
            high = max(int(targets.max()) + 1, 2)
            return torch.randint(0, high, targets.shape, generator=gen).to(targets.device, targets.dtype)
        if isinstance(batch, dict):
            return {**batch, "labels": randomized(batch["labels"])}
        return type(batch)([*batch[:-1], randomized(batch[-1])])

    def gradients(self, step: int, model) -> None:
        """After backward: a NaN in this rank's first gradient."""
        if self.faults and self.due("nan", step):
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")

    def step_end(self, result, model) -> None:
        """After the optimizer step: this rank's first parameter moved by one ulp."""
        if self.faults and self.due("ulp", result.step):
            log.warning("fault injection: %s nudged by one ulp", nudge_one_ulp(model))


def _raise_oom_in_backward(module, args, output) -> None:
    import torch

    def raise_oom(grad):
        raise torch.OutOfMemoryError("injected OOM (recovery.fault_inject) in backward")

    out = output[0] if isinstance(output, tuple) else output
    if out.requires_grad:
        out.register_hook(raise_oom)


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
