"""The training state: format upgrades, config changes on resume, save timing, and resuming in
one process with the schedule recomputed, refusals that leave a FATAL marker."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from framework import DDPTrainer, markers
from framework.checkpoint import CheckpointError
from framework.config import build_config
from framework.optim import lr_at
from framework.resume import FORMAT, Checkpointer, config_changes, upgrade

TINY = dict(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, seq_len=16, dataset_size=128, batch_size=8,
            dropout=0.0, num_workers=0, learning_rate=3e-3, target_loss=0.0, eval_steps=2, log_interval=2,
            tensorboard=False, eval_interval=0)


def tiny(tmp_path, **kw):
    return {**TINY, "log_dir": str(tmp_path / "logs"), "checkpoint_dir": str(tmp_path / "ck"), **kw}


def test_format_1_is_upgraded_and_an_unknown_format_refused():
    old = {"format": 1, "step": 7, "model": {}, "optimizer": {}, "scaler": {}, "schedule": {},
           "sampler": {"epoch": 1, "consumed": 16}, "micro_batch_size": 4, "accumulation_steps": 2,
           "skipped_this_epoch": [3], "tokens_total": 99, "rng": [], "config": {}, "world_size": 2}
    new = upgrade(old)
    assert new["format"] == FORMAT
    assert new["trainer"] == {"step": 7, "tokens_total": 99} and new["skips"] == {"steps": [3]}
    assert new["sampler"] == {"epoch": 1, "consumed": 16, "batch_size": 4, "accumulation": 2, "world_size": 2}
    with pytest.raises(CheckpointError, match="format 99 is unknown"):
        upgrade({**old, "format": 99})


def test_config_changes_split_refused_from_warned():
    cfg = build_config({"seed": 1, "learning_rate": 0.5, "log_dir": "elsewhere"}, env={})
    saved = dataclasses.asdict(build_config({}, env={}))
    refused, changed = config_changes(saved, cfg, builtin_data=True)
    assert refused == ["seed: 1337 -> 1"]
    assert changed == ["learning_rate: 0.0001 -> 0.5"]
    data_change = build_config({"dataset_size": 50}, env={})
    assert config_changes(saved, data_change, builtin_data=True)[0] == ["dataset_size: 10000 -> 50"]
    # A user's own dataset: dataset_size names nothing that was used.
    assert config_changes(saved, data_change, builtin_data=False) == ([], [])


def test_save_timing_by_steps_and_epochs():
    cfg = build_config({"save_every_steps": 5, "save_interval": 2}, env={})
    ck = Checkpointer(cfg, SimpleNamespace(), manager=None, components={}, builtin_data=True)
    assert [s for s in range(1, 16) if ck.should_save(s, epoch=0, epoch_ended=False)] == [5, 10, 15]
    assert ck.should_save(3, epoch=1, epoch_ended=True) and not ck.should_save(3, epoch=0, epoch_ended=True)


def test_resume_with_another_batch_size_recomputes_the_schedule(tmp_path):
    first = DDPTrainer(tiny(tmp_path, num_epochs=2, fault_inject="sigterm@step=5")).train()
    assert first["preempted"] and first["steps"] == 6
    trainer = DDPTrainer(tiny(tmp_path, num_epochs=2, batch_size=16))
    # 48 of 128 samples done in epoch 0: 5 more steps of 16, then 8 in epoch 1 (not 2 x 8 = 16 in all).
    assert trainer.step == 6 and trainer.sampler.batch_size == 16
    assert trainer.total_steps == trainer.schedule.total_steps == 19
    summary = trainer.train()
    assert summary["steps"] == 19 and summary["epochs"] == 2.0
    # The last step ran at its place on the recomputed cosine, not past its end.
    last_lr = lr_at(18, lr=TINY["learning_rate"], warmup_steps=0, total_steps=19, min_lr=0.0)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(last_lr) and last_lr > 0


def test_changed_seed_is_refused_with_a_fatal_marker(tmp_path):
    DDPTrainer(tiny(tmp_path, max_steps=4, save_every_steps=2)).train()
    with pytest.raises(CheckpointError, match="seed: 1337 -> 7"):
        DDPTrainer(tiny(tmp_path, max_steps=8, seed=7))
    assert "seed: 1337 -> 7" in markers.read(tmp_path / "ck", markers.FATAL)


def test_errors_while_building_leave_a_fatal_marker(tmp_path):
    DDPTrainer(tiny(tmp_path, max_steps=2)).train()
    with pytest.raises(CheckpointError, match="does not fit the model"):
        DDPTrainer(tiny(tmp_path, max_steps=4, hidden_size=64))
    assert "does not fit the model" in markers.read(tmp_path / "ck", markers.FATAL)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    evil = tmp_path / "evil.pt"
    torch.save({"model": Evil()}, evil)
    with pytest.raises(CheckpointError, match="refused"):
        DDPTrainer(tiny(tmp_path, resume=str(evil)))
    assert "refused" in markers.read(tmp_path / "ck", markers.FATAL)


def test_recorded_micro_batch_applies_to_restarts_only(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    markers.record_micro_batch(ck, 4, 2, "out of memory in the synced backward")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    trainer = DDPTrainer(tiny(tmp_path, max_steps=2))  # no checkpoint: the record applies all the same
    assert (trainer.sampler.batch_size, trainer.sampler.accumulation) == (4, 2)
    trainer.close()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    trainer = DDPTrainer(tiny(tmp_path, max_steps=2))  # a new launch: the user's batch size decides
    assert (trainer.sampler.batch_size, trainer.sampler.accumulation) == (8, 1)
    assert markers.recorded_micro_batch(ck) is None
    trainer.close()


def test_a_fatal_exit_waits_for_the_checkpoint_write_in_flight(tmp_path):
    """FatalError ends the entry point with os._exit: the write started a step earlier must be
    on disk and in the manifest by then."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    from tests.dist_helper import cli_args
    args = cli_args(tiny(tmp_path, vocab_size=64, hidden_size=256, num_layers=4, num_heads=4, seq_len=32, max_steps=20,
                         save_every_steps=4, max_errors_per_epoch=0, fault_inject="nan@step=4"))
    out = subprocess.run([sys.executable, str(root / "ddp_training.py"), *args], cwd=root, capture_output=True,
                         text=True, timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 1 and "fatal: non-finite loss or gradients at steps [4]" in out.stderr
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert [e["step"] for e in manifest] == [4]
    assert (tmp_path / "ck" / "step_00000004.pt").stat().st_size == manifest[0]["bytes"]
