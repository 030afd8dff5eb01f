"""The loss-spike guard: the all-reduced training loss (the same float on every rank) against a
prediction from the recent window, so every rank decides alike with no collective of its own.

The prediction is a least-squares line through the last ``window`` losses, extrapolated one
step; the deviation is the line's residual standard deviation, widened by the extrapolation's
own uncertainty. A step whose loss lies more than ``threshold`` deviations above the prediction
is a spike: ``warn`` logs it, ``rollback`` (carried out by the trainer) restores the newest
checkpoint before it and excludes the spiking step's global samples from every epoch's
permutation, for the rest of the run and in every later checkpoint (framework/resilience/exclusions.py
keeps the list in checkpoint_dir, where a restart finds it).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from .config import SpikeSection
from ..train.events import Listener
from . import exclusions
from .markers import FatalError

log = logging.getLogger(__name__)

MIN_DEVIATION = 1e-4  # a perfectly flat window would make every wobble infinitely many deviations


def loss_z(history: list[float], loss: float) -> float:
    """How many deviations ``loss`` lies above the line through ``history`` extrapolated one step."""
    n = len(history)
    xm = (n - 1) / 2
    ym = sum(history) / n
    sxx = sum((x - xm) ** 2 for x in range(n))
    slope = sum((x - xm) * (y - ym) for x, y in enumerate(history)) / sxx
    predicted = ym + slope * (n - xm)
    residual = sum((y - ym - slope * (x - xm)) ** 2 for x, y in enumerate(history)) / max(n - 2, 1)
    deviation = math.sqrt(residual * (1 + 1 / n + (n - xm) ** 2 / sxx))
    return (loss - predicted) / max(deviation, MIN_DEVIATION * max(abs(predicted), 1.0))


@dataclass
class Spike:
    step: int
    loss: float
    z: float
    samples: list[int]


class SpikeGuard(Listener):
    """Observes each step's agreed loss; ``observe`` returns the Spike to roll back, if any. On the
    event bus: each step's end observes its loss, and ``pending`` holds the spike to roll back
    until the trainer takes it."""

    Config = SpikeSection  # the configuration's ``spike`` section, its first argument

    pending: Spike | None = None

    def step_end(self, result, model) -> None:
        self.pending = self.observe(result.step, result.loss, skipped=result.agreed.nonfinite)

    def __init__(self, spike, *, checkpoint_dir: str, exclude_samples: str, is_main: bool):
        """``spike``: the configuration's spike section; ``exclude_samples``: data.exclude_samples (a
        file of sample indices, or ""); rollbacks record what they exclude in ``checkpoint_dir``."""
        self.mode, self.threshold = spike.guard, spike.threshold
        self.warmup, self.window, self.max_rollbacks = spike.warmup, spike.window, spike.max_rollbacks
        self.cooldown = spike.lr_cooldown
        self.checkpoint_dir, self.is_main = checkpoint_dir, is_main
        self.history: list[float] = []
        self.seen = 0
        self.z = 0.0
        self.max_z = 0.0
        self.spikes: list[dict] = []  # every spike seen, rolled back or not
        self.rollbacks: list[dict] = []
        self.excluded: set[int] = set(exclusions.read(exclude_samples)) if exclude_samples else set()
        self.cooldown_from: int | None = None
        self.sampler = None

    def attach(self, sampler) -> None:
        """Apply the exclusions to ``sampler`` (now and after every change). A stream's samples
        (an IterableDataset's) have no indices: it gets warnings only."""
        if not hasattr(sampler, "exclude"):
            if self.mode == "rollback" or self.excluded:
                raise ValueError("spike.guard='rollback' and data.exclude_samples need a map-style train_dataset: the "
                                 "samples of an IterableDataset have no indices to exclude; use spike.guard=warn")
            return
        self.sampler = sampler
        sampler.exclude(self.excluded)

    def adopt_recorded(self) -> None:
        """A resumed run also excludes what a rollback recorded in checkpoint_dir after the
        checkpoint it resumes from was written."""
        try:
            recorded = exclusions.read_recorded(self.checkpoint_dir)
        except ValueError as err:
            raise FatalError(str(err)) from None
        if recorded is not None:
            self._merge(recorded["samples"], recorded["rollbacks"])
            restored = [int(r["restored_step"]) for r in recorded["rollbacks"]]
            if restored and (self.cooldown_from is None or max(restored) > self.cooldown_from):
                self.cooldown_from = max(restored)  # the cooldown of a rollback after this checkpoint

    def observe(self, step: int, loss: float, *, skipped: bool) -> Spike | None:
        """Record the loss of ``step``; returns a spike to roll back (mode rollback only)."""
        if self.mode == "off" or skipped or not math.isfinite(loss):
            return None
        self.seen += 1
        self.z = loss_z(self.history, loss) if self.seen > self.warmup and len(self.history) >= 3 else 0.0
        self.max_z = max(self.max_z, self.z)
        spike = None
        if self.z > self.threshold:
            spike = Spike(step, loss, self.z, [] if self.sampler is None else self.sampler.last_step_samples())
            self.spikes.append({"step": step, "loss": loss, "z": self.z})
            log.warning("loss spike at step %d: loss %.4f is %.1f deviations above the trend of the last %d steps "
                        "(spike.threshold=%g)%s", step, loss, self.z, len(self.history), self.threshold,
                        "" if self.mode == "rollback" else "; spike.guard=warn: continuing")
        if spike is None or self.mode == "warn":
            self.history = (self.history + [loss])[-self.window:]
        return spike if self.mode == "rollback" else None

    def roll_back(self, spike: Spike, restored_step: int | None) -> None:
        """Exclude the spike's samples; FATAL after more than max_rollbacks. ``restored_step`` is
        the checkpoint's step (None: there is none before the spike, and the run continues)."""
        if restored_step is None:
            log.error("loss spike at step %d: no checkpoint before it to roll back to; continuing (save a "
                      "checkpoint earlier, e.g. a smaller checkpoint.every_steps)", spike.step)
            return
        self.rollbacks.append({"step": spike.step, "restored_step": restored_step, "loss": spike.loss,
                               "z": spike.z, "samples": spike.samples})
        if len(self.rollbacks) > self.max_rollbacks:
            raise FatalError(f"more than spike.max_rollbacks={self.max_rollbacks} loss-spike rollbacks: " + "; ".join(
                f"step {r['step']} (samples {r['samples']})" for r in self.rollbacks))
        self._merge(spike.samples, [])
        self.cooldown_from = restored_step
        if self.is_main:
            exclusions.record(self.checkpoint_dir, sorted(self.excluded), self.rollbacks)
        log.warning("loss spike at step %d: rolled back to the checkpoint of step %d (rollback %d of at most %d); "
                    "its %d samples are excluded from now on: %s", spike.step, restored_step, len(self.rollbacks),
                    self.max_rollbacks, len(spike.samples), spike.samples)

    def lr_factor(self, step: int) -> float:
        """The learning-rate multiplier after a rollback: a linear ramp back to 1 over
        spike_lr_cooldown steps (``step`` counts from 0, as the schedule's does)."""
        if self.cooldown_from is None or not self.cooldown or step >= self.cooldown_from + self.cooldown:
            return 1.0
        return (step - self.cooldown_from + 1) / (self.cooldown + 1)

    def _merge(self, samples, rollbacks: list[dict]) -> None:
        self.excluded |= {int(i) for i in samples}
        known = {r["step"] for r in self.rollbacks}
        self.rollbacks += [r for r in rollbacks if r["step"] not in known]
        if self.sampler is not None:
            self.sampler.exclude(self.excluded)

    def scalars(self) -> dict[str, float]:
        return {"health/loss_z": self.z, "health/loss_spikes": len(self.spikes),
                "health/rollbacks": len(self.rollbacks)}

    def summary(self) -> dict:
        return {"loss_spikes": len(self.spikes), "rollbacks": len(self.rollbacks),
                "excluded_samples": len(self.excluded), "max_loss_z": self.max_z}

    def state_dict(self) -> dict:
        return {"history": list(self.history), "seen": self.seen, "max_z": self.max_z, "spikes": list(self.spikes),
                "excluded": sorted(self.excluded), "rollbacks": list(self.rollbacks),
                "cooldown_from": -1 if self.cooldown_from is None else self.cooldown_from}

    def load_state_dict(self, state: dict) -> None:
        """The detector's window comes from the checkpoint; what the run has learnt since (spikes,
        rollbacks, exclusions) is kept: after a rollback the older checkpoint knows less. An empty
        state is a checkpoint from before the guard."""
        if not state:
            return
        self.history, self.seen = [float(x) for x in state["history"]], int(state["seen"])
        self.max_z = max(self.max_z, float(state["max_z"]))
        known = {s["step"] for s in self.spikes}
        self.spikes += [s for s in state["spikes"] if s["step"] not in known]
        if self.cooldown_from is None and int(state["cooldown_from"]) >= 0:
            self.cooldown_from = int(state["cooldown_from"])
        self._merge(state["excluded"], state["rollbacks"])
