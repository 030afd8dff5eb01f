"""Straggler scores: the scoring, the slow@ fault, and on 2 gloo ranks a rank slowed by 40 ms a
step named with its section and host within two checks, or stopping the run with FATAL; a clean
run names nobody."""

import socket

import pytest

from framework.faults import parse
from framework.metrics import read_metrics
from framework.straggler import scores, slow_sections
from tests.dist_helper import launch_cases

# Sections: data, forward_backward, synced_backward, optimizer (ms).
FAST = [1.0, 30.0, 12.0, 3.0]


def test_scores_are_medians_over_the_fastest_rank_s():
    assert scores([FAST, [1.0, 45.0, 2.0, 3.0]]) == [[1.0, 1.0, 6.0, 1.0], [1.0, 1.5, 1.0, 1.0]]
    assert scores([[0.0] * 4, [0.0] * 4]) == [[1.0] * 4, [1.0] * 4]


def test_a_slow_rank_is_found_in_the_section_it_slows_and_noise_below_the_floor_is_not():
    assert slow_sections([FAST, [1.0, 45.0, 2.0, 3.0]], threshold=1.3, min_ms=5) == {1: "forward_backward"}
    # 3x in data, but 2 ms: under the floor. The long synced backward of rank 0 is its waiting for rank 1.
    assert slow_sections([FAST, [3.0, 33.0, 2.0, 3.0]], threshold=1.3, min_ms=5) == {}


@pytest.mark.parametrize("spec, message", [
    ("slow@step=5,rank=1", "needs ms=N"),
    ("nan@step=5,ms=3", "ms=N is for slow faults only"),
    ("slow@step=5,ms=x", "must be step=N, rank=N, restart=N|*, micro=N or ms=N"),
])
def test_slow_fault_spec_errors(spec, message):
    with pytest.raises(ValueError, match=message.replace("|", r"\|").replace("*", r"\*")):
        parse(spec)


@pytest.fixture(scope="module")
def stragglers(tmp_path_factory):
    out = tmp_path_factory.mktemp("straggler")
    return out, launch_cases("tests/workers/straggler.py", out)


def case(stragglers, name, rank=0):
    return stragglers[1][rank]["cases"][name]


def test_a_slowed_rank_is_named_with_its_section_and_host_within_two_checks(stragglers):
    out_dir, _ = stragglers
    for rank in (0, 1):
        assert "error" not in case(stragglers, "slow", rank), case(stragglers, "slow", rank).get("traceback")
        log = (out_dir / "slow" / "logs" / f"rank_{rank}.log").read_text()
        assert (f"straggler: rank 1 on host {socket.gethostname()} is" in log
                and "the fastest rank in forward_backward" in log and "up to step 15" in log), log[-3000:]
        assert "straggler: rank 0" not in log
    rows = {r["step"]: r for r in read_metrics(out_dir / "slow" / "logs" / "metrics.jsonl")}
    assert rows[15]["straggler/forward_backward/rank1"] > 1.3
    assert rows[15]["straggler/forward_backward/rank0"] == 1.0 and rows[15]["straggler/max_score"] > 1.3


def test_straggler_action_fatal_stops_every_rank_naming_the_rank(stragglers):
    for rank in (0, 1):
        assert "FatalError: straggler: rank 1 on host" in case(stragglers, "fatal", rank)["error"]
    assert "(straggler_action=fatal)" in (stragglers[0] / "fatal" / "ck" / "FATAL").read_text()


def test_a_clean_run_names_nobody(stragglers):
    assert case(stragglers, "clean")["summary"]["steps"] == 200
    for rank in (0, 1):
        assert "straggler: rank" not in (stragglers[0] / "clean" / "logs" / f"rank_{rank}.log").read_text()


def test_collectives_get_the_steady_timeout_after_the_first_step(stragglers):
    assert case(stragglers, "steady_timeout")["summary"]["steps"] == 3
    log = (stragglers[0] / "steady_timeout" / "logs" / "rank_1.log").read_text()
    assert log.count("collective timeout after the first step: 30 s (init timeout 60 s)") == 1
