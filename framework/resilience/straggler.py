"""Straggler scores: each rank times the sections of its steps, and every ``straggler_interval``
steps one small all-gather shares the medians, so every rank holds every rank's timings and
decides alike.

A rank's score in a section is its median over the fastest rank's. Only the sections with no
collective in them can name a straggler: waiting for data, the forward/backward before the
synced backward, and the optimizer's own step. The synced backward is reported too, but a rank
that is long there is usually waiting in DDP's all-reduce for a slower one (so the straggler
shows the *lowest* score there). A rank is named when it is over ``straggler_threshold`` and
``straggler_min_ms`` slower than the fastest, in the same section, for ``straggler_patience``
checks in a row.

On the CPU every step is timed (a perf_counter reading per section). On CUDA a reading must
synchronize the device to be the section's own, so only the last ``TIMED_STEPS`` steps before
each check are timed there. With one process there is no collective and every score is 1.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .config import StragglerSection
from ..observability.logs import DETAIL
from ..train.events import Listener
from .markers import FatalError

log = logging.getLogger(__name__)

SECTIONS = ("data", "forward_backward", "synced_backward", "optimizer")
JUDGED = ("data", "forward_backward", "optimizer")  # no collective inside
TIMED_STEPS = 10


class SectionTimer:
    """Lap timing of one step's sections. ``lap(section)`` books the time since the previous lap
    to ``section`` (None: to nothing); untimed steps cost one comparison per lap."""

    def __init__(self, device: torch.device):
        self.device = device
        self.timing = False
        self.last = 0.0
        self.step_times = dict.fromkeys(SECTIONS, 0.0)
        self.samples: dict[str, list[float]] = {s: [] for s in SECTIONS}

    def begin(self, timed: bool) -> None:
        self.timing = timed
        if timed:
            self.step_times = dict.fromkeys(SECTIONS, 0.0)
            self.last = self._now()

    def lap(self, section: str | None) -> None:
        if not self.timing:
            return
        now = self._now()
        if section is not None:
            self.step_times[section] += now - self.last
        self.last = now

    def end(self) -> None:
        if self.timing:
            for section, seconds in self.step_times.items():
                self.samples[section].append(seconds)
            self.timing = False

    def medians_ms(self) -> list[float]:
        """The median of each section over the timed steps since the last call, in ms."""
        medians = [1e3 * statistics.median(self.samples[s]) if self.samples[s] else 0.0 for s in SECTIONS]
        self.samples = {s: [] for s in SECTIONS}
        return medians

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def off_the_clock_buffer_broadcast(model: torch.nn.Module, timer: SectionTimer) -> None:
    """DDP broadcasts rank 0's buffers before each synced forward, and a fast rank waits there for
    a slow one: a forward pre-hook on the wrapped module books that wait to no section (without
    it, both ranks of a model with buffers show the slow rank's delay and score 1). Not under
    torch.compile, which would trace the hook."""
    if isinstance(model, DDP) and next(model.module.buffers(), None) is not None:
        model.module.register_forward_pre_hook(lambda module, args: timer.lap(None))


def scores(medians: list[list[float]]) -> list[list[float]]:
    """Each rank's median over the fastest rank's, per section (1.0 where all are ~0)."""
    fastest = [min(column) for column in zip(*medians, strict=True)]
    return [[m / f if f > 1e-6 else 1.0 for m, f in zip(row, fastest, strict=True)] for row in medians]


def slow_sections(medians: list[list[float]], *, threshold: float, min_ms: float) -> dict[int, str]:
    """rank -> the judged section it is slowest in, for the ranks over both bars."""
    score = scores(medians)
    fastest = [min(column) for column in zip(*medians, strict=True)]
    slow = {}
    for rank, row in enumerate(score):
        over = [(row[i], s) for i, s in enumerate(SECTIONS)
                if s in JUDGED and row[i] > threshold and medians[rank][i] - fastest[i] > min_ms]
        if over:
            slow[rank] = max(over)[1]
    return slow


def timed_step(step: int, interval: int, *, distributed: bool, cuda: bool) -> bool:
    """Whether the step after ``step`` done steps is timed: every step on the CPU, the last
    ``TIMED_STEPS`` before each check on CUDA (their readings synchronize the device)."""
    if not interval or not distributed:
        return False
    return not cuda or interval - step % interval <= TIMED_STEPS


class StragglerMonitor(Listener):
    """Times every rank's sections and shares them every ``straggler.interval`` steps. On the
    event bus: the step's timing begins at its start, the data section ends when the data is
    ready, the step's timing ends at its end, where the periodic check runs in ``phase("straggler
    check")`` (the watchdog's, which the bus has disarmed before: it comes first)."""

    Config = StragglerSection  # the configuration's ``straggler`` section, its first argument

    def __init__(self, cfg, *, env, phase=None):
        self.phase = phase or (lambda name: contextlib.nullcontext())
        self.interval, self.threshold = cfg.interval, cfg.threshold
        self.patience, self.min_ms, self.action = cfg.patience, cfg.min_ms, cfg.action
        self.env = env
        self.timer = SectionTimer(env.device)
        self.streak: dict[int, int] = {}
        self.latest: dict[str, float] = {}
        self.hosts: list[str] | None = None

    def begin_step(self, step: int) -> None:
        """``step`` counts the steps done. The step about to run is timed on the CPU, and on CUDA
        when a check is near."""
        self.timer.begin(timed_step(step, self.interval, distributed=self.env.distributed,
                                    cuda=self.env.device.type == "cuda"))

    def step_start(self, step: int) -> None:
        self.begin_step(step)

    def data_ready(self, step: int, micro_batches: list | None) -> None:
        self.timer.lap("data")

    def step_end(self, result, model) -> None:
        self.timer.end()
        if self.should_check(result.step):
            with self.phase("straggler check"):
                self.check(result.step)

    def should_check(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    def check(self, step: int) -> None:
        """One all-gather of every rank's medians; rank 0 logs the scores; a rank slow for
        ``straggler_patience`` checks in a row is named (or, with action fatal, stops the run)."""
        if not self.env.distributed:
            self.latest = {**{f"straggler/{s}/rank0": 1.0 for s in SECTIONS}, "straggler/max_score": 1.0}
            return
        mine = torch.tensor(self.timer.medians_ms(), dtype=torch.float64, device=self.env.device)  # NCCL: on the GPU
        gathered = [torch.zeros_like(mine) for _ in range(self.env.world_size)]
        dist.all_gather(gathered, mine)
        if self.hosts is None:
            self.hosts = [""] * self.env.world_size
            dist.all_gather_object(self.hosts, socket.gethostname())
        medians = [g.tolist() for g in gathered]
        score = scores(medians)
        self.latest = {f"straggler/{s}/rank{r}": score[r][i] for r in range(len(score))
                       for i, s in enumerate(SECTIONS)}
        self.latest["straggler/max_score"] = max(score[r][i] for r in range(len(score))
                                                 for i, s in enumerate(SECTIONS) if s in JUDGED)
        slow = slow_sections(medians, threshold=self.threshold, min_ms=self.min_ms)
        if self.env.is_main:  # on the console only when a rank is slow; always in the log file
            log.info("step %d straggler scores (median over the fastest rank's): %s", step, "; ".join(
                f"rank {r}: " + ", ".join(f"{s} {score[r][i]:.2f} ({medians[r][i]:.1f} ms)"
                                          for i, s in enumerate(SECTIONS)) for r in range(len(score))),
                     extra=None if slow else DETAIL)
        self.streak = {r: self.streak.get(r, 0) + 1 for r in slow}
        for rank, section in slow.items():
            if self.streak[rank] >= self.patience:
                self._name(step, rank, section, medians)

    def _name(self, step: int, rank: int, section: str, medians: list[list[float]]) -> None:
        i = SECTIONS.index(section)
        fastest = min(row[i] for row in medians)
        message = (f"straggler: rank {rank} on host {self.hosts[rank]} is {medians[rank][i] / fastest:.2f}x the "
                   f"fastest rank in {section} (median {medians[rank][i]:.1f} ms against {fastest:.1f} ms) for "
                   f"{self.streak[rank]} checks in a row, up to step {step}")
        if self.action == "fatal":
            raise FatalError(f"{message} (straggler.action=fatal)")
        log.warning("%s", message)

    def scalars(self) -> dict[str, float]:
        return self.latest
