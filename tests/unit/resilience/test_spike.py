"""The loss-spike guard: the detector, the exclusions, and on 2 gloo ranks a real spike (random
targets on one rank) rolled back, warned about, or stopping the run after max_rollbacks; the
rolled-back run ends bit-identical to a run that excluded the same samples from the start."""

import json
import math
import random
import re

import pytest

from framework.resilience import exclusions
from framework.config import ConfigError, resolve_config
from framework.data.sampler import ResumableDistributedSampler
from framework.resilience.faults import FaultPlan
from framework.resilience.markers import FatalError
from framework.observability.metrics import read_metrics
from framework.resilience.spike_guard import SpikeGuard, loss_z
from tests.workers.spike import BASE

WORKER = "tests/workers/spike.py"  # the conftest two_ranks_run fixture launches it


def test_a_falling_noisy_loss_stays_within_a_few_deviations_and_a_jump_does_not():
    rng = random.Random(0)
    losses = [3.0 * math.exp(-i / 200) + rng.gauss(0, 0.02) for i in range(400)]
    zs = [loss_z(losses[i - 50:i], losses[i]) for i in range(50, 400)]
    assert max(zs) < 4.5
    assert loss_z(losses[-50:], losses[-1] + 0.3) > 10


def test_the_trend_is_extrapolated_so_a_steady_fall_is_not_a_deviation():
    line = [2.0 - 0.01 * i for i in range(50)]
    assert abs(loss_z(line, 2.0 - 0.01 * 50)) < 1e-6
    assert loss_z(line, 2.0) > 100  # back where it started: far above the trend


def test_excluded_samples_are_dropped_from_every_epoch_and_the_committed_prefix_stays():
    sampler = ResumableDistributedSampler(100, 2, 0, 3, 2, seed=0)
    full = sampler.permutation(0).tolist()
    it = iter(sampler)
    next(it), next(it)
    sampler.advance()
    assert sampler.last_step_samples() == full[:12]
    later = full[20:23]
    sampler.exclude(later)
    assert sampler.permutation(0).tolist()[:12] == full[:12]
    assert not set(later) & set(sampler.permutation(0).tolist() + sampler.permutation(1).tolist())
    assert sampler.steps_per_epoch == 97 // 12
    with pytest.raises(FatalError, match=r"\[100\] are outside the training set of 100 samples"):
        sampler.exclude([100])


def guard(tmp_path, overrides: dict | None = None, /, **compact):
    cfg = resolve_config({**BASE, "checkpoint.dir": str(tmp_path), "spike.guard": "rollback", **(overrides or {}),
                          **compact})
    g = SpikeGuard(cfg.spike, checkpoint_dir=cfg.checkpoint.dir, exclude_samples=cfg.data.exclude_samples,
                   is_main=True)
    g.attach(ResumableDistributedSampler(64, 1, 0, 4, 1, seed=0))
    return g


def feed(g, losses, start=1):
    spikes = []
    for i, loss in enumerate(losses, start):
        g.sampler.consumed = i * 4
        spikes.append(g.observe(i, loss, skipped=False))
    return spikes


@pytest.mark.dist
def test_rollback_keeps_what_the_run_learnt_when_the_older_checkpoint_loads(tmp_path):
    g = guard(tmp_path, {"spike.warmup": 3, "spike.window": 10})
    feed(g, [2.0, 1.9, 1.8, 1.7])
    saved = g.state_dict()  # the checkpoint of step 4
    spike = feed(g, [1.6, 1.5, 5.0], start=5)[-1]
    assert spike is not None and spike.step == 7 and spike.samples == g.sampler.permutation(0)[24:28].tolist()
    g.roll_back(spike, restored_step=4)
    g.load_state_dict(saved)
    assert g.history == [2.0, 1.9, 1.8, 1.7] and g.excluded == set(spike.samples)
    assert g.summary()["rollbacks"] == 1 and g.summary()["loss_spikes"] == 1
    recorded = json.loads((tmp_path / exclusions.FILE).read_text())
    assert recorded["samples"] == sorted(spike.samples) and recorded["rollbacks"][0]["step"] == 7
    fresh = guard(tmp_path)
    fresh.adopt_recorded()  # a restart before a newer checkpoint holds them
    assert fresh.excluded == set(spike.samples) and not set(spike.samples) & set(fresh.sampler.permutation(0).tolist())


