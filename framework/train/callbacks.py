"""User callbacks: objects with any of the hooks below, called on every rank in order. A callback
with ``state_dict()``/``load_state_dict()`` is saved in checkpoints and restored on resume. One
whose state no step's forward or backward touches (it changes in the hooks only) says so with
``changes_mid_step = False``: a survivor of a peer lost mid-step may then save the run alone
(DDPTrainer's survivor checkpoint; a ``stateful`` object can say the same)."""

from __future__ import annotations

import logging
from typing import Any

from .events import Listener

log = logging.getLogger(__name__)

HOOKS = ("on_train_start", "on_step_end", "on_evaluate", "on_save", "on_train_end")
"""on_train_start(trainer); on_step_end(trainer, step, metrics); on_evaluate(trainer, step,
val_loss); on_save(trainer, step); on_train_end(trainer, summary)."""


class UserCallbacks(Listener):
    """The user's callbacks, attached to the run's moments (framework/train/events.py). Each hook
    gets ``owner`` first (the DDPTrainer), which this module hands on and never reads."""

    def __init__(self, callbacks: list[Any] | tuple[Any, ...] = (), *, owner=None):
        self.callbacks, self.owner = list(callbacks), owner
        for cb in self.callbacks:
            if not any(hasattr(cb, hook) for hook in HOOKS):
                raise TypeError(f"callback {type(cb).__name__} has none of the hooks {', '.join(HOOKS)}")

    def _call(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if method is not None:
                method(self.owner, *args)

    def train_start(self) -> None:
        self._call("on_train_start")

    def step_end(self, result, model) -> None:
        if self.callbacks:
            self._call("on_step_end", result.step, result.metrics())

    def evaluated(self, step: int, val_loss: float | None) -> None:
        self._call("on_evaluate", step, val_loss)

    def saved(self, step: int) -> None:
        self._call("on_save", step)

    def train_end(self, summary: dict) -> None:
        self._call("on_train_end", summary)

    def stateful(self) -> dict[str, Any]:
        """The callbacks that have a state, by checkpoint name."""
        return {f"callback/{i}/{type(cb).__name__}": cb for i, cb in enumerate(self.callbacks)
                if hasattr(cb, "state_dict") and hasattr(cb, "load_state_dict")}


def user_stateful(stateful: dict[str, Any] | None) -> dict[str, Any]:
    """A user's ``stateful={name: obj}``, by checkpoint name; every object must have a state."""
    out = {}
    for name, obj in (stateful or {}).items():
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"stateful[{name!r}]: {type(obj).__name__} has no state_dict()/load_state_dict()")
        out[f"user/{name}"] = obj
    return out
