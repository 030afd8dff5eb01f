"""The run's event bus: the named moments of a run, and the listeners attached to them.

The training code announces each moment once, through ``EventBus``; it never calls what listens.
What surrounds a step listens: the step-start buffer snapshot, the watchdog, the straggler timing,
the spike guard, the sample and step logs; then fault injection
(``framework.resilience.faults.FaultPlan``), which acts on the process, the batch, the gradients or
the weights; the user's callbacks (``framework.train.callbacks.UserCallbacks``), which are told what
happened; the start-up clock and the consistency check (framework/trainer.py attaches them, in
that order). Listeners are called in the order they were attached.

The moments, in the order a step meets them:

- ``train_start()``: the loop is about to run its first step;
- ``step_start(step)``: before step ``step + 1`` takes its data (``step`` steps are done);
- ``data_ready(step, micro_batches)``: the step's micro-batches were read (None: the data ran out,
  and no step follows);
- ``micro_batch(step, micro, batch) -> batch``: a micro-batch on the device, before its forward;
- ``micro_step(step, micro, last_micro, model, kill_worker)``: a context around one micro-step's
  forward and backward, yielding ``on_loss(loss)`` to be called between the two;
- ``gradients(step, model)``: after the last backward, before the optimizer step;
- ``step_end(result, model)``: after step ``result.step`` (a ``StepResult``);
- ``evaluation(step)``: an evaluation after ``step`` steps begins; ``evaluated(step, val_loss)``: it ended;
- ``save(step)``: the checkpoint of ``step`` was handed to its writer (mid-run), or is about to be
  written (the final save); ``saved(step)``: it is on disk;
- ``export(step)``: the final weights are about to be exported;
- ``train_end(summary)``: the run ended, with its summary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class StepResult:
    """A committed step: its number (steps done), the epoch, the agreement of the ranks (the mean
    loss and the control flags: framework/train/agreement.py), the learning rate, the gradient norm
    (a tensor), the tokens of every rank, and the sample indices this rank trained on."""

    step: int
    epoch: int
    agreed: Any  # framework.train.agreement.Agreement
    lr: float
    grad_norm: Any
    tokens: int
    indices: list

    @property
    def loss(self) -> float:
        return self.agreed.loss

    def metrics(self) -> dict:
        """The figures a user's on_step_end gets."""
        return {"loss": self.agreed.loss, "lr": self.lr, "grad_norm": float(self.grad_norm), "tokens": self.tokens}


class Listener:
    """What a listener may override; every moment does nothing by default."""

    eager_now = False  # True while a listener needs the current micro-step run uncompiled (a hook of its own)

    def train_start(self) -> None: ...
    def step_start(self, step: int) -> None: ...
    def data_ready(self, step: int, micro_batches: list | None) -> None: ...
    def micro_batch(self, step: int, micro: int, batch):
        return batch

    @contextlib.contextmanager
    def micro_step(self, step: int, micro: int, last_micro: int, model, kill_worker: Callable[[], int | None]):
        yield lambda loss: None

    def gradients(self, step: int, model) -> None: ...
    def step_end(self, result: StepResult, model) -> None: ...
    def evaluation(self, step: int) -> None: ...
    def evaluated(self, step: int, val_loss: float | None) -> None: ...
    def save(self, step: int) -> None: ...
    def saved(self, step: int) -> None: ...
    def export(self, step: int) -> None: ...
    def train_end(self, summary: dict) -> None: ...


class EventBus(Listener):
    """The seam: announces each moment to every attached listener."""

    def __init__(self, *listeners: Listener):
        self.listeners = list(listeners)

    def attach(self, listener: Listener, *, before: Listener | None = None) -> None:
        """Call ``listener`` last, or just before ``before``."""
        self.listeners.insert(self.listeners.index(before) if before in self.listeners else len(self.listeners),
                              listener)

    def detach(self, listener: Listener) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)

    @property
    def eager_now(self) -> bool:
        return any(listener.eager_now for listener in self.listeners)

    def _announce(self, moment: str, *args) -> None:
        for listener in self.listeners:
            getattr(listener, moment)(*args)

    def train_start(self) -> None:
        self._announce("train_start")

    def step_start(self, step: int) -> None:
        self._announce("step_start", step)

    def data_ready(self, step: int, micro_batches: list | None) -> None:
        self._announce("data_ready", step, micro_batches)

    def micro_batch(self, step: int, micro: int, batch):
        for listener in self.listeners:
            batch = listener.micro_batch(step, micro, batch)
        return batch

    @contextlib.contextmanager
    def micro_step(self, step: int, micro: int, last_micro: int, model, kill_worker: Callable[[], int | None]):
        with contextlib.ExitStack() as stack:
            calls = [stack.enter_context(listener.micro_step(step, micro, last_micro, model, kill_worker))
                     for listener in self.listeners]

            def on_loss(loss) -> None:
                for call in calls:
                    call(loss)
            yield on_loss

    def gradients(self, step: int, model) -> None:
        self._announce("gradients", step, model)

    def step_end(self, result: StepResult, model) -> None:
        self._announce("step_end", result, model)

    def evaluation(self, step: int) -> None:
        self._announce("evaluation", step)

    def evaluated(self, step: int, val_loss: float | None) -> None:
        self._announce("evaluated", step, val_loss)

    def save(self, step: int) -> None:
        self._announce("save", step)

    def saved(self, step: int) -> None:
        self._announce("saved", step)

    def export(self, step: int) -> None:
        self._announce("export", step)

    def train_end(self, summary: dict) -> None:
        self._announce("train_end", summary)