@pytest.mark.dist
def test_more_than_max_rollbacks_is_fatal_naming_steps_and_samples(tmp_path):
    g = guard(tmp_path, {"spike.warmup": 3, "spike.max_rollbacks": 0})
    spike = feed(g, [2.0, 1.9, 1.8, 1.7, 9.0])[-1]
    with pytest.raises(FatalError, match=re.escape(f"more than spike.max_rollbacks=0 loss-spike rollbacks: step 5 "
                                                   f"(samples {spike.samples})")):
        g.roll_back(spike, restored_step=4)


@pytest.mark.dist
def test_warn_mode_only_reports_and_skipped_steps_are_not_judged(tmp_path):
    g = guard(tmp_path, {"spike.guard": "warn", "spike.warmup": 3})
    assert feed(g, [2.0, 1.9, 1.8, 1.7, 9.0]) == [None] * 5
    assert g.summary()["loss_spikes"] == 1 and g.summary()["max_loss_z"] > 8
    assert g.observe(6, float("nan"), skipped=True) is None and g.seen == 5


@pytest.mark.dist
def test_the_cooldown_ramps_the_learning_rate_back_linearly(tmp_path):
    g = guard(tmp_path, {"spike.warmup": 3, "spike.lr_cooldown": 3})
    spike = feed(g, [2.0, 1.9, 1.8, 1.7, 9.0])[-1]
    assert g.lr_factor(4) == 1.0
    g.roll_back(spike, restored_step=4)
    assert [g.lr_factor(s) for s in (4, 5, 6, 7)] == [0.25, 0.5, 0.75, 1.0]


def test_bad_data_randomizes_one_rank_s_targets_the_same_way_every_time():
    import torch
    x, y = torch.zeros(4, 8, dtype=torch.long), torch.arange(32).view(4, 8) % 16
    a = FaultPlan("bad_data@step=3,rank=1", rank=1, group_restarts=0).micro_batch(3, 0, (x, y))
    b = FaultPlan("bad_data@step=3,rank=1", rank=1, group_restarts=0).micro_batch(3, 0, (x, y))
    assert torch.equal(a[1], b[1]) and not torch.equal(a[1], y) and a[0] is x
    assert FaultPlan("bad_data@step=3,rank=1", rank=0, group_restarts=0).micro_batch(3, 0, (x, y))[1] is y


@pytest.mark.parametrize("over, problem", [
    ({"spike.guard": "rollback", "checkpoint.every_steps": 0},
     "spike.guard='rollback': needs checkpoint.every_steps > 0"),
    ({"data.exclude_samples": "missing.json"}, "data.exclude_samples='missing.json': file not found"),
    ({"data.exclude_samples": "BAD"}, "data.exclude_samples='BAD': allowed: a JSON list of sample indices"),
])
def test_bad_spike_settings_are_one_line_errors(tmp_path, monkeypatch, over, problem):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "BAD").write_text('{"samples": [1, -2]}')
    with pytest.raises(ConfigError) as err:
        resolve_config(over)
    assert any(p.startswith(problem) for p in err.value.problems), err.value.problems


def case(run, name, rank=0):
    out = run[1][rank]["cases"][name]
    assert "error" not in out or name == "too_many_rollbacks", out.get("traceback")
    return out


