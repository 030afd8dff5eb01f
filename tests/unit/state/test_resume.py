"""The training state: format upgrades, config changes on resume, save timing, and resuming in
one process with the schedule recomputed, refusals that leave a FATAL marker."""

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from framework import DDPTrainer
from framework.resilience import markers
from framework.state.checkpoint_files import CheckpointError
from framework.config import build_config
from framework.train.optim import lr_at
from framework.state.checkpointer import FORMAT, Checkpointer, config_changes, upgrade
from tests.tiny import variant

# tiny(run_dir, overrides): this module's variant of the tiny configuration, its dirs under run_dir
tiny = variant({"eval.interval": 0})
TINY = tiny()


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
    cfg = build_config({"train.seed": 1, "learning_rate": 0.5, "logging.dir": "elsewhere"}, env={})
    saved = dataclasses.asdict(build_config({}, env={}))
    refused, changed = config_changes(saved, cfg, builtin_data=True)
    assert refused == ["train.seed: 1337 -> 1"]
    assert changed == ["optim.lr: 0.0001 -> 0.5"]
    data_change = build_config({"dataset_size": 50}, env={})
    assert config_changes(saved, data_change, builtin_data=True)[0] == ["data.synthetic_size: 10000 -> 50"]
    # A user's own dataset: dataset_size names nothing that was used.
    assert config_changes(saved, data_change, builtin_data=False) == ([], [])


def test_save_timing_by_steps_and_epochs():
    cfg = build_config({"checkpoint.every_steps": 5, "save_interval": 2}, env={})
    ck = Checkpointer(cfg, SimpleNamespace(), store=None, components={}, builtin_data=True)
    assert [s for s in range(1, 16) if ck.should_save(s, epoch=0, epoch_ended=False)] == [5, 10, 15]
    assert ck.should_save(3, epoch=1, epoch_ended=True) and not ck.should_save(3, epoch=0, epoch_ended=True)


def test_resume_with_another_batch_size_recomputes_the_schedule(tmp_path):
    first = DDPTrainer(tiny(tmp_path, {"recovery.fault_inject": "sigterm@step=5"}, num_epochs=2)).train()
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
    DDPTrainer(tiny(tmp_path, {"train.max_steps": 4, "checkpoint.every_steps": 2})).train()
    with pytest.raises(CheckpointError, match="seed: 1337 -> 7"):
        DDPTrainer(tiny(tmp_path, {"train.max_steps": 8, "train.seed": 7}))
    assert "seed: 1337 -> 7" in markers.read(tmp_path / "ck", markers.FATAL)


def test_errors_while_building_leave_a_fatal_marker(tmp_path):
    DDPTrainer(tiny(tmp_path, {"train.max_steps": 2})).train()
    with pytest.raises(CheckpointError, match="does not fit the model"):
        DDPTrainer(tiny(tmp_path, {"train.max_steps": 4}, hidden_size=64))
    assert "does not fit the model" in markers.read(tmp_path / "ck", markers.FATAL)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    evil = tmp_path / "evil.pt"
    torch.save({"model": Evil()}, evil)
    with pytest.raises(CheckpointError, match="refused"):
        DDPTrainer(tiny(tmp_path, {"checkpoint.resume": str(evil)}))
    assert "refused" in markers.read(tmp_path / "ck", markers.FATAL)


