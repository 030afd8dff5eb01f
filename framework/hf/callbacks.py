"""transformers ``TrainerCallback``s driven by DDPTrainer's hooks, with HF's ``TrainerState`` and
``TrainerControl``. A control flag one rank's callback sets is agreed by every rank (one
all-reduce of two flags per step), so ``should_training_stop`` stops every rank after the same
step and ``should_save`` saves the same step everywhere.

At each evaluation the bridge adds the drop-in's metrics (``compute_metrics`` over the whole
evaluation set, the same on every rank) to ``eval_loss``, logs them, calls ``on_evaluate``, then
tracks the best metric as transformers.Trainer does (``state.best_metric``, ``best_global_step``;
with ``load_best_model_at_end``, the best weights are kept aside and ``best_model_checkpoint``
names them)."""

from __future__ import annotations

import enum
import json
import logging
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def _plain_scalar(value):
    """JSON for what transformers' own json.dumps of a callback's state would also take: numpy
    scalars and arrays, enums."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} is not JSON")


class HFCallbacks:
    """One framework callback (see framework/train/callbacks.py) that drives ``callbacks``.
    Its state (``log_history``, the loss since the last log, the best metric and the callbacks'
    exported states) is saved with the run; it changes
    in the hooks only, never within a step, so a survivor may save the run alone."""

    changes_mid_step = False

    def __init__(self, callbacks: list, args, *, steps_per_epoch: int, max_steps: int, logging_interval: int,
                 logging_first_step: bool, components: dict[str, Any],
                 metrics: Callable[[Any], dict] | None = None, keep_best: Callable[[Any, int], str] | None = None):
        """``metrics(trainer)``: the evaluation's metrics beside eval_loss (every rank calls it at
        the same step and gets the same dict); ``keep_best(trainer, step)``: keep the weights of a
        new best step aside, returning where (``state.best_model_checkpoint``)."""
        from transformers.trainer_callback import TrainerControl, TrainerState

        self.callbacks, self.args, self.components = list(callbacks), args, components
        self.metrics, self.keep_best = metrics, keep_best
        self.steps_per_epoch, self.logging_interval = max(1, steps_per_epoch), logging_interval
        self.logging_first_step = logging_first_step
        self.state = TrainerState(max_steps=max_steps, logging_steps=logging_interval,
                                  num_train_epochs=max(1, -(-max_steps // self.steps_per_epoch)),
                                  train_batch_size=args.per_device_train_batch_size)
        self.control = TrainerControl()
        self._loss_sum, self._loss_steps = 0.0, 0  # since the last on_log
        self._unsaved: set[str] = set()  # callbacks whose state cannot be saved (warned once)
        self.run_loss, self.run_steps = 0.0, 0  # this process's steps, for TrainOutput.training_loss

    def set_run_length(self, steps_per_epoch: int, max_steps: int) -> None:
        """The run's own epoch length and last step (a run resumed at another world size keeps its
        global batch: these are the run's, not this world size's)."""
        self.steps_per_epoch = max(1, steps_per_epoch)
        self.state.max_steps = max_steps
        self.state.num_train_epochs = max(1, -(-max_steps // self.steps_per_epoch))

    def _event(self, name: str, trainer=None, **kwargs) -> None:
        if trainer is not None:
            self.state.is_world_process_zero = trainer.env.is_main
            self.state.is_local_process_zero = trainer.env.local_rank == 0
            kwargs = {"model": trainer.raw_model, "optimizer": trainer.optimizer, **self.components, **kwargs}
        for cb in self.callbacks:
            result = getattr(cb, name)(self.args, self.state, self.control, **kwargs)
            if result is not None:
                self.control = result

    def _at(self, step: int) -> None:
        self.state.global_step = step
        self.state.epoch = step / self.steps_per_epoch

    def on_train_start(self, trainer) -> None:
        self._at(trainer.step)
        self._event("on_init_end", trainer)
        self._event("on_train_begin", trainer)

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        self._at(step)
        self._loss_sum, self._loss_steps = self._loss_sum + metrics["loss"], self._loss_steps + 1
        self.run_loss, self.run_steps = self.run_loss + metrics["loss"], self.run_steps + 1
        self._event("on_step_end", trainer)
        if (step % self.logging_interval == 0 or (step == 1 and self.logging_first_step)
                or step >= self.state.max_steps):
            logs = {"loss": self._loss_sum / self._loss_steps, "grad_norm": metrics["grad_norm"],
                    "learning_rate": metrics["lr"], "epoch": self.state.epoch}
            self._loss_sum, self._loss_steps = 0.0, 0
            self.log(trainer, logs)
        stop, save = self._agreed(trainer, self.control.should_training_stop, self.control.should_save)
        self.control.should_save = False
        if stop:  # first: a checkpoint of this step records the stop
            log.info("a callback set control.should_training_stop at step %d: stopping", step)
            trainer.request_stop()
        if save:
            trainer.save_checkpoint()

    def log(self, trainer, logs: dict) -> None:
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self._event("on_log", trainer, logs=logs)

    def on_evaluate(self, trainer, step: int, val_loss: float | None) -> None:
        if val_loss is None:
            return
        self._at(step)
        metrics = {"eval_loss": val_loss}
        if self.metrics is not None:
            metrics.update({k: v for k, v in self.metrics(trainer).items() if k != "eval_loss"})
        metrics["epoch"] = self.state.epoch
        self.log(trainer, metrics)
        self._event("on_evaluate", trainer, metrics=metrics)
        self.track_best(trainer, step, metrics)  # after on_evaluate, as transformers.Trainer does
        if self._agreed(trainer, self.control.should_training_stop)[0]:  # EarlyStoppingCallback: stop now
            log.info("a callback set control.should_training_stop at the evaluation of step %d: stopping", step)
            trainer.request_stop()

    def track_best(self, trainer, step: int, metrics: dict) -> bool:
        """transformers.Trainer's ``_determine_best_metric``: with ``metric_for_best_model``,
        record a better value in ``state.best_metric`` and ``best_global_step`` (every rank decides
        alike: the metrics are every rank's), and keep its weights when ``keep_best`` is given."""
        name = self.args.metric_for_best_model
        if name is None:
            return False
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            raise KeyError(f"The `metric_for_best_model` training argument is set to '{key}', which is not found in "
                           f"the evaluation metrics. The available evaluation metrics are: {list(metrics)}.")
        better = np.greater if self.args.greater_is_better else np.less
        best = self.state.best_metric
        if best is not None and not better(metrics[key], best):
            return False
        self.state.best_metric, self.state.best_global_step = float(metrics[key]), step
        if self.keep_best is not None:
            self.state.best_model_checkpoint = self.keep_best(trainer, step)
        return True

    def adopt(self, saved) -> None:
        """A transformers checkpoint's ``TrainerState`` (its trainer_state.json): its step, log
        history, best metric (its best checkpoint only while that folder exists) and the states of
        its stateful callbacks."""
        self.state.log_history = list(saved.log_history)
        self.state.best_metric, self.state.best_global_step = saved.best_metric, saved.best_global_step
        best = saved.best_model_checkpoint
        self.state.best_model_checkpoint = best if best is not None and Path(best).is_dir() else None
        self.restore_callbacks(saved.stateful_callbacks)
        self._at(saved.global_step)

    def on_save(self, trainer, step: int) -> None:
        self._at(step)
        self._event("on_save", trainer)

    def on_train_end(self, trainer, summary: dict) -> None:
        self._event("on_train_end", trainer)

    @staticmethod
    def _agreed(trainer, *flags: bool) -> list[bool]:
        if not trainer.env.distributed:
            return [bool(f) for f in flags]
        buf = torch.tensor([float(bool(f)) for f in flags], device=trainer.env.device)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        return [v > 0 for v in buf.tolist()]

    def stateful_callbacks(self) -> dict:
        """The states of the callbacks that export one (transformers' ``ExportableState``, as
        ``EarlyStoppingCallback``'s patience counter), as TrainerState.stateful_callbacks holds them:
        by class name, a list when a class has several."""
        from transformers.trainer_callback import ExportableState, TrainerState

        exportable = [cb for cb in self.callbacks if isinstance(cb, ExportableState)]
        if not exportable:
            return {}
        states = TrainerState(stateful_callbacks=exportable).stateful_callbacks
        plain = {}
        for name, state in states.items():
            try:  # a checkpoint holds plain types only: numpy scalars, enums and the like as JSON has them
                plain[name] = json.loads(json.dumps(state, default=_plain_scalar))
            except (TypeError, ValueError) as err:
                if name not in self._unsaved:
                    log.warning("the state of the callback %s is not saved with the checkpoints (%s): it restarts "
                                "afresh on a resume", name, err)
                    self._unsaved.add(name)
        return plain

    def restore_callbacks(self, saved: dict | None) -> None:
        """Set the saved attributes (``state()["attributes"]``) on this run's callbacks of the same
        class, in order (the callbacks keep their own constructor arguments)."""
        restored, unmatched = [], []
        for name, data in (saved or {}).items():
            same = [cb for cb in self.callbacks if type(cb).__name__ == name]
            if not same and name != "TrainerControl":  # transformers saves its TrainerControl beside them
                unmatched.append(name)
            for cb, state in zip(same, data if isinstance(data, list) else [data], strict=False):
                for attribute, value in state.get("attributes", {}).items():
                    setattr(cb, attribute, value)
                restored.append(name)
        if restored:
            log.info("restored the state of the callbacks %s", ", ".join(sorted(set(restored))))
        if unmatched:
            log.warning("the checkpoint holds the state of callbacks this run does not have: %s (not restored)",
                        ", ".join(sorted(unmatched)))

    def state_dict(self) -> dict:
        return {"log_history": list(self.state.log_history), "loss_sum": self._loss_sum,
                "loss_steps": self._loss_steps, "best_metric": self.state.best_metric,
                "best_global_step": self.state.best_global_step,
                "best_model_checkpoint": self.state.best_model_checkpoint,
                "stateful_callbacks": self.stateful_callbacks()}

    def load_state_dict(self, state: dict) -> None:
        self.state.log_history = list(state["log_history"])
        self._loss_sum, self._loss_steps = float(state["loss_sum"]), int(state["loss_steps"])
        self.state.best_metric = state.get("best_metric")
        self.state.best_global_step = state.get("best_global_step")
        self.state.best_model_checkpoint = state.get("best_model_checkpoint")
        self.restore_callbacks(state.get("stateful_callbacks"))
