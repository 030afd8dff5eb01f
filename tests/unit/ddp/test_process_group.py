"""framework/ddp/process_group.py in one process: what can be checked without a group."""

import warnings

import torch.distributed  # noqa: F401  (its deprecated reduce_op object is among the live objects)

from framework.ddp import process_group


def test_releasing_ddp_holders_looks_at_every_object_without_a_warning():
    """The scan at teardown reads each live object's type only: reading ``__class__`` of torch's
    deprecated ``reduce_op`` printed a FutureWarning at the end of every run."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert process_group.release_ddp_holders(object()) == 0


def test_a_replica_started_again_gives_up_on_an_unreachable_run_store_within_store_lost_s(monkeypatch):
    """Healing in place: a replica that its torchrun started again reached the run's store before;
    one that does not answer within ``store_lost_s`` raises RunStoreLost (its handler stops the
    replica's torchrun), where every restart waited ddp.timeout_s for it. A first launch waits the
    whole timeout (node 0 may come up after this node) and raises torch's own error."""
    import socket
    import time

    import pytest

    from framework.ddp.membership import Slot

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    slot = Slot("127.0.0.1", port, 1, 2)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    started = time.monotonic()
    with pytest.raises(process_group.RunStoreLost, match=f"the run's store at 127.0.0.1:{port} did not answer "
                                                          "within 0.5 s after replica 1 was started again"):
        process_group._run_store_client(slot, 3600, 0.5)
    assert time.monotonic() - started < 30  # not the hour
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(RuntimeError) as raised:
        process_group._run_store_client(slot, 0.5, 3600)
    assert not isinstance(raised.value, process_group.RunStoreLost)


def test_a_replica_stops_its_own_torchrun_only_when_it_would_be_started_again(monkeypatch):
    """stop_own_agent: SIGTERM to the armed agent while it lives and has restarts left; not
    without an armed agent, nor with no restart left (it ends by itself)."""
    import signal
    import subprocess

    agent = subprocess.Popen(["sleep", "60"])
    try:
        monkeypatch.setattr(process_group, "agent_gone", lambda: False)
        monkeypatch.setattr(process_group, "_armed_parent", None)
        assert not process_group.stop_own_agent()
        monkeypatch.setattr(process_group, "_armed_parent", agent.pid)
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
        assert not process_group.stop_own_agent() and agent.poll() is None
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        assert process_group.stop_own_agent()
        assert agent.wait(10) == -signal.SIGTERM
    finally:
        agent.kill()
        agent.wait()
