"""Signals at the moments nobody chose, on one process running ddp_training.py: during the
final evaluation, twice within a few milliseconds, and twice seconds apart; and in one process, a
request that stops an evaluation at its next batch."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from framework.resilience.preemption import DUPLICATE_WINDOW_S
from tests.tiny import tiny as tiny_config
from tests.dist_helper import ROOT, cli_args, worker_env

# A long final evaluation (about 2 s here): 2,000 validation sequences of 128 tokens.
SLOW_EVAL = {"vocab_size": 64, "hidden_size": 128, "num_layers": 2, "num_heads": 2, "seq_len": 128,
             "dataset_size": 20000, "batch_size": 16, "eval.steps": 125, "eval.interval": 0, "train.max_steps": 8,
             "dropout": 0.0, "num_workers": 0, "logging.tensorboard": False, "target_loss": 0.0, "log_interval": 1}


def start(run_dir: Path, overrides: dict | None = None, /, **compact) -> subprocess.Popen:
    cfg = {**SLOW_EVAL, "logging.dir": str(run_dir / "logs"), "checkpoint.dir": str(run_dir / "ck"),
           **(overrides or {}), **compact}
    return subprocess.Popen([sys.executable, str(ROOT / "ddp_training.py"), *cli_args(cfg)], cwd=ROOT, env=worker_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_log(run_dir: Path, needle: str, timeout: float = 60) -> None:
    log_file = run_dir / "logs" / "rank_0.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log_file.exists() and needle in log_file.read_text():
            return
        time.sleep(0.005)
    raise AssertionError(f"{needle!r} never appeared in {log_file}")


@pytest.mark.dist
def test_sigterm_after_the_last_step_leaves_the_evaluation_to_the_resumed_run(tmp_path):
    """Before the final evaluation the ranks agree on a late request: the final step is saved,
    PREEMPTED written, and the resumed run only evaluates."""
    proc = start(tmp_path, {"recovery.step_timeout_s": 0})
    wait_for_log(tmp_path, "step 8/8")
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    if summary["preempted"]:  # the signal came before the agreement (otherwise: during the evaluation)
        assert (tmp_path / "ck" / "PREEMPTED").read_text() == "preempted at step 8"
        assert not (tmp_path / "ck" / "final_model.pt").exists()
    resumed = start(tmp_path)
    output, _ = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, output[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["final_val_loss"] is not None
    assert (tmp_path / "ck" / "final_model.pt").is_file()


# A SIGTERM during the final evaluation, through the launcher: tests/integration/test_launch.py's
# test_sigterm_during_the_final_evaluation_preempts_it_and_the_relaunch_finishes.


@pytest.mark.dist
def test_two_signals_milliseconds_apart_are_one_request(tmp_path):
    proc = start(tmp_path, {"train.max_steps": 100000, "eval.steps": 2})
    wait_for_log(tmp_path, "step 3/")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    marker = (tmp_path / "ck" / "PREEMPTED").read_text()
    step = int(marker.split()[-1])
    assert json.loads((tmp_path / "ck" / "manifest.json").read_text())[-1]["step"] == step
    assert "received SIGTERM again within" in (tmp_path / "logs" / "rank_0.log").read_text()


@pytest.mark.dist
def test_a_second_signal_after_the_window_exits_at_once(tmp_path):
    # Step 4 takes about 8 s (fault_inject slow): the first request waits for its end, the second does not.
    proc = start(tmp_path, {"train.max_steps": 100, "recovery.fault_inject": "slow@step=3,ms=8000"})
    wait_for_log(tmp_path, "step 3/")
    proc.send_signal(signal.SIGUSR1)
    wait_for_log(tmp_path, "received SIGUSR1")
    time.sleep(DUPLICATE_WINDOW_S + 0.2)
    assert proc.poll() is None, "the step ended before the second signal; make it longer"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    # Died of the signal, in the step, which would otherwise have ended in a save and exit 0.
    assert proc.returncode == -signal.SIGTERM
    assert not (tmp_path / "ck" / "PREEMPTED").exists()


@pytest.mark.dist
def test_evaluation_and_saves_run_under_deadlines_of_their_own(tmp_path):
    """A 1 s step deadline (steps take ~40 ms) and an evaluation of ~2 s in the middle of the run:
    the watchdog gives the evaluation its own deadline instead of killing a healthy run."""
    proc = start(tmp_path, {"recovery.step_timeout_s": 1.0, "eval.interval": 4, "checkpoint.every_steps": 4})
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    log0 = (tmp_path / "logs" / "rank_0.log").read_text()
    assert "step 4 | val_loss" in log0 and "Timeout" not in log0


# In one process: 32 validation batches of 8 (eval_steps=0: the whole split of 256 sequences).
EVAL = tiny_config(None, {"eval.steps": 0, "eval.interval": 0, "train.max_steps": 8, "train.deterministic": True},
                   dataset_size=2560, log_interval=1)


def in_process(run_dir: Path, overrides: dict | None = None, /, **compact) -> dict:
    return {**EVAL, "logging.dir": str(run_dir / "logs"), "checkpoint.dir": str(run_dir / "ck"), **(overrides or {}),
            **compact}


def sigterm_in_evaluation(monkeypatch, at_step: int, at_batch: int) -> list[int]:
    """SIGTERM to this process during the ``at_batch``-th batch of the evaluation at ``at_step``;
    returns the steps of the evaluation batches that ran, one entry per batch."""
    from framework.train import evaluation
    batches, real, trainer_step = [], evaluation.batch_loss, []

    def counting(model, batch, loss_fn):
        batches.append(trainer_step[-1])
        if batches.count(at_step) == at_batch:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(model, batch, loss_fn)

    real_run = evaluation.Evaluator.run

    def run(self, step, *args, **kwargs):
        trainer_step.append(step)
        return real_run(self, step, *args, **kwargs)

    monkeypatch.setattr(evaluation, "batch_loss", counting)
    monkeypatch.setattr(evaluation.Evaluator, "run", run)
    return batches


@pytest.mark.slow
def test_sigterm_in_the_final_evaluation_stops_it_at_the_next_batch_saves_and_the_resume_evaluates(
        tmp_path, monkeypatch):
    from framework import DDPTrainer
    whole = DDPTrainer(in_process(tmp_path / "whole")).train()
    batches = sigterm_in_evaluation(monkeypatch, at_step=8, at_batch=3)
    first = DDPTrainer(in_process(tmp_path)).train()
    assert batches.count(8) == 3  # of 32
    assert first["preempted"] and first["steps"] == 8 and first["final_val_loss"] is None
    assert (tmp_path / "ck" / "PREEMPTED").read_text() == "preempted at step 8"
    assert json.loads((tmp_path / "ck" / "manifest.json").read_text())[-1]["step"] == 8
    assert not (tmp_path / "ck" / "final_model.pt").exists()
    monkeypatch.undo()
    second = DDPTrainer(in_process(tmp_path)).train()
    assert not second["preempted"] and second["steps"] == 8 and (tmp_path / "ck" / "final_model.pt").is_file()
    assert second["model_sha256"] == first["model_sha256"] == whole["model_sha256"]
    assert second["final_val_loss"] == whole["final_val_loss"]


@pytest.mark.slow
def test_sigterm_in_a_mid_run_evaluation_stops_it_saves_and_the_resume_evaluates_that_step_first(
        tmp_path, monkeypatch):
    from framework import DDPTrainer
    from framework.observability.metrics import read_metrics
    cfg = {"eval.interval": 4, "train.max_steps": 12, "checkpoint.every_steps": 4}
    whole = DDPTrainer(in_process(tmp_path / "whole", **cfg)).train()
    batches = sigterm_in_evaluation(monkeypatch, at_step=8, at_batch=2)
    first = DDPTrainer(in_process(tmp_path, **cfg)).train()
    assert batches.count(4) == 32 and batches.count(8) == 2 and 12 not in batches
    assert first["preempted"] and first["steps"] == 8
    assert (tmp_path / "ck" / "PREEMPTED").read_text() == "preempted at step 8"
    monkeypatch.undo()
    second = DDPTrainer(in_process(tmp_path, **cfg)).train()
    assert second["steps"] == 12 and second["model_sha256"] == whole["model_sha256"]
    rows, expected = read_metrics(tmp_path / "logs" / "metrics.jsonl"), read_metrics(tmp_path / "whole" / "logs" /
                                                                                      "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert [(r["step"], r["val/loss"]) for r in rows if "val/loss" in r] == [
        (r["step"], r["val/loss"]) for r in expected if "val/loss" in r] and len(expected) == 12


def test_the_mid_run_preemption_save_runs_under_a_watchdog_phase_of_its_own(tmp_path, monkeypatch):
    from framework import DDPTrainer
    from framework.resilience.watchdog import Watchdog
    phases, real = [], Watchdog.phase

    def spy(self, name, *args, **kwargs):
        phases.append(name)
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(Watchdog, "phase", spy)
    summary = DDPTrainer(in_process(tmp_path, {"recovery.fault_inject": "sigterm@step=3",
                                               "recovery.step_timeout_s": 30})).train()
    assert summary["preempted"] and summary["steps"] == 4
    assert phases == ["preemption save"]


@pytest.mark.dist
def test_on_two_ranks_a_request_on_one_stops_the_evaluation_on_both_and_the_relaunch_evaluates(tmp_path):
    import re

    from tests.dist_helper import launch_cases
    cases = {rank: result["cases"] for rank, result in launch_cases("tests/workers/preemption.py", tmp_path).items()}
    for rank in (0, 1):
        assert all("error" not in case for case in cases[rank].values()), cases[rank]
        whole = cases[rank]["whole"]
        for run, step in (("final", 8), ("mid", 4)):
            first, relaunch = cases[rank][run], cases[rank][f"{run}_relaunch"]
            # Rank 1 was asked at the evaluation's start; both ranks agreed before its first batch.
            assert f"evaluation at step {step} stopped before batch 1 of 5" in first["log"]
            assert f"preempted: checkpoint of step {step} saved" in first["log"]
            assert first["summary"]["preempted"] and first["summary"]["steps"] == step
            assert relaunch["summary"]["steps"] == 8 and not relaunch["summary"]["preempted"]
            assert relaunch["summary"]["model_sha256"] == whole["summary"]["model_sha256"]
            assert relaunch["summary"]["final_val_loss"] == whole["summary"]["final_val_loss"]
        # The relaunch of "mid" evaluates step 4 first, and gets the uninterrupted run's loss.
        val_4 = re.search(r"step 4 \| val_loss \S+", whole["log"]).group(0)
        assert val_4 in cases[rank]["mid_relaunch"]["log"].split("resumed from step 4")[1]


# The agent: starts the worker (its child) from its main thread, prints the worker's pid, and on a
# line on stdin ends its main thread alone (its other thread lives on). The worker arms the death
# signal as ddp_training.py does, installs the handler as DDPTrainer does and then, before its first
# step (``started`` False) or in training (True), waits for a request, then goes on.
ORPHAN_AGENT = """
import ctypes, subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stderr=open(sys.argv[2], "w"))
print(worker.pid, flush=True)
sys.stdin.readline()
ctypes.CDLL(None).pthread_exit(None)
"""
ORPHAN_WORKER = """
import logging, os, sys, time
parent = os.getppid()
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from framework.ddp.process_group import die_with_parent
from framework.resilience.preemption import PreemptionHandler
die_with_parent(parent)
handler = PreemptionHandler().install()
handler.started = {started}
print("ready", file=sys.stderr, flush=True)
deadline = time.monotonic() + 60
while handler.requested is None and time.monotonic() < deadline:
    time.sleep(0.05)
