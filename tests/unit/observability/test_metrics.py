"""The metrics stream (log_dir/metrics.jsonl) and the summary's counters, in one process."""

import json

import pytest

from framework import DDPTrainer
from framework.observability.metrics import read_metrics
from tests.tiny import variant

# tiny(run_dir, overrides): this module's variant of the tiny configuration, its dirs under run_dir
tiny = variant({"eval.interval": 4, "memory_check_interval": 4})
TINY = tiny()


def test_every_logged_scalar_goes_to_the_stream_and_the_last_loss_is_the_summarys(tmp_path):
    summary = DDPTrainer(tiny(tmp_path, {"train.max_steps": 7})).train()
    rows = read_metrics(tmp_path / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 4, 6, 7]
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "val/loss",
            "memory/rss_gb"} <= rows[1].keys()
    assert rows[-1]["train/loss"] == summary["final_train_loss"]
    assert rows[-1]["val/loss"] == summary["final_val_loss"]
    assert summary["skipped_steps"] == 0 and summary["restarts"] == 0


@pytest.mark.slow
def test_a_resumed_run_appends_and_its_purge_keeps_the_steps_increasing(tmp_path):
    DDPTrainer(tiny(tmp_path, {"train.max_steps": 12, "checkpoint.every_steps": 4,
                               "recovery.fault_inject": "sigterm@step=5"})).train()
    path = tmp_path / "logs" / "metrics.jsonl"
    first = path.read_text()
    summary = DDPTrainer(tiny(tmp_path, {"train.max_steps": 12, "checkpoint.every_steps": 4})).train()
    text = path.read_text()
    assert text.startswith(first)  # appended, never rewritten
    assert json.loads(text[len(first):].splitlines()[0]) == {"purge_from": 7}  # resumed from step 6
    steps = [r["step"] for r in read_metrics(path)]
    assert steps == sorted(set(steps)) and steps[-1] == 12
    assert read_metrics(path)[-1]["train/loss"] == summary["final_train_loss"]


def test_skipped_steps_are_counted_in_the_summary(tmp_path):
    summary = DDPTrainer(tiny(tmp_path, {"train.max_steps": 6, "recovery.fault_inject": "nan@step=2"})).train()
    assert summary["skipped_steps"] == 1