def test_recorded_micro_batch_applies_to_restarts_only(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    markers.record_micro_batch(ck, 4, 2, "out of memory in the synced backward")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    trainer = DDPTrainer(tiny(tmp_path, {"train.max_steps": 2}))  # no checkpoint: the record applies all the same
    assert (trainer.sampler.batch_size, trainer.sampler.accumulation) == (4, 2)
    trainer.close()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    trainer = DDPTrainer(tiny(tmp_path, {"train.max_steps": 2}))  # a new launch: the user's batch size decides
    assert (trainer.sampler.batch_size, trainer.sampler.accumulation) == (8, 1)
    assert markers.recorded_micro_batch(ck) is None
    trainer.close()


@pytest.mark.dist
def test_a_fatal_exit_waits_for_the_checkpoint_write_in_flight(tmp_path):
    """FatalError ends the entry point with exit code 1: the write started a step earlier must be
    on disk and in the manifest by then."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    from tests.dist_helper import cli_args
    args = cli_args(tiny(tmp_path, {"train.max_steps": 20, "checkpoint.every_steps": 4,
                                    "recovery.fault_inject": "nan@step=4"},
                         vocab_size=64, hidden_size=256, num_layers=4, num_heads=4, seq_len=32, max_errors_per_epoch=0))
    out = subprocess.run([sys.executable, str(root / "ddp_training.py"), *args], cwd=root, capture_output=True,
                         text=True, timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 1 and "fatal: non-finite loss or gradients at steps [4]" in out.stderr
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert [e["step"] for e in manifest] == [4]
    assert (tmp_path / "ck" / "step_00000004.pt").stat().st_size == manifest[0]["bytes"]


# --- issue 19 --------------------------------------------------------------------------------
import errno  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from framework.state import checkpoint_files  # noqa: E402
from framework.resilience import exclusions  # noqa: E402
from framework.observability.metrics import read_metrics  # noqa: E402


def restart(monkeypatch, count: int) -> None:
    """What torchrun tells an elastically restarted worker."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(count))


def lineages(ck: Path) -> set[str]:
    return {e["lineage"] for e in json.loads((ck / "manifest.json").read_text())}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "path"])
