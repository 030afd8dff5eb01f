"""recovery.heal=in_place: three replicas train; one is killed -9 mid-run; the two survivors form the
next generation in their processes and finish the run from the state they hold: no process
restarts, no checkpoint is read, the final weights are the uninterrupted run's to fp32 noise, and
every sample is trained once per epoch. One batch of runs: the uninterrupted run, a kill of rank 1,
a kill of rank 0 (the checkpoint writer: a survivor takes over its lock and lineage)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch.distributed as dist

from framework.ddp.membership import process_state
from tests.dist_helper import OTHER_HOST, final_weights, other_host_allowed, samples_per_epoch, weight_diff
from tests.tiny import tiny

ROOT = Path(__file__).resolve().parents[2]
REPLICAS = 3
STEPS = 12


def heal_run(run_dir: Path, fault: str = "", *, steps: int = STEPS, spares: int = 0, changes: dict | None = None,
             other_host: int | None = None, again: int | None = None, launch: str = "",
             during: Callable[[list, Callable], None] | None = None) -> dict:
    """Three ddp_training.py processes on a run store of the test's, as launch_training.sh starts
    them (without torchrun), the last ``spares`` of them spares, the configuration with ``changes``;
    returns their exit codes and the time the run took. Replica ``other_host`` runs under a host
    name of its own (a UTS namespace: ``unshare --uts``): the others cannot kill it, as on another
    host. A replica still stopped when the others have ended is continued (SIGCONT). Replica
    ``again``, once killed -9, is started again, once (as its torchrun would with --max-restarts 1).
    ``launch``: their HEAL_LAUNCH. ``during(procs, start)`` runs every 0.1 s: it may start a
    replica's process (``start(replica, env)``), and put it in ``procs``."""
    run_dir.mkdir(parents=True)
    config = tiny(run_dir, {"train.max_steps": steps, "recovery.heal": "in_place", "recovery.fault_inject": fault,
                            "logging.record_samples": True, "checkpoint.every_steps": 4, "data.batch_size": 4,
                            "data.global_batch_size": 24, **(changes or {})})
    (run_dir / "config.json").write_text(json.dumps(config))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("HEAL_", "TORCHELASTIC_"))},
           "OMP_NUM_THREADS": "1", "HEAL_STORE": f"127.0.0.1:{store.port}", "HEAL_REPLICAS": str(REPLICAS),
           "HEAL_SPARES": str(spares), **({"HEAL_LAUNCH": launch} if launch else {})}
    started = time.monotonic()
    others: list[subprocess.Popen] = []  # processes that ``during`` replaced in ``procs``

    def start(replica: int, extra: dict | None = None) -> subprocess.Popen:
        command = [sys.executable, str(ROOT / "ddp_training.py"), "--config", str(run_dir / "config.json")]
        if replica == other_host:  # exec: the pid is the trainer's
            command = [*OTHER_HOST, *command]
        with open(run_dir / f"out_{replica}.txt", "ab") as out:
            process = subprocess.Popen(command, env={**env, "HEAL_REPLICA": str(replica), **(extra or {})}, stdout=out,
                                       stderr=subprocess.STDOUT, cwd=ROOT)
        others.append(process)
        return process

    procs = [start(r) for r in range(REPLICAS)]
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            running = [p for p in procs if p.poll() is None]
            if not running:
                break
            if len(running) == 1 and process_state(running[0].pid) == "T":
                os.kill(running[0].pid, signal.SIGCONT)  # the others are done: it may go on
            if again is not None and procs[again].poll() == -signal.SIGKILL:
                procs[again], again = start(again), None
            if during is not None:
                during(procs, start)
            time.sleep(0.1)
        codes = [p.wait(timeout=30) for p in procs]
    finally:
        for p in others:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)  # a stopped process dies of SIGKILL too; continued, it says so
            p.kill()
            p.wait()
    # What a replica that failed printed last (its traceback), for the assertion's message.
    tails = {r: (run_dir / f"out_{r}.txt").read_text(errors="replace")[-2000:] for r, c in enumerate(codes)
             if c not in (0, -9)}
    return {"codes": codes, "s": time.monotonic() - started, **({"tails": tails} if tails else {})}


