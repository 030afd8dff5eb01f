"""Straggler scores: the scoring, the slow@ fault, and on 2 gloo ranks a rank slowed by 40 ms a
step named with its section and host within two checks, or stopping the run with FATAL; a clean
run names nobody."""

import socket

import pytest
import torch

from framework.resilience.faults import parse
from framework.observability.metrics import read_metrics
from framework.resilience.config import StragglerSection
from framework.ddp.process_group import DistEnv
from framework.resilience.straggler import SECTIONS, StragglerMonitor, scores, slow_sections, timed_step

WORKER = "tests/workers/straggler.py"  # the conftest two_ranks_run fixture launches it

# Sections: data, forward_backward, synced_backward, optimizer (ms).
FAST = [1.0, 30.0, 12.0, 3.0]


def test_scores_are_medians_over_the_fastest_rank_s():
    assert scores([FAST, [1.0, 45.0, 2.0, 3.0]]) == [[1.0, 1.0, 6.0, 1.0], [1.0, 1.5, 1.0, 1.0]]
    assert scores([[0.0] * 4, [0.0] * 4]) == [[1.0] * 4, [1.0] * 4]


def test_a_slow_rank_is_found_in_the_section_it_slows_and_noise_below_the_floor_is_not():
    assert slow_sections([FAST, [1.0, 45.0, 2.0, 3.0]], threshold=1.3, min_ms=5) == {1: "forward_backward"}
    # 3x in data, but 2 ms: under the floor. The long synced backward of rank 0 is its waiting for rank 1.
    assert slow_sections([FAST, [3.0, 33.0, 2.0, 3.0]], threshold=1.3, min_ms=5) == {}


def test_every_step_is_timed_on_the_cpu_and_the_last_ten_before_a_check_on_cuda():
    cpu = [s for s in range(100) if timed_step(s, 50, distributed=True, cuda=False)]
    cuda = [s for s in range(100) if timed_step(s, 50, distributed=True, cuda=True)]
    assert cpu == list(range(100))
    assert cuda == list(range(40, 50)) + list(range(90, 100))  # the steps that end at 41..50, 91..100
    assert not any(timed_step(s, 0, distributed=True, cuda=False) for s in range(100))
    assert not any(timed_step(s, 50, distributed=False, cuda=False) for s in range(100))


def test_one_process_scores_1_without_a_collective():
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend=None)
    monitor = StragglerMonitor(StragglerSection(interval=50), env=env)
    assert [s for s in range(1, 101) if monitor.should_check(s)] == [50, 100]
    monitor.check(50)  # with no process group, a collective would raise
    assert monitor.scalars() == {**{f"straggler/{s}/rank0": 1.0 for s in SECTIONS}, "straggler/max_score": 1.0}


@pytest.mark.parametrize("spec, message", [
    ("slow@step=5,rank=1", "needs ms=N"),
    ("nan@step=5,ms=3", "ms=N is for slow faults only"),
    ("slow@step=5,ms=x", "must be step=N, rank=N, restart=N|*, micro=N, ms=N or at=step|eval|save"),
])
def test_slow_fault_spec_errors(spec, message):
    with pytest.raises(ValueError, match=message.replace("|", r"\|").replace("*", r"\*")):
        parse(spec)


def case(run, name, rank=0):
    return run[1][rank]["cases"][name]


@pytest.mark.dist
def test_a_slowed_rank_is_named_with_its_section_and_host_within_two_checks(two_ranks_run):
    out_dir, _ = two_ranks_run
    for rank in (0, 1):
        assert "error" not in case(two_ranks_run, "slow", rank), case(two_ranks_run, "slow", rank).get("traceback")
        log = (out_dir / "slow" / "logs" / f"rank_{rank}.log").read_text()
        assert (f"straggler: rank 1 on host {socket.gethostname()} is" in log
                and "the fastest rank in forward_backward" in log and "up to step 15" in log), log[-3000:]
        assert "straggler: rank 0" not in log
    rows = {r["step"]: r for r in read_metrics(out_dir / "slow" / "logs" / "metrics.jsonl")}
    assert rows[15]["straggler/forward_backward/rank1"] > 1.3
    assert rows[15]["straggler/forward_backward/rank0"] == 1.0 and rows[15]["straggler/max_score"] > 1.3


@pytest.mark.dist
def test_straggler_action_fatal_stops_every_rank_naming_the_rank(two_ranks_run):
    for rank in (0, 1):
        assert "FatalError: straggler: rank 1 on host" in case(two_ranks_run, "fatal", rank)["error"]
    assert "(straggler.action=fatal)" in (two_ranks_run[0] / "fatal" / "ck" / "FATAL").read_text()


@pytest.mark.dist
def test_a_clean_run_names_nobody(two_ranks_run):
    assert case(two_ranks_run, "clean")["summary"]["steps"] == 200
    assert "step 200 straggler scores" in (two_ranks_run[0] / "clean" / "logs" / "rank_0.log").read_text()  # scored
    for rank in (0, 1):
        assert "straggler: rank" not in (two_ranks_run[0] / "clean" / "logs" / f"rank_{rank}.log").read_text()


@pytest.mark.dist
def test_a_slowed_rank_is_named_when_ddp_broadcasts_buffers_in_the_forward(two_ranks_run):
    for rank in (0, 1):
        log = (two_ranks_run[0] / "slow_buffered" / "logs" / f"rank_{rank}.log").read_text()
        assert "straggler: rank 1 on host" in log and "the fastest rank in forward_backward" in log, log[-3000:]
        assert "checks in a row, up to step 15" in log


def test_the_medians_are_gathered_from_the_rank_s_device(monkeypatch):
    """NCCL gathers only GPU tensors: the medians go to the collective on the rank's device (the
    meta device stands in for a GPU here)."""
    env = DistEnv(rank=0, local_rank=0, world_size=2, local_world_size=2, device=torch.device("meta"),
                  backend="nccl")
    devices = []

    def all_gather(gathered, mine):
        devices.append(mine.device)
        gathered[:] = [torch.tensor(row, dtype=torch.float64) for row in (FAST, [1.0, 45.0, 2.0, 3.0])]

    monkeypatch.setattr("framework.resilience.straggler.dist.all_gather", all_gather)
    monkeypatch.setattr("framework.resilience.straggler.dist.all_gather_object",
                        lambda out, host: out.__setitem__(0, "a"))
    monitor = StragglerMonitor(StragglerSection(interval=5), env=env)
    monitor.check(5)
    assert devices == [torch.device("meta")]
    assert monitor.scalars()["straggler/forward_backward/rank1"] == 1.5


@pytest.mark.dist
def test_collectives_get_the_steady_timeout_after_the_first_step(two_ranks_run):
    assert case(two_ranks_run, "steady_timeout")["summary"]["steps"] == 3
    log = (two_ranks_run[0] / "steady_timeout" / "logs" / "rank_1.log").read_text()
    assert log.count("collective timeout after the first step: 30 s (init timeout 60 s)") == 1