def test_a_restart_continues_its_own_lineage_whatever_the_resume_mode(tmp_path, monkeypatch, mode):
    """resume= describes the launch; a restart of it (crashed at step 25, checkpoints every 10)
    resumes from its own step 20, not from step 0 (none) or from PATH again."""
    origin = tmp_path / "origin"
    DDPTrainer(tiny(origin, {"train.max_steps": 5})).train()
    resume = str(origin / "ck" / "step_00000005.pt") if mode == "path" else "none"
    base = {"train.max_steps": 40, "num_epochs": 10, "checkpoint.every_steps": 10, "checkpoint.keep_last": 10,
            "checkpoint.resume": resume}
    reference = DDPTrainer(tiny(tmp_path / "reference", **base)).train()
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="fault injection: crash at step 25"):
        DDPTrainer(tiny(run, {"recovery.fault_inject": "crash@step=25"}, **base)).train()
    first_lineage = lineages(run / "ck")
    for count in (1, 2):  # the second restart comes after the first one's progress (its step 30)
        restart(monkeypatch, count)
        trainer = DDPTrainer(tiny(run, {"recovery.fault_inject": "crash@step=35,restart=1"}, **base))
        assert trainer.step == (20 if count == 1 else 30)
        if count == 1:
            with pytest.raises(RuntimeError, match="crash at step 35"):
                trainer.train()
    summary = trainer.train()
    assert summary["steps"] == 40 and summary["model_sha256"] == reference["model_sha256"]
    assert lineages(run / "ck") == first_lineage  # one lineage: the restarts continued it
    steps = [r["step"] for r in read_metrics(run / "logs" / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == 40
    assert json.loads(markers.read(run / "ck", markers.RESTARTS)) == {"step": 30, "count": 1}


def test_a_restart_with_nothing_of_its_own_falls_back_to_the_launchs_resume_mode(tmp_path, monkeypatch):
    """A restart before this launch saved anything: resume=none starts fresh even when another
    run's checkpoints are in checkpoint_dir."""
    DDPTrainer(tiny(tmp_path, {"train.max_steps": 4})).train()  # another run: its final checkpoint of step 4
    with pytest.raises(RuntimeError, match="crash at step 2"):
        DDPTrainer(tiny(tmp_path, {"train.max_steps": 4, "checkpoint.resume": "none",
                                   "recovery.fault_inject": "crash@step=2"})).train()
    restart(monkeypatch, 1)
    trainer = DDPTrainer(tiny(tmp_path, {"train.max_steps": 4, "checkpoint.resume": "none"}))
    assert trainer.step == 0
    trainer.close()


def unreadable(monkeypatch, *names: str) -> None:
    """Reading these checkpoint files fails as on a flaky disk or NFS (EIO), whichever way they are read."""
    read_bytes, load_file = Path.read_bytes, checkpoint_files.load_file

    def check(path) -> None:
        if isinstance(path, (str, Path)) and Path(path).name in names:
            raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(Path, "read_bytes", lambda self: check(self) or read_bytes(self))
    monkeypatch.setattr(checkpoint_files, "load_file", lambda path: check(path) or load_file(path))


@pytest.mark.parametrize("manifest", [True, False])
def test_an_unreadable_newest_checkpoint_is_skipped_and_leaves_no_fatal(tmp_path, monkeypatch, manifest):
    DDPTrainer(tiny(tmp_path, {"train.max_steps": 8, "checkpoint.every_steps": 4})).train()
    if not manifest:
        (tmp_path / "ck" / "manifest.json").unlink()
    unreadable(monkeypatch, "step_00000008.pt")
    trainer = DDPTrainer(tiny(tmp_path, {"train.max_steps": 12, "checkpoint.every_steps": 4}))
    assert trainer.step == 4
    trainer.close()
    log_text = (tmp_path / "logs" / "rank_0.log").read_text()
    assert f"checkpoint {tmp_path / 'ck' / 'step_00000008.pt'} is unusable: unreadable (EIO: Input/output error)" \
        in log_text
    assert markers.read(tmp_path / "ck", markers.FATAL) is None


def test_a_transient_read_error_with_nothing_else_to_resume_is_retried_not_fatal(tmp_path, monkeypatch):
    DDPTrainer(tiny(tmp_path, {"train.max_steps": 4})).train()
    newest = tmp_path / "ck" / "step_00000004.pt"
    unreadable(monkeypatch, newest.name)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    for resume in ("auto", str(newest)):  # auto must not start fresh over a checkpoint it could not read
        with pytest.raises(OSError, match="step_00000004.pt.*Input/output error.*a restart tries again"):
            DDPTrainer(tiny(tmp_path, {"train.max_steps": 8, "checkpoint.resume": resume}))
        assert markers.read(tmp_path / "ck", markers.FATAL) is None
        assert "Input/output error" in markers.read(tmp_path / "ck", markers.LAST_ERROR)


@pytest.mark.parametrize("torchrun", [True, False])
def test_the_last_restart_stops_on_an_unreadable_checkpoint_with_a_fatal_naming_it(tmp_path, monkeypatch,
                                                                                      torchrun):
    """The explorer's trial 100: every restart failed retriably on the only checkpoint (unreadable),
    and the last one ended in a traceback and no FATAL. Without a restart left, nothing will read it
    again: an explained stop, with the file left as it was."""
    DDPTrainer(tiny(tmp_path, {"train.max_steps": 4})).train()
    newest = tmp_path / "ck" / "step_00000004.pt"
    before = newest.read_bytes()
    unreadable(monkeypatch, newest.name)
    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
        restart(monkeypatch, 2)
    with pytest.raises(CheckpointError, match="step_00000004.pt.*Input/output error.*no restart is left"):
        DDPTrainer(tiny(tmp_path, {"train.max_steps": 8}))
    assert "step_00000004.pt" in markers.read(tmp_path / "ck", markers.FATAL)
    monkeypatch.undo()
    assert newest.read_bytes() == before


def test_a_rollback_takes_only_its_own_lineages_checkpoints(tmp_path):
    ck = tmp_path / "ck"
    DDPTrainer(tiny(tmp_path, {"train.max_steps": 8, "checkpoint.every_steps": 2,
                               "checkpoint.keep_last": 5})).train()  # another run: 2, 4, 6, 8
    other = {p.name: p.read_bytes() for p in ck.glob("step_*.pt")}
    (other_lineage,) = lineages(ck)
    trainer = DDPTrainer(tiny(tmp_path, {"train.max_steps": 8, "checkpoint.every_steps": 2,
                                         "checkpoint.resume": "none", "spike.guard": "rollback"}))
    assert trainer.checkpointer.roll_back(before=9) is None and trainer.step == 0  # nothing of its own yet
    trainer.train()
    assert trainer.checkpointer.store.lineage != other_lineage
    assert trainer.checkpointer.roll_back(before=7) == 6  # its own
    assert {p.name: p.read_bytes() for p in ck.glob("step_*.pt") if p.name in other} == other


def test_recorded_exclusions_apply_only_to_their_own_lineage(tmp_path):
    ck = tmp_path / "ck"
    DDPTrainer(tiny(tmp_path, {"train.max_steps": 4, "checkpoint.every_steps": 2})).train()
    (own,) = lineages(ck)
    rollback = {"step": 3, "restored_step": 2, "loss": 9.0, "z": 9.0, "samples": [5, 6]}
    (ck / exclusions.FILE).write_text(json.dumps({"samples": [5, 6], "rollbacks": [rollback],
                                                  "lineage": "0therrun0000"}))
    trainer = DDPTrainer(tiny(tmp_path, {"train.max_steps": 8}))  # resumes this lineage's step 4
    assert trainer.step == 4 and trainer.spike_guard.excluded == set()
    trainer.close()
    (ck / exclusions.FILE).write_text(json.dumps({"samples": [5, 6], "rollbacks": [rollback], "lineage": own}))
    trainer = DDPTrainer(tiny(tmp_path, {"train.max_steps": 8}))
    assert trainer.step == 4 and trainer.spike_guard.excluded == {5, 6}
    trainer.close()


def test_resuming_fp16_from_a_checkpoint_without_loss_scaling_is_a_one_line_checkpoint_error():
    model = torch.nn.Linear(2, 2)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    cfg = build_config({}, env={})  # fp16 needs CUDA to pass the check; the scaler stands for it
    ck = Checkpointer(cfg, SimpleNamespace(world_size=1), None, {"model": model, "scaler": scaler},
                      builtin_data=True)
    state = {"model": model.state_dict(), "scaler": {}, "config": {}, "world_size": 1}
    with pytest.raises(CheckpointError) as info:
        ck.restore(state)
    message = str(info.value)
    assert "\n" not in message and "saved without fp16 loss scaling" in message and "precision.autocast" in message


@pytest.mark.slow
def test_resume_auto_goes_back_to_where_a_path_run_began_when_all_its_checkpoints_are_unusable(tmp_path):
    """The explorer's trial 187 of seed 3000: a run begun with resume=PATH wrote one checkpoint,
    which was damaged; relaunched with resume=auto, it found nothing usable and started afresh from
    step 0, a different model. It now goes back to the checkpoint it began from."""
    base = DDPTrainer(tiny(tmp_path / "base", {"train.max_steps": 4, "checkpoint.every_steps": 4}))
    base.train()
    began = tmp_path / "base" / "ck" / "step_00000004.pt"
    whole = DDPTrainer(tiny(tmp_path / "whole", {"train.max_steps": 8, "checkpoint.every_steps": 6,
                                                 "checkpoint.resume": str(began)})).train()
    with pytest.raises(RuntimeError, match="crash at step 6"):
        DDPTrainer(tiny(tmp_path / "run", {"train.max_steps": 8, "checkpoint.every_steps": 6,
                                           "checkpoint.resume": str(began),
                                           "recovery.fault_inject": "crash@step=6"})).train()
    (own,) = (tmp_path / "run" / "ck").glob("step_00000006*.pt")
    os.truncate(own, own.stat().st_size // 2)
    relaunched = DDPTrainer(tiny(tmp_path / "run", {"train.max_steps": 8, "checkpoint.every_steps": 6,
                                                    "checkpoint.resume": "auto"}))
    assert relaunched.step == 4
    assert relaunched.train()["model_sha256"] == whole["model_sha256"]
