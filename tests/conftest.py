import logging
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# What makes a test multi-process: a command line naming one of these. `ddp_training.py
# --check-config` stops before any training and stays in the fast subset.
DIST_COMMANDS = ("torch.distributed.run", "torchrun", "launch_training.sh", "ddp_training.py")
_running: list = [None]  # the test item now running, None between tests
NOT_DIST = "PYTEST_NOT_DIST"  # names a running test not marked dist, for its child processes too


class NotMarkedDist(RuntimeError):
    """A test that starts torchrun, the launcher or a training run lacks @pytest.mark.dist."""


def dist_command(args) -> str | None:
    """The multi-process command in ``args`` (a Popen argument), or None."""
    parts = [args] if isinstance(args, str | bytes | Path) else list(args)
    words = [p.decode() if isinstance(p, bytes) else str(p) for p in parts]
    if any("--check-config" in w for w in words):
        return None
    return next((name for w in words for name in DIST_COMMANDS if name in w), None)


def _guard(event: str, args: tuple) -> None:
    item = _running[0]
    if event != "subprocess.Popen" or item is None or item.get_closest_marker("dist"):
        return
    found = dist_command(args[1])
    if found:
        raise NotMarkedDist(f"{item.nodeid} starts {found} but is not marked @pytest.mark.dist")


sys.addaudithook(_guard)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running[0] = item
    if not item.get_closest_marker("dist"):
        os.environ[NOT_DIST] = item.nodeid  # harness.launch.torchrun_cmd refuses to run then
    try:
        yield
    finally:
        _running[0] = None
        os.environ.pop(NOT_DIST, None)


@pytest.fixture(scope="module")
def two_ranks_run(request, tmp_path_factory):
    """Every case of the test module's ``WORKER`` (a script under tests/workers/) run in one torchrun
    launch on 2 gloo ranks, once per module: ``(out_dir, {rank: results})``, the launch's output
    folder (named after the worker) and each rank's results. The module's ``WORKER_TIMEOUT`` bounds
    the launch (seconds, default 300)."""
    from tests.dist_helper import launch_cases
    worker = request.module.WORKER
    out = tmp_path_factory.mktemp(Path(worker).stem)
    return out, launch_cases(worker, out, timeout=getattr(request.module, "WORKER_TIMEOUT", 300))


@pytest.fixture(scope="module")
def two_ranks(two_ranks_run):
    """``two_ranks_run``'s results alone: ``{rank: results}`` (``tests.dist_helper.case`` reads one)."""
    return two_ranks_run[1]


@pytest.fixture(autouse=True)
def _teardown_process_group_and_logging():
    yield
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    from framework.observability.logs import close_logging
    close_logging()
    logging.getLogger().setLevel(logging.WARNING)


def cuda_gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """``@pytest.mark.requires(gpus=N)``: the test needs N CUDA GPUs, and is skipped with one line
    saying how many this host has (litgpt's ``_RunIf``, for the one resource we test)."""
    marker = item.get_closest_marker("requires")
    if marker is None:
        return
    unknown = set(marker.kwargs) - {"gpus"}
    if marker.args or unknown:
        raise pytest.UsageError(f"{item.nodeid}: requires() takes gpus=N only, not {marker.args or sorted(unknown)}")
    needed, have = marker.kwargs.get("gpus", 0), cuda_gpus()
    if have < needed:
        pytest.skip(f"needs {needed} CUDA GPU(s); this host has {have}")
