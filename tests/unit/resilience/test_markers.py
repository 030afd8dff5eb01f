"""The markers a run leaves for its restart (FATAL, PREEMPTED, MICRO_BATCH.json) and the check at start."""

import os

import pytest

from framework.resilience import markers
from framework.resilience.markers import FATAL, MICRO_BATCH, PREEMPTED, FatalError
from tests.tiny import tiny as tiny_config


def test_write_read_clear(tmp_path):
    assert markers.read(tmp_path, FATAL) is None
    markers.write(tmp_path, FATAL, "rank 1: boom ✗")
    assert markers.read(tmp_path, FATAL) == "rank 1: boom ✗"
    assert markers.read(str(tmp_path), FATAL) == "rank 1: boom ✗"  # str or Path
    markers.write(tmp_path, FATAL, "second")  # replaces
    assert markers.read(tmp_path, FATAL) == "second"
    assert markers.read(tmp_path, PREEMPTED) is None
    markers.write(tmp_path, PREEMPTED, "")
    assert markers.read(tmp_path, PREEMPTED) == ""  # an empty marker still exists
    markers.clear(tmp_path, FATAL)
    assert markers.read(tmp_path, FATAL) is None
    markers.clear(tmp_path, FATAL)  # clearing a missing marker is fine
    assert sorted(os.listdir(tmp_path)) == [PREEMPTED]  # nothing else left behind (no temp files)
    markers.write(tmp_path / "not" / "yet", FATAL, "x")  # checkpoint_dir may not exist yet
    assert markers.read(tmp_path / "not" / "yet", FATAL) == "x"


def test_write_fatal_message(tmp_path, caplog):
    markers.write_fatal(tmp_path, 3, ValueError("bad shape (4, 3)"))
    assert markers.read(tmp_path, FATAL) == "rank 3: ValueError: bad shape (4, 3)"
    assert "fatal, not retriable" in caplog.text
    markers.write_fatal(tmp_path, 0, FatalError("ranks diverged"))
    assert markers.read(tmp_path, FATAL) == "rank 0: FatalError: ranks diverged"


def test_micro_batch_round_trip(tmp_path):
    assert markers.recorded_micro_batch(tmp_path) is None
    markers.record_micro_batch(tmp_path, 4, 8, "out of memory at step 12")
    assert markers.recorded_micro_batch(tmp_path) == {"micro_batch_size": 4, "accumulation_steps": 8,
                                                      "reason": "out of memory at step 12"}
    markers.record_micro_batch(tmp_path, 2, 16, "again")
    assert markers.recorded_micro_batch(tmp_path)["micro_batch_size"] == 2
    assert (tmp_path / MICRO_BATCH).exists()


def test_fresh_launch_clears_earlier_markers_on_main(tmp_path, caplog):
    markers.write(tmp_path, FATAL, "rank 1: RuntimeError: old")
    markers.record_micro_batch(tmp_path, 4, 2, "oom")
    markers.check_at_start(tmp_path, group_restarts=0, is_main=False)  # not main: leaves them for rank 0
    assert markers.read(tmp_path, FATAL) is not None and markers.recorded_micro_batch(tmp_path) is not None
    markers.check_at_start(tmp_path, group_restarts=0, is_main=True)
    assert markers.read(tmp_path, FATAL) is None
    assert markers.recorded_micro_batch(tmp_path) is None
    assert "clearing the FATAL marker of an earlier run: rank 1: RuntimeError: old" in caplog.text
    markers.check_at_start(tmp_path, group_restarts=0, is_main=True)  # nothing to clear: fine


def test_restart_stops_on_an_earlier_fatal_marker(tmp_path):
    markers.check_at_start(tmp_path, group_restarts=2, is_main=True)  # no marker: a restart goes on
    markers.write_fatal(tmp_path, 1, ValueError("dataset lengths differ"))
    markers.record_micro_batch(tmp_path, 4, 2, "oom")
    for is_main in (False, True):
        with pytest.raises(FatalError, match="restart cannot help: rank 1: ValueError: dataset lengths differ"):
            markers.check_at_start(tmp_path, group_restarts=1, is_main=is_main)
    # a restart keeps both: the marker stops every restart, the micro-batch applies to it
    assert markers.read(tmp_path, FATAL) == "rank 1: ValueError: dataset lengths differ"
    assert markers.recorded_micro_batch(tmp_path)["micro_batch_size"] == 4


def test_a_restart_clears_the_node_lost_marker_of_an_earlier_restart_on_each_node(tmp_path):
    """NODE_LOST makes the launcher exit 75 (requeue): a loss that a restart survived must not
    turn the launch's later, unrelated failure into 75 (issue 33, bug 1)."""
    import os
    import time
    from framework.resilience.markers import NODE_LOST
    markers.write(tmp_path, NODE_LOST, "a peer process of the run went away")
    old = time.time() - 3600  # written by an earlier restart, before this process started
    os.utime(tmp_path / NODE_LOST, (old, old))
    markers.check_at_start(tmp_path, group_restarts=0, is_main=True)  # a fresh launch: the launcher's stamp decides
    markers.check_at_start(tmp_path, group_restarts=1, is_main=False)  # not the node's first process
    assert markers.read(tmp_path, NODE_LOST) is not None
    markers.check_at_start(tmp_path, group_restarts=1, is_main=False, is_local_main=True)
    assert markers.read(tmp_path, NODE_LOST) is None
    markers.write(tmp_path, NODE_LOST, "a peer of this restart went away")  # this restart's: kept
    markers.check_at_start(tmp_path, group_restarts=1, is_main=True, is_local_main=True)
    assert markers.read(tmp_path, NODE_LOST) == "a peer of this restart went away"


