"""Fault tolerance end to end on 2 gloo ranks, with real signals: kill -9 and elastic restart,
SIGTERM to a worker and to launch_training.sh, damaged checkpoints, FATAL markers, 2 nodes."""

import datetime
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from framework.data.sampler import ResumableDistributedSampler
from framework.observability.metrics import read_metrics, read_samples
from tests.dist_helper import (FAULT_RUN as CONFIG, ROOT, args_for, free_port, launch, processes_matching,
                               rank_log, summary, torchrun_cmd, worker_env)

pytestmark = pytest.mark.dist

STEPS_PER_EPOCH = 32  # FAULT_RUN: 256 samples, 2 ranks x batch 4


def train(run_dir: Path, overrides: dict | None = None, /, nproc=2, torchrun_extra=None, timeout=180, **compact):
    return launch(ROOT / "ddp_training.py", args_for(run_dir, overrides, **compact), run_dir, nproc=nproc,
                  torchrun_extra=torchrun_extra, timeout=timeout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, computed once."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    run = train(run_dir)
    assert run.returncode == 0, run.output[-3000:]
    result = summary(run_dir)
    assert result["steps"] == 48 and not result["preempted"]
    return result["model_sha256"]


def committed_samples(run_dir: Path) -> dict[int, dict[int, list[int]]]:
    """epoch -> step -> indices (both ranks), with the purges applied: a step recorded by an
    restart that died before its checkpoint was redone after the restart."""
    steps: dict[tuple[int, int], dict[int, list[int]]] = {}
    for rank in (0, 1):
        records = read_samples(run_dir / "logs" / f"samples_rank_{rank}.jsonl")
        assert [r["step"] for r in records] == sorted({r["step"] for r in records})
        for rec in records:
            steps.setdefault((rec["epoch"], rec["step"]), {})[rank] = rec["indices"]
    by_epoch: dict[int, dict[int, list[int]]] = {}
    for (epoch, step), ranks in steps.items():
        by_epoch.setdefault(epoch, {})[step] = ranks[0] + ranks[1]
    return by_epoch


def assert_each_sample_once_per_epoch(run_dir: Path):
    by_epoch = committed_samples(run_dir)
    sampler = ResumableDistributedSampler(CONFIG["dataset_size"], 2, 0, CONFIG["batch_size"], 1, CONFIG["train.seed"])
    assert sorted(by_epoch) == [0, 1]
    for epoch, steps in by_epoch.items():
        n_steps = STEPS_PER_EPOCH if epoch == 0 else 48 - STEPS_PER_EPOCH
        assert len(steps) == n_steps
        consumed = sorted(i for indices in steps.values() for i in indices)
        expected = sorted(sampler.permutation(epoch)[:n_steps * 8].tolist())
        assert consumed == expected, f"epoch {epoch}: samples skipped or repeated"


# A rank is killed in step kill_at + 1, twice in one launch (--max-restarts 2): in epoch 0, and in
# epoch 1 by the restart. Its peer, gone, saves step kill_at alone (the last step both finished) and
# the restart resumes there, bit-exact although the killed rank's generators were never saved (each
# rank's are seeded from (seed, rank, step)); rank 0 is the victim once, and rank 1 writes then.
# With the survivor checkpoint off, a restart resumes from the last periodic checkpoint (every 8 steps; the
# second one's is the one written at the end of epoch 0, step 32).
@pytest.mark.parametrize(("kills", "resumed_at", "save_survivor"), [
    (((1, 21), (0, 34)), (21, 34), True),
    (((1, 21), (1, 34)), (16, 32), False)])
def test_kill_9_then_elastic_restart_resumes_bit_exact(reference, tmp_path, kills, resumed_at, save_survivor):
    faults = "; ".join(f"sigkill@step={step},rank={victim},restart={i}" for i, (victim, step) in enumerate(kills))
    run = train(tmp_path, {"recovery.fault_inject": faults}, torchrun_extra=["--max-restarts", "2"],
                **{"checkpoint.save_on_peer_loss": save_survivor})
    assert run.returncode == 0, run.output[-4000:]
    log0 = rank_log(tmp_path)
    for (victim, kill_at), resume_at in zip(kills, resumed_at, strict=True):
        assert f"fault injection: sigkill at step {kill_at} on rank {victim}" in rank_log(tmp_path, victim)
        assert f"resumed from step {resume_at}" in log0
        saved_alone = f"this rank saved step {kill_at}, the last step every rank finished, alone"
        assert (saved_alone in rank_log(tmp_path, 1 - victim)) == save_survivor, (victim, kill_at)
    result = summary(tmp_path)
    assert result["steps"] == 48
    assert result["model_sha256"] == reference
    assert_each_sample_once_per_epoch(tmp_path)
    # The metrics stream survived the kills: appended, and with its purges the steps run 1..48 once.
    rows = read_metrics(tmp_path / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 49))
    assert rows[-1]["train/loss"] == result["final_train_loss"] and result["restarts"] == 2
    assert not run.leftovers