def one_process(run_dir: Path, steps: int, changes: dict) -> Path:
    """The uninterrupted reference in this process: 1 rank, the same global batch (the weights of
    any world size differ by fp32 summation order only), its samples recorded."""
    from framework import DDPTrainer
    DDPTrainer(tiny(run_dir, {"train.max_steps": steps, "logging.record_samples": True, "checkpoint.every_steps": 4,
                              "data.batch_size": 4, **changes}), rank=0, world_size=1).train()
    return run_dir


def launch_heal(like: Path, run_dir: Path, changes: dict) -> subprocess.CompletedProcess:
    """launch_training.sh --heal --max-restarts 1 on 3 CPU processes, with the configuration of the
    run in ``like`` and ``changes``, its logs and checkpoints in ``run_dir``."""
    run_dir.mkdir()
    config = {**json.loads((like / "config.json").read_text()), "logging.dir": str(run_dir / "logs"),
              "checkpoint.dir": str(run_dir / "ck"), **changes}
    (run_dir / "config.json").write_text(json.dumps(config))
    return subprocess.run([str(ROOT / "launch_training.sh"), "--cpu", "--nproc", str(REPLICAS), "--heal",
                           "--max-restarts", "1", "--", "--config", str(run_dir / "config.json")],
                          capture_output=True, text=True, timeout=300, cwd=run_dir.parent,
                          env={k: v for k, v in os.environ.items() if not k.startswith("HEAL_")})


def left_running(run_dir: Path) -> str:
    """The processes of the run in ``run_dir`` still running (its config.json on their command line)."""
    return subprocess.run(["pgrep", "-f", str(run_dir / "config.json")], capture_output=True, text=True).stdout