def test_restart_keeps_the_recorded_micro_batch(tmp_path):
    markers.record_micro_batch(tmp_path, 4, 2, "oom")
    markers.check_at_start(tmp_path, group_restarts=1, is_main=True)
    assert markers.recorded_micro_batch(tmp_path) == {"micro_batch_size": 4, "accumulation_steps": 2, "reason": "oom"}


def test_restarts_count_only_while_they_resume_from_the_same_step(tmp_path):
    from framework.resilience import markers
    assert markers.note_restart(tmp_path, 8, limit=2) is None
    assert markers.note_restart(tmp_path, 16, limit=2) is None  # progress: the count starts again
    assert markers.note_restart(tmp_path, 16, limit=2) is None
    message = markers.note_restart(tmp_path, 16, limit=2)
    assert message.startswith("3 restarts in a row resumed from step 16") and "none recorded" in message
    markers.record_error(tmp_path, 1, RuntimeError("boom\nmore"))
    assert markers.note_restart(tmp_path, 16, limit=2).endswith("the last error: rank 1: RuntimeError: boom")
    markers.check_at_start(tmp_path, group_restarts=0, is_main=True)  # a fresh launch forgets them
    assert markers.note_restart(tmp_path, 16, limit=2) is None


def test_a_damaged_restart_count_starts_afresh(tmp_path):
    from framework.resilience import markers
    (tmp_path / markers.RESTARTS).write_text("{not json")
    assert markers.note_restart(tmp_path, 8, limit=1) is None
    assert markers.note_restart(tmp_path, 8, limit=1).startswith("2 restarts in a row resumed from step 8")


def test_a_fatal_message_stays_the_original_cause_on_every_restart(tmp_path):
    markers.write_fatal(tmp_path, 1, ValueError("dataset lengths differ"))
    for _ in range(3):  # each restart stops at once, and the trainer writes FATAL for any FatalError
        with pytest.raises(FatalError) as info:
            markers.check_at_start(tmp_path, group_restarts=1, is_main=True)
        markers.write_fatal(tmp_path, 0, info.value)
    assert markers.read(tmp_path, FATAL) == "rank 1: ValueError: dataset lengths differ"
    assert str(info.value) == ("an earlier restart of this run failed and a restart cannot help: "
                               "rank 1: ValueError: dataset lengths differ")


def test_a_second_launch_into_a_live_runs_checkpoint_dir_changes_none_of_its_markers(tmp_path):
    from framework import DDPTrainer
    from framework.state.checkpoint_files import CheckpointDirLocked, CheckpointStore

    ck = tmp_path / "ck"
    live = CheckpointStore(ck)  # the live run holds checkpoint_dir's lock
    markers.record_micro_batch(ck, 4, 2, "out of memory at step 3")
    markers.note_restart(ck, 8, limit=3)
    markers.record_error(ck, 1, RuntimeError("the live run's last error"))
    markers.write(ck, PREEMPTED, "preempted at step 9")
    before = {p.name: p.read_bytes() for p in ck.iterdir() if p.name != ".lock"}
    cfg = tiny_config(tmp_path, {"train.max_steps": 2, "checkpoint.dir": str(ck)}, dataset_size=64)
    try:
        with pytest.raises(CheckpointDirLocked, match="is in use by another run"):
            DDPTrainer(cfg)
        assert {p.name: p.read_bytes() for p in ck.iterdir() if p.name != ".lock"} == before
    finally:
        live.close()


def test_a_peers_consequential_error_does_not_replace_the_cause(tmp_path):
    """Replayed explorer trial 59: rank 0 failed (IsADirectoryError), rank 1 then failed in a
    collective with gloo's "Connection closed by peer" and overwrote LAST_ERROR, which the
    restart-loop FATAL quotes."""
    markers.record_error(tmp_path, 0, IsADirectoryError(21, "Is a directory"))
    markers.record_error(tmp_path, 1, RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                                                   "[127.0.0.1]:4242"))
    assert markers.read(tmp_path, markers.LAST_ERROR).startswith("rank 0: IsADirectoryError")
    markers.record_error(tmp_path, 1, ValueError("a cause of its own"))  # not consequential: it is recorded
    assert markers.read(tmp_path, markers.LAST_ERROR) == "rank 1: ValueError: a cause of its own"


def test_a_consequential_error_is_recorded_when_nothing_of_this_restart_is(tmp_path):
    (tmp_path / markers.LAST_ERROR).write_text("rank 0: OSError: an earlier restart's")
    os.utime(tmp_path / markers.LAST_ERROR, (0, 0))  # written before this process started
    markers.record_error(tmp_path, 1, RuntimeError("Connection reset by peer"))
    assert markers.read(tmp_path, markers.LAST_ERROR) == "rank 1: RuntimeError: Connection reset by peer"


def test_only_a_collective_that_timed_out_reads_as_a_timeout():
    """Healing in place, a collective that timed out on a member found stopped is a peer's loss
    (trainer._if_a_peer_is_lost); a deliberate stop or another error is not, whatever its words."""
    from framework.resilience.markers import FatalError, timed_out
    gloo = "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete"
    assert timed_out(RuntimeError(gloo))
    assert not timed_out(FatalError(gloo)) and not timed_out(ValueError(gloo))
    assert not timed_out(RuntimeError("CUDA out of memory"))