def test_a_step_slower_than_the_peer_timeout_is_not_a_loss(tmp_path):
    """Rank 1's steps take 2.5 s from step 4 on (a sleep in each forward: a slow rank, not a frozen
    one), longer than recovery.peer_timeout_s=2: its monitor thread beats on, so nobody is named
    and the run ends as usual."""
    run = train(tmp_path, {"recovery.fault_inject": "slow@step=3,rank=1,ms=2500", "recovery.peer_timeout_s": 2,
                           "train.max_steps": 6})
    assert run.returncode == 0, run.output[-4000:]
    log0 = rank_log(tmp_path)
    stamps = {int(m.group(2)): datetime.datetime.fromisoformat(m.group(1))
              for m in re.finditer(r"^(\S+ \S+) \[rank 0\] .*step (\d+)/6 ", log0, re.M)}
    assert (stamps[6] - stamps[4]).total_seconds() >= 2 * 2.5 - 1  # the slow steps outlast the timeout
    assert "went silent" not in log0 + rank_log(tmp_path, 1) and summary(tmp_path)["steps"] == 6


def test_a_frozen_rank_is_named_in_seconds_and_the_restart_trains_on_bit_exact(reference, tmp_path):
    """Rank 1 stops itself (SIGSTOP) at the start of step 13, 1 s into training: nothing closes a connection, and its
    peer would wait in the all-reduce for ddp.timeout_s (600 s). Rank 0's peer monitor names it
    after recovery.peer_timeout_s, kills it (on this host) and exits 75; torchrun restarts the
    group at once (a stopped rank it would wait for 30 s, its SIGTERM grace), which resumes from
    step 8 and ends as the uninterrupted run."""
    run = train(tmp_path, {"recovery.fault_inject": "sigstop@step=12,rank=1", "recovery.peer_timeout_s": 8},
                torchrun_extra=["--max-restarts", "1"], timeout=240)
    assert run.returncode == 0, run.output[-4000:]
    log0, log1 = rank_log(tmp_path), rank_log(tmp_path, 1)
    assert "fault injection: sigstop at step 12 on rank 1" in log1
    [silent] = [line for line in log0.splitlines() if "rank 1 went silent: no heartbeat for" in line]
    stopped = next(line for line in log1.splitlines() if "fault injection: sigstop at step 12" in line)
    waited = (datetime.datetime.fromisoformat(silent[:19]) - datetime.datetime.fromisoformat(stopped[:19]))
    assert waited.total_seconds() <= 8 + 10  # the timeout, a beat and a loaded machine's slack; not 600 s
    assert "ending this restart with exit 75" in silent
    assert "rank 1 is stopped (pid " in log0  # killed by its watcher, not by torchrun's SIGKILL 30 s after SIGTERM
    resumed = next(line for line in log0.splitlines() if "resumed from step 8" in line)
    restart = datetime.datetime.fromisoformat(resumed[:19]) - datetime.datetime.fromisoformat(silent[:19])
    assert restart.total_seconds() <= 15, (silent, resumed)  # a restart's start-up (3 s); 32 s before the kill
    result = summary(tmp_path)
    assert result["steps"] == 48 and result["restarts"] == 1
    assert result["model_sha256"] == reference
    assert_each_sample_once_per_epoch(tmp_path)
    assert not run.leftovers