@pytest.mark.dist
def test_a_spike_is_rolled_back_and_the_run_equals_one_that_excluded_its_samples(two_ranks_run):
    out_dir, _ = two_ranks_run
    for rank in (0, 1):
        got = case(two_ranks_run, "rollback", rank)["summary"]
        assert (got["loss_spikes"], got["rollbacks"], got["excluded_samples"], got["steps"]) == (1, 1, 8, 50)
        assert got["model_sha256"] == case(two_ranks_run, "reference", rank)["summary"]["model_sha256"]
        assert case(two_ranks_run, "reference", rank)["summary"]["loss_spikes"] == 0
    log = (out_dir / "rollback" / "logs" / "rank_1.log").read_text()
    assert "loss spike at step 31" in log and "rolled back to the checkpoint of step 30" in log
    recorded = json.loads((out_dir / "rollback" / "ck" / exclusions.FILE).read_text())
    assert recorded["rollbacks"][0]["restored_step"] == 30 and len(recorded["samples"]) == 8
    assert case(two_ranks_run, "rollback")["excluded"] == recorded["samples"]
    rows = read_metrics(out_dir / "rollback" / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 51))  # step 31 logged again after the purge
    assert rows[-1]["health/rollbacks"] == 1 and rows[-1]["train/loss"] == case(two_ranks_run, "rollback")["summary"][
        "final_train_loss"]


@pytest.mark.dist
def test_with_warn_the_spike_is_only_logged(two_ranks_run):
    got = case(two_ranks_run, "warn")["summary"]
    assert (got["loss_spikes"], got["rollbacks"], got["excluded_samples"]) == (1, 0, 0)
    assert got["max_loss_z"] > BASE["spike.threshold"]
    assert "spike.guard=warn: continuing" in (two_ranks_run[0] / "warn" / "logs" / "rank_0.log").read_text()


@pytest.mark.dist
def test_too_many_rollbacks_stop_every_rank_with_fatal(two_ranks_run):
    for rank in (0, 1):
        assert "more than spike.max_rollbacks=0 loss-spike rollbacks: step 31 (samples [" in case(
            two_ranks_run, "too_many_rollbacks", rank)["error"]
    assert "spike.max_rollbacks=0" in (two_ranks_run[0] / "too_many_rollbacks" / "ck" / "FATAL").read_text()


@pytest.mark.dist
def test_the_cooldown_lowers_the_rate_after_the_rollback(two_ranks_run):
    rows = {r["step"]: r for r in read_metrics(two_ranks_run[0] / "cooldown" / "logs" / "metrics.jsonl")}
    plain = {r["step"]: r for r in read_metrics(two_ranks_run[0] / "rollback" / "logs" / "metrics.jsonl")}
    assert rows[31]["train/lr"] == pytest.approx(plain[31]["train/lr"] / 5)
    assert rows[35]["train/lr"] == plain[35]["train/lr"]


@pytest.mark.dist
def test_a_clean_run_has_no_false_positive(two_ranks_run):
    got = case(two_ranks_run, "clean")["summary"]
    assert got["loss_spikes"] == 0 and 0 < got["max_loss_z"] < BASE["spike.threshold"]  # judged, and below


@pytest.mark.dist
def test_a_restart_after_a_rollback_keeps_its_lr_cooldown(tmp_path):
    g = guard(tmp_path, {"spike.warmup": 3, "spike.lr_cooldown": 3})
    spike = feed(g, [2.0, 1.9, 1.8, 1.7, 9.0])[-1]
    g.roll_back(spike, restored_step=4)
    fresh = guard(tmp_path, {"spike.lr_cooldown": 3})  # the restarted run, resumed from the checkpoint of step 4
    fresh.adopt_recorded()
    assert [fresh.lr_factor(s) for s in (4, 5, 6, 7)] == [0.25, 0.5, 0.75, 1.0]


def test_a_damaged_exclusions_file_is_a_fatal_error_naming_it(tmp_path):
    (tmp_path / exclusions.FILE).write_text('{"samples": [1, 2')
    with pytest.raises(FatalError, match=rf"{exclusions.FILE}: .*fix it \(a JSON list of sample indices\) or delete"):
        guard(tmp_path).adopt_recorded()


