"""How a run ends: the final evaluation and save, agreed by every rank (or, when a preemption
request came in after the last step or during the final evaluation, the preempted save), then the
final weights' export and summary.json. Also the evaluations and the save that a preemption
request can stop a run in. The functions take the trainer, whose pieces they finish."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from . import atomic, distributed, export, markers
from .control import agree
from .health import model_sha256
from .metrics import StepLog

log = logging.getLogger(__name__)


def final_evaluation_and_save(trainer, steps: StepLog) -> bool:
    """The final evaluation and save; True when a preemption request came in after the last
    step or during the evaluation, in which case (agreed by every rank) the evaluation is left to
    the resumed run."""
    cfg, env = trainer.cfg, trainer.env
    if steps.loss is not None and 0 < cfg.train.target_loss and steps.loss <= cfg.train.target_loss:
        log.info("target_loss %g reached at step %d (loss %.4f)", cfg.train.target_loss, trainer.step, steps.loss)
    preempted = agree(loss=torch.zeros((), device=env.device), world_size=env.world_size,
                      distributed=env.distributed, preempt=trainer.preemption.requested is not None).preempt
    if preempted or not evaluate(trainer, steps):
        save_preempted(trainer)
        return True
    with trainer.watchdog.phase("checkpoint save", scale=10):
        trainer.faults.fire_process_faults(trainer.step, at="save")
        trainer.checkpoints.save_final(trainer.step)
    return False


def evaluate(trainer, steps: StepLog) -> bool:
    """Evaluate at the trainer's step and record the validation loss; False, with nothing
    recorded, when a preemption request stopped the evaluation (every rank at the same batch)."""
    with trainer.watchdog.phase("evaluation", scale=trainer.evaluator.batches):
        val_loss = trainer.evaluator.run(trainer.step, stop=lambda: trainer.preemption.requested is not None)
    if trainer.evaluator.interrupted:
        return False
    steps.record_val(trainer.step, val_loss)
    trainer.callbacks("on_evaluate", trainer, trainer.step, val_loss)
    return True


def evaluate_mid_run(trainer, steps: StepLog) -> bool:
    """An evaluation between steps; True when a preemption request stopped it. The step is then
    saved with its evaluation owed (``trainer.eval_owed``, in its state): a run resumed there runs it first."""
    with steps.paused():
        stopped = not evaluate(trainer, steps)
    trainer.eval_owed = trainer.step if stopped else -1
    if stopped:
        save_preempted(trainer)
    return stopped


def save_preempted(trainer) -> None:
    with trainer.watchdog.phase("preemption save", scale=10):
        trainer.save_checkpoint(blocking=True)
    if trainer.env.is_main:
        markers.write(trainer.cfg.checkpoint.dir, markers.PREEMPTED, f"preempted at step {trainer.step}")
    log.warning("preempted: checkpoint of step %d saved; exiting", trainer.step)


def finish(trainer, steps: StepLog, preempted: bool) -> dict:
    """Export the final weights (unless preempted) and write summary.json (rank 0); returns the summary."""
    cfg, env = trainer.cfg, trainer.env
    summary = steps.summary(step=trainer.step, epochs=trainer.sampler.epochs_done(), world_size=env.world_size,
                            model_sha256=model_sha256(trainer.raw_model), preempted=preempted,
                            skipped_steps=trainer.skips.total, restarts=distributed.incarnation(),
                            **trainer.spikes.summary())
    if env.is_main:
        if not preempted:
            export.save_final_weights(trainer.raw_model, cfg)  # final_model.pt and the safetensors export
        atomic.write_bytes(Path(cfg.logging.dir) / "summary.json", json.dumps(summary, indent=2).encode())
    log.info("%s: %s", "preempted" if preempted else "done", json.dumps(summary))
    trainer.callbacks("on_train_end", trainer, summary)
    return summary