@pytest.mark.parametrize(("faults", "resumed"), [
    # Rank 1 raises at the start of the evaluation after step 32, which comes before that step's save:
    # the restart resumes from step 24 and evaluates step 32 (saved first, its evaluation was lost).
    # Then rank 0 hangs, holding the GIL, in the final evaluation: the watchdog's evaluation deadline
    # ends it; the final save comes after that evaluation, so the restart resumes from step 40.
    (("crash@step=32,rank=1,at=eval", "hang@step=48,rank=0,at=eval,restart=1"), ((24,), (40,))),
    # Rank 0 raises while the background writer holds its checkpoint of step 32; then rank 1 is
    # killed with -9 at the start of the final save.
    (("crash@step=32,rank=0,at=save", "sigkill@step=48,rank=1,at=save,restart=1"), ((24, 32), (40,))),
])
def test_a_fault_during_evaluation_or_save_restarts_and_ends_as_uninterrupted(reference, tmp_path, faults, resumed):
    run = train(tmp_path, {"recovery.fault_inject": "; ".join(faults), "eval.interval": 16,
                           "recovery.step_timeout_s": 5}, torchrun_extra=["--max-restarts", "2"])
    assert run.returncode == 0, run.output[-4000:]
    restarts = rank_log(tmp_path).split("resumed from step ")
    for fault, steps, after in zip(faults, resumed, restarts[1:], strict=True):
        kind, rank = fault.split("@")[0], int(fault.split("rank=")[1][0])
        step = int(fault.split("step=")[1].split(",")[0])
        moment = "the evaluation" if ",at=eval" in fault else "the checkpoint save"
        assert f"fault injection: {kind} at step {step} on rank {rank} (during {moment})" in rank_log(tmp_path, rank)
        assert int(after.split(" ")[0]) in steps, (fault, rank_log(tmp_path)[-3000:])
    if "hang@" in faults[1]:  # the watchdog's faulthandler dump, naming where the evaluation hung
        assert "Timeout (0:00:" in rank_log(tmp_path, 0) and "in fire_process_faults" in rank_log(tmp_path, 0)
    # every evaluation is in the metrics once: none lost to a fault, none run twice
    rows = read_metrics(tmp_path / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows if "val/loss" in r] == [16, 32, 48]
    result = summary(tmp_path)
    assert result["steps"] == 48 and result["restarts"] == 2
    assert result["model_sha256"] == reference  # evaluation draws no randomness: the same weights
    assert not run.leftovers


def test_sigterm_to_one_worker_saves_within_a_step_and_resumes(reference, tmp_path):
    run = train(tmp_path, {"recovery.fault_inject": "sigterm@step=20,rank=1"})
    assert run.returncode == 0, run.output[-4000:]
    assert (tmp_path / "ck" / "PREEMPTED").read_text() == "preempted at step 21"
    assert (tmp_path / "ck" / "step_00000021.pt").is_file()
    assert summary(tmp_path)["preempted"] and summary(tmp_path)["steps"] == 21
    assert not run.leftovers
    resumed = train(tmp_path)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "resumed from step 21" in rank_log(tmp_path)
    assert summary(tmp_path)["model_sha256"] == reference
    assert_each_sample_once_per_epoch(tmp_path)


