"""The run's event bus (framework/train/events.py): what surrounds a step listens on it, in a fixed
order, and a user's listener hears each committed step after them."""

from __future__ import annotations

import math

import pytest

from framework import DDPTrainer
from framework.data.sampler import ResumableDistributedSampler
from framework.train.events import EventBus, Listener
from tests.tiny import tiny


class Recorder(Listener):
    def __init__(self):
        self.heard = []

    def step_start(self, step):
        self.heard.append(("step_start", step))

    def data_ready(self, step, micro_batches):
        self.heard.append(("data_ready", step, len(micro_batches)))

    def gradients(self, step, model):
        self.heard.append(("gradients", step))

    def step_end(self, result, model):
        self.heard.append(("step_end", result))


def test_a_listener_hears_each_step_in_order_with_its_result(tmp_path):
    cfg = tiny(tmp_path, {"train.max_steps": 3, "data.gradient_accumulation_steps": 2, "eval.interval": 0})
    trainer = DDPTrainer(cfg)
    recorder = Recorder()
    trainer.events.attach(recorder)
    names = [type(listener).__name__ for listener in trainer.events.listeners]
    assert names == ["PeerMonitor", "StepStartBuffers", "Watchdog", "StragglerMonitor", "SpikeGuard", "FaultPlan",
                     "UserCallbacks", "StartupClock", "ConsistencyCheck", "Recorder"]
    summary = trainer.train()
    kinds = [event[0] for event in recorder.heard]
    assert kinds == ["step_start", "data_ready", "gradients", "step_end"] * 3
    assert [e[2] for e in recorder.heard if e[0] == "data_ready"] == [2, 2, 2]  # the accumulation's micro-batches
    results = [e[1] for e in recorder.heard if e[0] == "step_end"]
    assert [r.step for r in results] == [1, 2, 3] and all(r.epoch == 0 for r in results)
    assert results[-1].loss == pytest.approx(summary["final_train_loss"])
    assert all(math.isfinite(r.loss) and r.lr > 0 and float(r.grad_norm) > 0 for r in results)
    assert all(r.tokens == 2 * cfg["batch_size"] * cfg["seq_len"] for r in results)
    sampler = ResumableDistributedSampler(cfg["dataset_size"], 1, 0, cfg["batch_size"], 2, trainer.config.train.seed)
    assert sum((r.indices for r in results), []) == sampler.permutation(0)[:3 * 2 * cfg["batch_size"]].tolist()
    assert sorted(results[0].metrics()) == ["grad_norm", "loss", "lr", "tokens"]
    # The sample and step logs listen only while train() runs: none is left attached after it.
    assert [type(listener).__name__ for listener in trainer.events.listeners] == names


def test_attach_before_puts_a_listener_ahead_of_another():
    first, second, third = Recorder(), Recorder(), Recorder()
    bus = EventBus(first, second)
    bus.attach(third, before=second)
    assert bus.listeners == [first, third, second]
    bus.detach(third)
    bus.detach(third)  # detaching twice is harmless
    assert bus.listeners == [first, second]


def test_each_component_names_its_configuration_section_and_is_built_from_it(tmp_path):
    cfg = tiny(tmp_path, {"recovery.step_timeout_s": 77.0, "straggler.interval": 7, "spike.threshold": 4.5,
                          "recovery.consistency_check_interval": 9, "eval.interval": 11})
    trainer = DDPTrainer(cfg)
    try:
        owners = {"watchdog": "recovery", "stragglers": "straggler", "spike_guard": "spike", "consistency": "recovery",
                  "evaluator": "eval", "precision": "precision", "comm_hook": "ddp"}
        for attribute, section in owners.items():
            assert type(getattr(trainer, attribute)).Config is type(getattr(trainer.config, section)), attribute
        assert trainer.watchdog.minimum == 77.0 and trainer.stragglers.interval == 7
        assert trainer.spike_guard.threshold == 4.5 and trainer.evaluator.interval == 11
        assert trainer.consistency.interval == 0  # one process: nothing to compare
    finally:
        trainer.close()