print("requested", handler.requested, file=sys.stderr, flush=True)
time.sleep(30)  # the rest of a start-up: the first step boundary, where the request is read, is this far off
"""


@pytest.mark.parametrize("started,end", [(False, "kill"), (False, "main_thread"), (True, "kill")])
def test_a_worker_orphaned_before_its_first_step_ends_at_once_and_in_training_saves_first(tmp_path, started, end):
    """kill -9 of the torchrun agent: the death signal, SIGTERM, ends a worker that has not begun
    training (nothing to save; the explorer's kill9_agent@startup found both workers still starting
    up 10 s later); a worker in training takes it as a preemption request (save, then exit).
    ``main_thread``: the kernel sends the signal as the agent's main thread exits, and while its other
    threads are still exiting the worker's parent is one of them: getppid() still gives the agent's pid."""
    import psutil

    from harness.launch import wait_gone
    log = tmp_path / "worker.log"
    agent = subprocess.Popen([sys.executable, "-c", ORPHAN_AGENT, ORPHAN_WORKER.format(started=started), str(log)],
                             cwd=ROOT, env=worker_env({"TORCHELASTIC_RUN_ID": "test"}), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    worker = int(agent.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while "ready" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        if end == "kill":
            agent.kill()
            agent.wait()
        else:
            agent.stdin.write("end\n")
            agent.stdin.flush()
        if started:
            deadline = time.monotonic() + 30
            while "requested" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert f"requested {int(signal.SIGTERM)}" in log.read_text(), log.read_text()
        else:
            assert wait_gone([worker], timeout=5) == [], log.read_text()
            assert "the torchrun agent is gone and training has not begun" in log.read_text()
            assert "requested" not in log.read_text()
    finally:
        agent.kill()
        agent.wait()
        try:
            psutil.Process(worker).kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.parametrize("when", ["finished", "preempted"])
def test_a_run_whose_agent_died_saves_and_raises_peer_lost_exit_75_never_0(tmp_path, monkeypatch, when):
    """The agent's death is agreed after the last save (one all-reduce): the run ends with
    PeerLost (SystemExit 75) instead of returning, so that no surviving torchrun agent waits 300 s
    in its exit barrier for the dead one. Before, train() returned and the process exited 0."""
    from framework import DDPTrainer
    from framework.ddp import process_group

    monkeypatch.setattr(process_group, "agent_gone", lambda: True)
    extra = {"recovery.fault_inject": "sigterm@step=2"} if when == "preempted" else {}
    trainer = DDPTrainer(tiny_config(tmp_path, {"train.max_steps": 4}, **extra))
    with pytest.raises(process_group.PeerLost) as raised:
        trainer.train()
    assert raised.value.code == process_group.EXIT_PEER_LOST == 75
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["agent_lost"] and summary["preempted"] == (when == "preempted")
    assert summary["steps"] == (3 if when == "preempted" else 4)
    assert ("the run saved a checkpoint of step 3" if when == "preempted" else "the run finished at step 4") in str(
        raised.value)
    assert (tmp_path / "ck" / "manifest.json").read_text().count(f"step_0000000{summary['steps']}.pt") == 1
    assert "a torchrun agent died" in (tmp_path / "ck" / "NODE_LOST").read_text()  # launch_training.sh exits 75