def test_sigterm_to_launch_script_exits_0_and_resumes(reference, tmp_path):
    script = [str(ROOT / "launch_training.sh"), "--cpu", "--nproc", "2", "--", *args_for(tmp_path)]
    env = {k: v for k, v in worker_env().items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(script, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log_file = tmp_path / "logs" / "rank_0.log"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if log_file.exists() and "step 3/48" in log_file.read_text():
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output[-4000:]
    assert "preempted" in output
    marker = (tmp_path / "ck" / "PREEMPTED").read_text()
    step = int(marker.split()[-1])
    assert 3 <= step < 48 and (tmp_path / "ck" / f"step_{step:08d}.pt").is_file()
    time.sleep(0.5)
    assert not processes_matching(str(tmp_path))
    resumed = train(tmp_path)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert f"resumed from step {step}" in rank_log(tmp_path)
    assert summary(tmp_path)["model_sha256"] == reference


def test_truncated_newest_checkpoint_falls_back(reference, tmp_path):
    run = train(tmp_path, {"recovery.fault_inject": "sigterm@step=29"})
    assert run.returncode == 0, run.output[-4000:]
    newest = tmp_path / "ck" / "step_00000030.pt"
    os.truncate(newest, newest.stat().st_size // 2)
    resumed = train(tmp_path)
    assert resumed.returncode == 0, resumed.output[-4000:]
    log0 = rank_log(tmp_path)
    assert "step_00000030.pt" in log0 and "truncated" in log0
    assert "resumed from step 24" in log0
    assert summary(tmp_path)["model_sha256"] == reference


def test_fatal_marker_stops_a_restarted_group_at_once(tmp_path):
    start = time.monotonic()
    run = train(tmp_path, {"recovery.fault_inject": "nan@step=3"}, torchrun_extra=["--max-restarts", "2"],
                max_errors_per_epoch=0)
    assert run.returncode != 0
    marker = (tmp_path / "ck" / "FATAL").read_text()
    assert "max_errors_per_epoch=0" in marker and "steps [3]" in marker
    assert run.output.count("an earlier restart of this run failed and a restart cannot help") >= 2
    assert "fault injection: nan at step 3" in rank_log(tmp_path)
    assert time.monotonic() - start < 60
    assert not run.leftovers


def test_a_kill_after_a_rollback_keeps_its_exclusions_and_the_run_equals_the_excluding_one(tmp_path):
    spike = {"spike.guard": "rollback", "spike.warmup": 8, "spike.window": 16, "spike.threshold": 8}
    run = train(tmp_path / "rolled", {"recovery.fault_inject": "bad_data@step=20,rank=1; sigkill@step=22,rank=0"},
                torchrun_extra=["--max-restarts", "1"], **spike)
    assert run.returncode == 0, run.output[-3000:]
    log = rank_log(tmp_path / "rolled")
    assert "rolled back to the checkpoint of step 16" in log
    # Rank 0 is killed after the rollback: rank 1 saves step 22 alone, its exclusions with it.
    assert "this rank saved step 22, the last step every rank finished, alone" in rank_log(tmp_path / "rolled", 1)
    assert "resumed from step 22" in log
    excluded = tmp_path / "rolled" / "ck" / "EXCLUDED_SAMPLES.json"
    assert len(json.loads(excluded.read_text())["samples"]) == 8
    ref = train(tmp_path / "excluding", {"data.exclude_samples": str(excluded)}, **spike)
    assert ref.returncode == 0, ref.output[-3000:]
    assert summary(tmp_path / "rolled")["model_sha256"] == summary(tmp_path / "excluding")["model_sha256"]
    assert summary(tmp_path / "rolled")["excluded_samples"] == 8 and summary(tmp_path / "excluding")["loss_spikes"] == 0


def test_two_nodes_on_loopback_match_one_node(reference, tmp_path):
    port = free_port()
    procs = []
    for _node in range(2):
        cmd = torchrun_cmd(ROOT / "ddp_training.py", args_for(tmp_path), nproc=1)
        cmd[cmd.index("--nnodes") + 1] = "2"
        cmd[cmd.index("--rdzv-endpoint") + 1] = f"127.0.0.1:{port}"
        cmd[cmd.index("--rdzv-endpoint"):cmd.index("--rdzv-endpoint")] = ["--rdzv-id", "two-node-test"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert summary(tmp_path)["world_size"] == 2
    assert summary(tmp_path)["model_sha256"] == reference


def test_damaged_or_malicious_checkpoint_in_one_process(tmp_path):
    from framework import DDPTrainer
    from framework.state.checkpoint_files import CheckpointError

    cfg = {**CONFIG, "train.max_steps": 12, "checkpoint.every_steps": 4, "logging.record_samples": False,
           "logging.tensorboard": False, "logging.dir": str(tmp_path / "logs"), "checkpoint.dir": str(tmp_path / "ck")}
    DDPTrainer(cfg).train()
    newest = tmp_path / "ck" / "step_00000012.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    trainer = DDPTrainer({**cfg, "train.max_steps": 16})
    assert trainer.step == 8
    assert "checksum mismatch" in rank_log(tmp_path)
    trainer.close()  # it holds checkpoint_dir's lock

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    evil = tmp_path / "evil.pt"
    torch.save({"model": Evil()}, evil)
    with pytest.raises(CheckpointError, match="refused"):
        DDPTrainer({**cfg, "checkpoint.resume": str(evil)})
    assert not (tmp_path / "pwned").exists()


def test_resume_on_a_different_world_size_continues_at_the_global_offset(tmp_path):
    from framework import DDPTrainer

    run = train(tmp_path, {"recovery.fault_inject": "sigterm@step=20,rank=0"})
    assert run.returncode == 0, run.output[-3000:]
    cfg = {**CONFIG, "logging.record_samples": False, "logging.dir": str(tmp_path / "one" / "logs"),
           "checkpoint.dir": str(tmp_path / "ck")}
    trainer = DDPTrainer(cfg)  # one process, resuming the 2-rank checkpoint of step 21
    assert trainer.step == 21 and trainer.sampler.consumed == 21 * 8
    # The global batch is the checkpoint's: 1 rank x micro-batch 4 x accumulation 2 (tests/integration/test_elastic.py).
    assert (trainer.sampler.batch_size, trainer.sampler.accumulation, trainer.sampler.global_batch) == (4, 2, 8)
    assert "resuming a world-size-2 checkpoint on 1 ranks" in rank_log(tmp_path / "one")
    trainer.close()


def test_a_restart_under_resume_none_or_path_continues_its_own_lineage(reference, tmp_path):
    """resume= describes the launch: rank 1 killed at step 25 (checkpoints every 10), a restart
    resumes its own step 25 (which rank 0 saved alone), not step 0 (none) or PATH (a checkpoint of
    step 10), in one lineage."""
    kill = {"checkpoint.every_steps": 10, "checkpoint.keep_last": 10, "recovery.fault_inject": "sigkill@step=25,rank=1"}
    origin = tmp_path / "none" / "ck" / "step_00000010.pt"  # written by the first run
    for name, resume, first in (("none", "none", 1), ("path", str(origin), 11)):
        run_dir = tmp_path / name
        run = train(run_dir, {"checkpoint.resume": resume}, torchrun_extra=["--max-restarts", "1"], **kill)
        assert run.returncode == 0, run.output[-4000:]
        log0 = rank_log(run_dir)
        assert "fault injection: sigkill at step 25 on rank 1" in rank_log(run_dir, 1)
        assert "this rank saved step 25, the last step every rank finished, alone" in log0
        assert log0.count("resumed from step 25") == 1, log0[-3000:]
        assert log0.count("resumed from step ") == (1 if name == "none" else 2)  # and PATH's step 10 at launch
        result = summary(run_dir)
        assert result["steps"] == 48 and result["restarts"] == 1
        assert result["model_sha256"] == reference
        entries = json.loads((run_dir / "ck" / "manifest.json").read_text())
        assert [e["step"] for e in entries] == [10, 20, 25, 30, 40, 48][first // 10:]
        assert len({e["lineage"] for e in entries}) == 1  # no second lineage
        rows = read_metrics(run_dir / "logs" / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(first, 49))
        assert json.loads((run_dir / "ck" / "RESTARTS.json").read_text()) == {"step": 25, "count": 1}
        assert not run.leftovers
    assert_each_sample_once_per_epoch(tmp_path / "none")