def test_a_rollback_stays_within_its_epoch(tmp_path):
    from framework.trainer import DDPTrainer
    # 4 steps per epoch (16 samples, batch 4); checkpoints at steps 3 (epoch 0) and 6 (epoch 1).
    cfg = {**BASE, "dataset_size": 16, "train.max_steps": 6, "checkpoint.every_steps": 3, "spike.guard": "rollback",
           "logging.record_samples": False, "logging.dir": str(tmp_path / "logs"),
           "checkpoint.dir": str(tmp_path / "ck")}
    trainer = DDPTrainer(cfg, rank=0, world_size=1)
    trainer.train()
    assert trainer.sampler.epoch == 1
    assert trainer.checkpointer.roll_back(before=6) is None  # the newest before it is of epoch 0
    assert trainer.checkpointer.roll_back(before=7) == 6 and trainer.step == 6


def one_process_spike(tmp_path, overrides: dict | None = None, /, **compact):
    from framework.observability.metrics import read_metrics
    from framework.trainer import DDPTrainer
    cfg = {**BASE, "dataset_size": 256, "train.max_steps": 30, "spike.guard": "rollback",
           "logging.record_samples": False,
           "logging.dir": str(tmp_path / "logs"), "checkpoint.dir": str(tmp_path / "ck"), **(overrides or {}),
           **compact}
    summary = DDPTrainer(cfg, rank=0, world_size=1).train()
    manifest = [e["step"] for e in json.loads((tmp_path / "ck" / "manifest.json").read_text())]
    return summary, manifest, read_metrics(tmp_path / "logs" / "metrics.jsonl")


@pytest.mark.slow
def test_a_spike_on_the_last_step_with_nothing_to_roll_back_to_ends_the_run_there(tmp_path):
    summary, manifest, rows = one_process_spike(tmp_path, {"checkpoint.every_steps": 40,
                                                           "recovery.fault_inject": "bad_data@step=29"})
    assert summary["loss_spikes"] == 1 and summary["rollbacks"] == 0
    assert summary["steps"] == 30 and manifest == [30] and rows[-1]["step"] == 30


@pytest.mark.slow
def test_a_spike_with_nothing_to_roll_back_to_still_saves_and_evaluates_its_step(tmp_path):
    summary, manifest, rows = one_process_spike(tmp_path, {"checkpoint.every_steps": 20, "eval.interval": 20,
                                                           "recovery.fault_inject": "bad_data@step=19"})
    assert summary["loss_spikes"] == 1 and summary["rollbacks"] == 0
    assert summary["steps"] == 30 and manifest == [20, 30]
    assert "val/loss" in next(r for r in rows if r["step"] == 20)


def test_a_rollback_that_ends_the_last_epoch_reports_the_loss_of_the_step_it_ended_at(tmp_path):
    """6 steps, a checkpoint at step 5, a spike at step 6: the rollback excludes step 6's samples,
    so the epoch (and the run) ends at step 5; summary.json's loss is step 5's, not the discarded one's."""
    summary, manifest, rows = one_process_spike(tmp_path, {"train.max_steps": 0, "checkpoint.every_steps": 5,
                                                           "spike.warmup": 3, "spike.window": 3,
                                                           "spike.threshold": 4.0, "train.seed": 5,
                                                           "optim.warmup_steps": 2, "train.deterministic": True,
                                                           "recovery.fault_inject": "bad_data@step=5"},
                                               dataset_size=24, num_epochs=1, learning_rate=2e-3, dropout=0.1)
    assert summary["rollbacks"] == 1 and summary["steps"] == 5 and rows[-1]["step"] == 5
    assert summary["final_train_loss"] == rows[-1]["train/loss"]
    assert json.loads((tmp_path / "logs" / "summary.json").read_text())["final_train_loss"] == rows[-1]["train/loss"]