def logs(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("rank_*.log")))


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The uninterrupted run of STEPS steps on 3 replicas, healing in place: the reference."""
    run_dir = tmp_path_factory.mktemp("heal") / "whole"
    assert heal_run(run_dir)["codes"] == [0] * REPLICAS
    return run_dir


@pytest.mark.dist
def test_survivors_of_a_kill_9_heal_in_place_and_finish_the_run_unchanged(tmp_path, whole):
    reference, expected = final_weights(whole), samples_per_epoch(whole)
    assert sum(expected.values()) == STEPS * 24 and set(expected.values()) == {1}

    for killed in (1, 0):
        run_dir = tmp_path / f"kill{killed}"
        run = heal_run(run_dir, f"sigkill@step=5,rank={killed}")
        assert run["codes"][killed] == -9 and [c for r, c in enumerate(run["codes"]) if r != killed] == [0, 0], run
        text = logs(run_dir)
        # Each survivor went on in its own process from the state it held: no checkpoint read.
        assert text.count("healed in place at step 5 (epoch 1, sample 0 of the epoch)") == 2, text[-3000:]
        assert "resumed from" not in text
        assert text.count("generation 2 goes on with 2 of 3 ranks") == 2
        summary = json.loads((run_dir / "logs" / "summary.json").read_text())
        assert (summary["steps"], summary["world_size"], summary["restarts"]) == (STEPS, 2, 0)
        weights = final_weights(run_dir)
        diff = max((weights[k].float() - reference[k].float()).abs().max().item() for k in reference)
        assert diff < 1e-5, diff  # measured 1.05e-6: only the summation order differs
        assert samples_per_epoch(run_dir) == expected  # each sample once per epoch, as uninterrupted
        manifest = json.loads((run_dir / "ck" / "manifest.json").read_text())
        # Rank 0 writes step 4's checkpoint in the background: killed at step 5's start, it may die
        # before that write lands (seen once under load); the new rank 0 writes 8 and 12 in its lineage.
        steps = [e["step"] for e in manifest]
        assert steps == [4, 8, 12] or (killed == 0 and steps == [8, 12]), steps
        assert len({e["lineage"] for e in manifest}) == 1

    # With a spare: replicas 0 and 1 train, 2 waits with its model and data built; when rank 1 is
    # killed, the spare steps in at once and the group keeps its size.
    run_dir = tmp_path / "spare"
    run = heal_run(run_dir, "sigkill@step=5,rank=1", spares=1)
    assert run["codes"] == [0, -9, 0], run
    text = logs(run_dir)
    assert text.count("generation 2 goes on with 2 of 2 ranks") == 1 and "joined the run in place at step 5" in text
    assert json.loads((run_dir / "logs" / "summary.json").read_text())["world_size"] == 2
    weights = final_weights(run_dir)
    assert max((weights[k].float() - reference[k].float()).abs().max().item() for k in reference) < 1e-5
    assert samples_per_epoch(run_dir) == expected


@pytest.mark.dist
def test_a_frozen_rank_is_killed_by_its_watcher_and_the_others_heal_in_place(tmp_path, whole):
    """SIGSTOP of rank 0 at step 5's start: it sends no reset, so the others wait for it in step 5's
    collectives. Its watcher (rank 2's peer monitor) names it after recovery.peer_timeout_s and,
    on the same host, kills it: its connections close, the collective fails, and ranks 1 and 2 heal
    in place as after a kill -9 (the new rank 0 takes over checkpoint_dir's lock, which the kill
    freed), instead of every rank restarting from the checkpoint. With the monitor off (rank 1
    stopped), the collective's own timeout (ddp.timeout_s) ends the wait: the member found stopped
    is killed, and they heal in place all the same (an explorer trial of this hung, its stopped
    worker left waiting for good)."""
    reference, expected = final_weights(whole), samples_per_epoch(whole)
    for monitor, stopped, changes in (("on", 0, {"recovery.peer_timeout_s": 2}),
                                      # 8 s: a collective that times out before the stop (a stall under
                                      # load: 3 s did, 2 runs in 4 on a loaded 2-core box) is an error
                                      # of its own, not the frozen member's loss
                                      ("off", 1, {"recovery.peer_timeout_s": 0, "ddp.timeout_s": 8})):
        run_dir = tmp_path / f"monitor-{monitor}"
        run = heal_run(run_dir, f"sigstop@step=5,rank={stopped}", changes=changes)
        assert run["codes"][stopped] == -9 and [c for r, c in enumerate(run["codes"]) if r != stopped] == [0, 0], run
        text = logs(run_dir)
        named = (f"rank {stopped} went silent: no heartbeat for" in text
                 and "killed, so that the group heals in place" in text)
        assert named == (monitor == "on"), text[-3000:]
        assert monitor == "on" or f"replica {stopped} is stopped (pid" in text, text[-3000:]
        assert text.count("healed in place at step 5 (epoch 1, sample 0 of the epoch)") == 2, text[-3000:]
        assert "resumed from" not in text
        summary = json.loads((run_dir / "logs" / "summary.json").read_text())
        assert (summary["steps"], summary["world_size"], summary["restarts"]) == (STEPS, 2, 0)
        weights = final_weights(run_dir)
        assert max((weights[k].float() - reference[k].float()).abs().max().item() for k in reference) < 1e-5
        assert samples_per_epoch(run_dir) == expected


@pytest.mark.dist
def test_a_rank_frozen_on_another_host_is_named_lost_and_the_others_heal_in_place(tmp_path, whole):
    """Replica 2 runs under a host name of its own, so that nobody can kill it (as on another host),
    and is stopped (SIGSTOP) at step 5's start: it sends no reset. Its watcher, rank 1, names it
    after recovery.peer_timeout_s and announces it; every survivor names it lost in its breaker, so
    that step 5's collectives with it end at once instead of after ddp.timeout_s, and ranks 0 and 1
    heal in place without it, from the state they hold. Continued once they are done, it reads that
    it was named lost and exits by itself."""
    if not other_host_allowed():
        pytest.skip("another host name needs a UTS namespace (unshare --uts, as root): refused here")
    run_dir = tmp_path / "frozen-elsewhere"
    run = heal_run(run_dir, "sigstop@step=5,rank=2", changes={"recovery.peer_timeout_s": 2, "ddp.timeout_s": 300},
                   other_host=2)
    assert run["codes"][:2] == [0, 0] and run["codes"][2] == 75, run
    text = logs(run_dir)
    assert "rank 2 went silent: no heartbeat for" in text and "on another host: named lost" in text, text[-3000:]
    assert "named lost by a peer; this rank gives up the step's collectives with rank(s) [2]" in text, text[-3000:]
    assert "killed" not in text and "resumed from" not in text, text[-3000:]
    assert text.count("healed in place at step 5 (epoch 1, sample 0 of the epoch)") == 2, text[-3000:]
    assert run["s"] < 120, run  # not ddp.timeout_s (300 s)
    # Its monitor reads the announcement, or its main thread the generation it was left out of.
    said = (run_dir / "out_2.txt").read_text()
    assert re.search(r"this rank was named lost by its peers|was left out of generation 2 \(\[0, 1\]\): its peers "
                     r"named it lost", said), said[-2000:]
    summary = json.loads((run_dir / "logs" / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"], summary["restarts"]) == (STEPS, 2, 0)
    assert weight_diff(whole, run_dir) < 1e-5
    assert samples_per_epoch(run_dir) == samples_per_epoch(whole)
    assert left_running(run_dir) == ""

    # Rank 0 frozen there: its process still holds checkpoint.dir's lock, which the new rank 0
    # cannot take, so the generation could not save. Every rank ends with 75, the new rank 0 saying
    # why (before, it exited 2, "in use by another run", as if another run held checkpoint.dir).
    run_dir = tmp_path / "writer-frozen-elsewhere"
    run = heal_run(run_dir, "sigstop@step=5,rank=0", changes={"recovery.peer_timeout_s": 2, "ddp.timeout_s": 300},
                   other_host=0)
    assert run["codes"] == [75, 75, 75] and run["s"] < 120, run
    said = (run_dir / "out_1.txt").read_text()
    assert "error: rank 0 was lost, and its process still holds checkpoint.dir's lock" in said, said[-2000:]


@pytest.mark.dist
def test_a_frozen_node_launched_again_keeps_its_replica_when_the_old_process_thaws_and_restarts(tmp_path):
    """Replica 2, under a host name of its own (as on another host), is stopped at step 5; ranks 0
    and 1 name it lost and heal in place. Its node is launched again (another HEAL_LAUNCH) while
    the old process still lives: the new process joins and the group grows back to 3. Then the old
    one is continued (it reads that it was named lost, and exits), and its old torchrun starts it
    again (HEAL_LAUNCH of the first launch, TORCHELASTIC_RESTART_COUNT=1): that process finds a
    newer launch holding its replica and ends with 0 at once, taking part in nothing; the run
    finishes on 3 ranks, unchanged. Before, it took the replica back (``where/``) and waited to
    join until the run's end, and the new process counted as gone for the others."""
    if not other_host_allowed():
        pytest.skip("another host name needs a UTS namespace (unshare --uts, as root): refused here")
    steps = 45
    one_process(tmp_path / "whole", steps, {"data.global_batch_size": 24})
    run_dir = tmp_path / "thaw"
    seen: dict = {}

    def during(procs: list, start) -> None:
        said = "".join((run_dir / f"out_{r}.txt").read_text(errors="replace") for r in range(REPLICAS))
        if "old" not in seen and "generation 2 goes on with 2 of 3 ranks" in said:
            seen["old"], procs[2] = procs[2], start(2, {"HEAL_LAUNCH": "second"})  # the node launched again
        elif "old" in seen and "thawed" not in seen and "trains on 3 ranks (was 2" in said:
            os.kill(seen["old"].pid, signal.SIGCONT)
            seen["thawed"] = seen["old"].pid
        elif "thawed" in seen and "restarted" not in seen and seen["old"].poll() is not None:
            seen["restarted"] = start(2, {"HEAL_LAUNCH": "first", "TORCHELASTIC_RESTART_COUNT": "1"})
            seen["restarted_at"] = time.monotonic()
        elif "restarted" in seen and "restarted_s" not in seen and seen["restarted"].poll() is not None:
            seen["restarted_s"] = time.monotonic() - seen["restarted_at"]

    run = heal_run(run_dir, "sigstop@step=5,rank=2; slow@step=6,ms=300,restart=*", steps=steps, other_host=2,
                   launch="first", during=during, changes={"recovery.peer_timeout_s": 2, "ddp.timeout_s": 300})
    assert run["codes"] == [0, 0, 0], run
    said = (run_dir / "out_2.txt").read_text()
    assert "restarted_s" in seen and seen["restarted"].returncode == 0, (seen, said[-3000:])
    assert "replica 2: this process of launch first was started again by its torchrun, and a newer launch of its " \
        "node (second) holds the replica: it ends" in said, said[-3000:]
    assert seen["restarted_s"] < 20, seen  # its start-up, then the end: not the run's end
    text = logs(run_dir)
    assert "joined the run in place at step" in text and "resumed from" not in text, text[-3000:]
    summary = json.loads((run_dir / "logs" / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"]) == (steps, REPLICAS), summary
    assert weight_diff(tmp_path / "whole", run_dir) < 5e-5  # 3 -> 2 -> 3 ranks: the fp32 floor, as above
    assert samples_per_epoch(run_dir) == samples_per_epoch(tmp_path / "whole")
    assert left_running(run_dir) == ""


@pytest.mark.dist
def test_rank_0_killed_during_the_export_after_the_others_ended_elsewhere_exports_alone(tmp_path, whole):
    """Rank 0 is killed -9 during the export, after the other ranks ended: replica 1 on this host,
    replica 2 under a host name of its own (as on another host: its pid cannot be read, and its
    heartbeat says it left on purpose). Started again, as its torchrun would, rank 0 takes both for
    gone (replica 2 from its ``ended`` record), forms the next generation alone within seconds and
    exports from the final checkpoint: the uninterrupted run's weights. Before, it waited for
    replica 2 until its join timed out (ddp.timeout_s)."""
    if not other_host_allowed():
        pytest.skip("another host name needs a UTS namespace (unshare --uts, as root): refused here")
    run_dir = tmp_path / "export"
    run = heal_run(run_dir, f"sigkill@step={STEPS},rank=0,at=export", changes={"ddp.timeout_s": 60}, other_host=2,
                   again=0)
    assert run["codes"] == [0, 0, 0] and run["s"] < 60, run
    said = (run_dir / "out_0.txt").read_text()
    assert f"sigkill at step {STEPS} on rank 0 (before the export)" in said, said[-3000:]
    assert "no member of the run was left: generation 2 (replicas [0]) resumes from the checkpoint" in said, \
        said[-3000:]
    assert f"resumed from step {STEPS} " in said, said[-3000:]
    reference, weights = final_weights(whole), final_weights(run_dir)
    assert max((weights[k].float() - reference[k].float()).abs().max().item() for k in reference) == 0
    assert left_running(run_dir) == ""


@pytest.mark.dist
def test_under_the_launcher_a_killed_rank_restarted_by_its_torchrun_rejoins_and_the_run_is_unchanged(tmp_path):
    """launch_training.sh --heal --max-restarts 1: one torchrun job per rank and the run's store. Rank
    1 is killed at step 5; the survivors heal to 2 ranks at once; its torchrun starts it again, it
    asks to join, and the group grows back to 3 at the end of a step, the newcomer taking rank 0's
    state by broadcast, not from disk. Every forward from step 6 on is slowed by 300 ms, so that the
    run outlasts the newcomer's start (about 5 s here). Nothing is left running."""
    steps, slow = 45, "slow@step=6,ms=300,restart=*"
    # The reference: one process, in this one, with the same global batch (the weights of any world
    # size differ by fp32 summation order only); the launch takes heal_run's configuration.
    whole = one_process(tmp_path / "whole", steps, {"data.global_batch_size": 24})
    (whole / "config.json").write_text(json.dumps(tiny(whole, {
        "train.max_steps": steps, "recovery.heal": "in_place", "logging.record_samples": True,
        "checkpoint.every_steps": 4, "data.batch_size": 4, "data.global_batch_size": 24})))
    run_dir = tmp_path / "rejoin"
    launched = launch_heal(tmp_path / "whole", run_dir, {"recovery.fault_inject": f"sigkill@step=5,rank=1; {slow}"})
    assert launched.returncode == 0, launched.stderr[-3000:]
    text = logs(run_dir)
    assert text.count("generation 2 goes on with 2 of 3 ranks") == 2, text[-3000:]
    assert text.count("grew in place after step") == 2, text[-3000:]  # both members paused for the join
    assert "joined the run in place at step" in text and "resumed from" not in text
    summary = json.loads((run_dir / "logs" / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"]) == (steps, REPLICAS)
    diff = weight_diff(tmp_path / "whole", run_dir)
    # Measured 2.0e-5 from the 1-process run (1.4e-5 from the uninterrupted 3-process run, which is
    # itself 1.9e-5 from a 2-process one after these 45 AdamW steps: fp32 summation order alone);
    # the bound leaves 2.5x. A step lost or trained twice moves the weights by about 1e-3.
    assert diff < 5e-5, diff
    assert samples_per_epoch(run_dir) == samples_per_epoch(tmp_path / "whole")
    assert left_running(run_dir) == ""


@pytest.mark.dist
def test_a_worker_left_stopped_once_the_run_finished_is_killed_and_the_launcher_ends(tmp_path):
    """launch_training.sh --heal --nproc 3 --spares 1: the spare is stopped (SIGSTOP) while it waits
    to join. The run finishes without it, and nothing of the run would ever continue it: its
    torchrun job, and so the launcher, waited for it for good (an explorer trial: rank 0 stopped on
    node 0 during an evaluation, node 1 finishing alone). The launcher kills a worker of its node
    still stopped HEAL_STOPPED_GRACE_S (2 s here) after the final model was written, says so, and
    exits 0."""
    import psutil

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(tiny(run_dir, {
        "train.max_steps": 12, "recovery.heal": "in_place", "data.batch_size": 4, "data.global_batch_size": 8})))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HEAL_")}, "HEAL_STOPPED_GRACE_S": "2"}
    launcher = subprocess.Popen([str(ROOT / "launch_training.sh"), "--cpu", "--nproc", "3", "--spares", "1", "--heal",
                                 "--", "--config", str(run_dir / "config.json")], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spare, deadline = None, time.monotonic() + 60
    try:
        while spare is None and time.monotonic() < deadline and launcher.poll() is None:
            for proc in psutil.Process(launcher.pid).children(recursive=True):
                try:
                    env = proc.environ()  # the worker, not its torchrun agent (which has no restart count)
                    if env.get("HEAL_REPLICA") == "2" and "TORCHELASTIC_RESTART_COUNT" in env:
                        spare = proc
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            time.sleep(0.02)
        assert spare is not None, "the spare's worker never started"
        spare.suspend()
        _, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            for proc in psutil.Process(launcher.pid).children(recursive=True):
                proc.kill()
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, stderr[-3000:]
    assert f"process(es) {spare.pid} of this node stayed stopped (SIGSTOP) for 2 s: killed" in stderr, stderr[-3000:]
    assert json.loads((run_dir / "logs" / "summary.json").read_text())["steps"] == 12
    assert not spare.is_running() and left_running(run_dir) == ""


@pytest.mark.dist
def test_a_loss_outside_a_step_restarts_every_rank_from_the_checkpoint_through_the_run_store(tmp_path, whole):
    """A kill -9 of rank 1 in the evaluation after step 4 (before that step's checkpoint) is not
    healed in place: the survivors' evaluation fails, they exit 75, and every rank's torchrun starts
    it again. With no member of generation 1 left, the three form generation 2 among themselves and
    resume from the checkpoint of step 2, as recovery.heal=restart would: the run ends as the
    uninterrupted one."""
    run_dir = tmp_path / "eval"
    launched = launch_heal(whole, run_dir, {"eval.interval": 4, "checkpoint.every_steps": 2,
                                                         "recovery.fault_inject": "sigkill@step=4,rank=1,at=eval"})
    assert launched.returncode == 0, launched.stderr[-3000:]
    text = logs(run_dir)
    assert "healed in place" not in text
    assert "no member of the run was left: generation 2 (replicas [0, 1, 2]) resumes from the checkpoint" in text
    assert text.count("resumed from step 2 ") == 3, text[-3000:]
    summary = json.loads((run_dir / "logs" / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"]) == (STEPS, REPLICAS)
    reference, weights = final_weights(whole), final_weights(run_dir)
    assert max((weights[k].float() - reference[k].float()).abs().max().item() for k in reference) < 1e-5
    assert samples_per_epoch(run_dir) == samples_per_epoch(whole)


@pytest.mark.dist
def test_survivors_that_do_not_divide_the_global_batch_split_it_unevenly_and_finish_the_run_unchanged(tmp_path):
    """data.global_batch_size=27 on 3 replicas (9 samples each); rank 1 is killed at step 5 and the
    2 survivors, which 27 does not divide, heal in place with shares of 14 and 13 samples (4
    micro-batches each, every micro-batch's loss weighted by its samples) instead of restarting
    from the checkpoint: the final weights are the uninterrupted 3-rank run's to fp32 noise, and
    every sample is trained once per epoch."""
    changes = {"data.global_batch_size": 27}
    whole = one_process(tmp_path / "whole", STEPS, changes)
    run_dir = tmp_path / "kill1"
    run = heal_run(run_dir, "sigkill@step=5,rank=1", changes=changes)
    assert run["codes"] == [0, -9, 0], run
    text = logs(run_dir)
    assert text.count("generation 2 goes on with 2 of 3 ranks") == 2 and "resumed from" not in text, text[-3000:]
    assert text.count("the global batch of 27 samples splits unevenly: 2 ranks with 14 or 13 samples each "
                      "(micro-batches of up to 4 x accumulation 4") == 2, text[-3000:]
    summary = json.loads((run_dir / "logs" / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"], summary["restarts"]) == (STEPS, 2, 0)
    diff = weight_diff(whole, run_dir)
    assert diff < 1e-5, diff  # measured 4.0e-6 from the 1-process run (summation order only)
    assert samples_per_epoch(run_dir) == samples_per_epoch(whole)
    assert sum(samples_per_epoch(whole).values()) == STEPS * 27


def launch_node(run_dir: Path, node: int, endpoint: str, *, log: str) -> subprocess.Popen:
    """launch_training.sh --heal on "node" ``node`` of 2 (2 CPU processes each, on loopback): node 0
    serves the run's store on ``endpoint``'s port; the configuration is ``run_dir``'s. Node 1 runs
    under a host name of its own where allowed (a UTS namespace), so that node 0 cannot tell its
    processes' fate from their pids, as on another host."""
    command = [str(ROOT / "launch_training.sh"), "--cpu", "--nproc", "2", "--heal", "--nnodes", "2", "--node-rank",
               str(node), "--rdzv-endpoint", endpoint, "--rdzv-id", "heal2", "--",
               "--config", str(run_dir / "config.json")]
    if node == 1 and other_host_allowed():
        command = [*OTHER_HOST, *command]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HEAL_")}, "GLOO_SOCKET_IFNAME": "lo"}
    with open(run_dir / log, "wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=run_dir, env=env)


def two_nodes(run_dir: Path, steps: int, fault: str = "", rejoin: bool = False) -> list[int]:
    """A run of ``steps`` on 2 nodes x 2 processes healing in place; with ``rejoin``, node 1 is
    launched again once its first launch ended (its processes lost). Returns the launches' codes."""
    from harness.launch import free_port
    run_dir.mkdir()
    config = tiny(run_dir, {"train.max_steps": steps, "logging.record_samples": True, "checkpoint.every_steps": 4,
                            "data.batch_size": 4, "data.global_batch_size": 24, "recovery.fault_inject": fault})
    (run_dir / "config.json").write_text(json.dumps(config))
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [launch_node(run_dir, 0, endpoint, log="node0.txt"), launch_node(run_dir, 1, endpoint, log="node1.txt")]
    try:
        codes = [None, nodes[1].wait(timeout=240)]
        if rejoin:
            again = launch_node(run_dir, 1, endpoint, log="node1_again.txt")
            codes.append(again.wait(timeout=240))
        codes[0] = nodes[0].wait(timeout=240)
    finally:
        for node in nodes:
            node.kill()
    return codes


@pytest.mark.dist
def test_on_two_nodes_the_survivors_of_a_lost_node_heal_in_place_and_it_grows_back(tmp_path):
    """2 nodes x 2 processes (two launch_training.sh --heal on loopback; node 0 serves the run's
    store; node 1 under a host name of its own where allowed). Both processes of node 1 are killed
    -9 at step 5: node 0's two ranks heal in place once their heartbeats have stood still for three
    beats (3.1 s; 0.4 s where node 0 reads their pids), with no restart and no checkpoint read, and
    node 1, launched again, rejoins them at a step's end
    (every step from 6 on slowed by 300 ms, so that the run outlasts its start): the group grows
    back to 4 ranks. The final weights are the uninterrupted run's to fp32 noise, and every
    sample is trained once per epoch. Nothing is left running."""
    steps = 30
    one_process(tmp_path / "whole", steps, {"data.global_batch_size": 24})
    run_dir = tmp_path / "lost"
    codes = two_nodes(run_dir, steps, "sigkill@step=5,rank=2; sigkill@step=5,rank=3; slow@step=6,ms=300,restart=*",
                      rejoin=True)
    assert codes[0] == 0 and codes[1] != 0 and codes[2] == 0, (codes, (run_dir / "node0.txt").read_text()[-3000:])
    text = logs(run_dir)
    assert text.count("generation 2 goes on with 2 of 4 ranks") == 2, text[-3000:]
    # Node 1's two processes ask to join when each is ready: the group grows in one or two rounds.
    assert "resumed from" not in text and "generation 2 trains on 4 ranks" not in text, text[-3000:]
    assert "trains on 4 ranks (was " in text and text.count("joined the run in place at step") == 2, text[-3000:]
    summary = json.loads((run_dir / "logs" / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"], summary["restarts"]) == (steps, 4, 0)
    diff = weight_diff(tmp_path / "whole", run_dir)
    # Measured 1.07e-5 from the 1-process run (4 -> 2 -> 3 -> 4 ranks: the summation orders differ,
    # and where the group grows depends on when node 1 is up); a step lost or trained twice moves
    # them by about 1e-3.
    assert diff < 4e-5, diff
    assert samples_per_epoch(run_dir) == samples_per_epoch(tmp_path / "whole")
    assert left_running(run_dir) == ""