def test_restarts_with_and_without_a_checkpoint_keep_steps_increasing_and_samples_once(tmp_path, monkeypatch):
    """8 steps an epoch. The first start crashes at step 5 with no checkpoint; the second
    starts again at 0, saves step 6 and crashes at step 10; the third resumes from 6."""
    from framework.data.sampler import ResumableDistributedSampler
    from framework.observability.metrics import read_samples

    cfg = tiny(tmp_path, {"train.max_steps": 12, "checkpoint.every_steps": 6, "logging.record_samples": True,
                          "recovery.fault_inject": "crash@step=5; crash@step=10,restart=1"}, dataset_size=64)
    for count in (0, 1, 2):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(count))
        try:
            summary = DDPTrainer(cfg).train()
        except RuntimeError as err:
            assert count < 2 and "fault injection: crash" in str(err)
    assert summary["steps"] == 12
    steps = [r["step"] for r in read_metrics(tmp_path / "logs" / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == 12
    records = read_samples(tmp_path / "logs" / "samples_rank_0.jsonl")
    assert [r["step"] for r in records] == list(range(1, 13))
    permutation = ResumableDistributedSampler(64, 1, 0, 8, 1, TINY.get("train.seed", 1337)).permutation
    epoch0 = sorted(i for r in records if r["epoch"] == 0 for i in r["indices"])
    assert epoch0 == sorted(permutation(0).tolist())  # every sample of the completed epoch, once


def test_a_relaunch_that_resumes_at_the_last_step_reports_the_loss_it_ended_with(tmp_path):
    """A kill -9 during the export leaves the final checkpoint; the relaunch resumes there and runs
    no step, and its summary's final_train_loss is still the last step's (as metrics.jsonl says)."""
    first = DDPTrainer(tiny(tmp_path, {"train.max_steps": 6}, log_interval=1)).train()
    (tmp_path / "logs" / "summary.json").unlink()
    again = DDPTrainer(tiny(tmp_path, {"train.max_steps": 6, "checkpoint.resume": "auto"}, log_interval=1)).train()
    assert again["steps"] == 6
    rows = read_metrics(tmp_path / "logs" / "metrics.jsonl")
    assert again["final_train_loss"] == first["final_train_loss"] == rows[-1]["train/loss"]
    assert json.loads((tmp_path / "logs" / "summary.json").read_text())["final_train_loss"] == rows[-1]["train/loss"]


def two_ranks_recorded(log_dir, steps: int) -> None:
    """Ranks 0 and 1 recorded steps 1..``steps`` (sample 2 * step + rank each) in ``log_dir``."""
    from framework.observability.metrics import SampleLog
    logs = {rank: SampleLog(log_dir / f"samples_rank_{rank}.jsonl") for rank in (0, 1)}
    for step in range(1, steps + 1):
        for rank, log in logs.items():
            log.write(0, step, [2 * step + rank])
    for log in logs.values():
        log.close()


def test_a_run_on_fewer_ranks_purges_the_files_of_the_ranks_it_does_not_have(tmp_path):
    """2 ranks recorded steps 1-12 and died after the checkpoint of step 8; the run resumed there on
    1 rank, and later on 2 again from step 20. Rank 1's steps 9-12 belong to no run: without the
    purge at the 1-rank resume, rank 1's own purge (from step 21) would leave them."""
    from framework.observability.metrics import SampleLog, read_samples
    two_ranks_recorded(tmp_path, steps=12)
    SampleLog.purge_absent_ranks(tmp_path, world_size=1, from_step=9)  # the 1-rank resume at step 8
    alone = SampleLog(tmp_path / "samples_rank_0.jsonl")
    for step in range(9, 21):
        alone.write(0, step, [2 * step, 2 * step + 1])
    alone.close()
    SampleLog.purge_absent_ranks(tmp_path, world_size=2, from_step=21)  # nothing absent: a no-op
    back = SampleLog(tmp_path / "samples_rank_1.jsonl")
    back.write(0, 21, [43])
    back.close()
    assert [r["step"] for r in read_samples(tmp_path / "samples_rank_1.jsonl")] == [*range(1, 9), 21]
    assert [r["step"] for r in read_samples(tmp_path / "samples_rank_0.jsonl")] == list(range(1, 21))


def test_a_rollback_on_fewer_ranks_purges_the_files_of_the_ranks_it_does_not_have(tmp_path):
    """2 ranks recorded steps 1-4; rank 1 was lost in step 5 and rank 0 healed in place alone (or a
    run resumed on 1 rank at step 4); then a rollback went back to step 3. Rank 0 redoes step 4 with
    the whole global batch: rank 1's record of step 4 must go too (an explorer trial counted its
    samples twice in the epoch)."""
    from framework.observability.metrics import SampleLog, read_samples
    two_ranks_recorded(tmp_path, steps=4)
    SampleLog.purge_absent_ranks(tmp_path, world_size=1, from_step=5)  # healed at step 4, on 1 rank
    alone = SampleLog(tmp_path / "samples_rank_0.jsonl", world_size=1)
    alone.write(0, 5, [10, 11])
    alone.write(0, 4, [8, 9])  # rolled back to step 3: step 4 again
    alone.close()
    assert [r["step"] for r in read_samples(tmp_path / "samples_rank_1.jsonl")] == [1, 2, 3]
    assert [r["indices"] for r in read_samples(tmp_path / "samples_rank_0.jsonl")] == [[2], [4], [6], [8, 9]]


def test_a_steps_row_is_written_when_the_step_ends(tmp_path):
    """A rank killed after a step must not take the step's row with it: the restart may resume
    after that step (a survivor checkpoint) and never log it again."""
    from framework.observability.metrics import Metrics
    metrics = Metrics(enabled=True, log_dir=tmp_path, tensorboard=False, progress_bar="false", total_steps=9)
    metrics.scalars(1, {"train/loss": 2.0})
    metrics.end_step()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "train/loss": 2.0}]  # before step 2
    metrics.scalars(1, {"val/loss": 1.5})  # the step's evaluation, after it ended
    metrics.scalars(2, {"train/loss": 1.8})
    metrics.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "train/loss": 2.0, "val/loss": 1.5},
                                                        {"step": 2, "train/loss": 1.8}]
