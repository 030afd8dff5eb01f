"""The named moments of a run, and the listeners attached to them.

The training code announces each moment once, through ``Moments``; it never calls what listens.
Two kinds of listener attach: fault injection (``framework.testing.faults.FaultPlan``), which acts
on the process, the batch, the gradients or the weights, and the user's callbacks
(``framework.train.callbacks.UserCallbacks``), which are told what happened. Listeners are called
in the order they were attached.

The moments, in the order a step meets them:

- ``train_start()``: the loop is about to run its first step;
- ``step_start(step)``: before step ``step + 1`` takes its data (``step`` steps are done);
- ``micro_batch(step, micro, batch) -> batch``: a micro-batch on the device, before its forward;
- ``micro_step(step, micro, last_micro, model, kill_worker)``: a context around one micro-step's
  forward and backward, yielding ``on_loss(loss)`` to be called between the two;
- ``gradients(step, model)``: after the last backward, before the optimizer step;
- ``step_end(step, model, metrics)``: after step ``step``; ``metrics()`` builds its figures;
- ``evaluation(step)``: an evaluation after ``step`` steps begins; ``evaluated(step, val_loss)``: it ended;
- ``save(step)``: the checkpoint of ``step`` was handed to its writer (mid-run), or is about to be
  written (the final save); ``saved(step)``: it is on disk;
- ``export(step)``: the final weights are about to be exported;
- ``train_end(summary)``: the run ended, with its summary.
"""

from __future__ import annotations

import contextlib
from typing import Callable


class Listener:
    """What a listener may override; every moment does nothing by default."""

    eager_now = False  # True while a listener needs the current micro-step run uncompiled (a hook of its own)

    def train_start(self) -> None: ...
    def step_start(self, step: int) -> None: ...
    def micro_batch(self, step: int, micro: int, batch):
        return batch

    @contextlib.contextmanager
    def micro_step(self, step: int, micro: int, last_micro: int, model, kill_worker: Callable[[], int | None]):
        yield lambda loss: None

    def gradients(self, step: int, model) -> None: ...
    def step_end(self, step: int, model, metrics: Callable[[], dict]) -> None: ...
    def evaluation(self, step: int) -> None: ...
    def evaluated(self, step: int, val_loss: float | None) -> None: ...
    def save(self, step: int) -> None: ...
    def saved(self, step: int) -> None: ...
    def export(self, step: int) -> None: ...
    def train_end(self, summary: dict) -> None: ...


class Moments(Listener):
    """The seam: announces each moment to every attached listener."""

    def __init__(self, *listeners: Listener):
        self.listeners = list(listeners)

    def attach(self, listener: Listener) -> None:
        self.listeners.append(listener)

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

    def step_end(self, step: int, model, metrics: Callable[[], dict]) -> None:
        self._announce("step_end", step, model, metrics)

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
