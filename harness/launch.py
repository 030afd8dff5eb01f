"""Launch a worker script under torchrun, collect each rank's JSON result, and kill leftovers.

Shared by tests/ and bench/. torchrun starts every worker in its own session, so a failed or
timed-out launch could leave workers running; each worker registers its pid (``register_worker``)
and the launcher kills any that are still alive when the launch ends.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "ROOT", "Launch", "Nodes", "cli_args", "exit_worker", "finish_nodes", "finish_worker", "free_port",
    "kill_matching", "kill_registered", "launch", "launch_cases", "processes_matching", "recorded",
    "register_worker", "run_cases", "start_nodes", "torchrun_cmd", "wait_for", "wait_gone", "worker_env",
    "workers_by_rank", "write_result",
]

ROOT = Path(__file__).resolve().parents[1]  # the repository: torchrun runs from here


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_args(cfg: dict) -> list[str]:
    """``cfg`` as ddp_training.py flags: ``--key-name value``, booleans as true/false."""
    out = []
    for key, value in cfg.items():
        out += [f"--{key.replace('_', '-')}", str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT),
               PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


@dataclass
class Launch:
    returncode: int
    output: str
    results: dict[int, dict] = field(default_factory=dict)
    duration_s: float = 0.0
    leftovers: list[int] = field(default_factory=list)  # still alive after torchrun exited


def torchrun_cmd(script: str | Path, args: list[str], nproc: int = 2, port: int | None = None,
                 extra: list[str] | None = None) -> list[str]:
    not_dist = os.environ.get("PYTEST_NOT_DIST")  # set by tests/conftest.py, in the test's children too
    if not_dist:
        raise RuntimeError(f"{not_dist} starts torchrun but is not marked @pytest.mark.dist")
    port = port or free_port()
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", *(extra or []),
            str(script), *args]


def kill_registered(out_dir: Path) -> list[int]:
    """SIGKILL every registered worker pid that is still alive; returns those killed."""
    import psutil
    killed = []
    for pid_file in (out_dir / "pids").glob("*"):
        pid = int(pid_file.name)
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - float(pid_file.read_text() or 0)) < 1:
                proc.kill()
                killed.append(pid)
        except psutil.NoSuchProcess:
            pass
    return killed


def processes_matching(marker: str) -> list:
    """Live processes whose command line mentions ``marker`` (e.g. a test's temp directory)."""
    import psutil
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if proc.pid != os.getpid() and any(marker in part for part in cmdline):
            found.append(proc)
    return found


def kill_matching(marker: str) -> list[int]:
    """SIGKILL leftovers whose command line mentions ``marker``; returns their pids."""
    import psutil
    killed = []
    for proc in processes_matching(marker):
        try:
            proc.kill()
            killed.append(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return killed


def launch(script: str | Path, args: list[str], out_dir: Path, *, nproc: int = 2, timeout: float = 300,
           env: dict[str, str] | None = None, torchrun_extra: list[str] | None = None) -> Launch:
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = torchrun_cmd(script, args, nproc, extra=torchrun_extra)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=worker_env({"TEST_OUT_DIR": str(out_dir), **(env or {})}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        # torchrun starts its workers in sessions of their own, holding our stdout pipe: until they
        # are gone too, communicate() would wait for its end forever.
        kill_registered(out_dir)
        kill_matching(str(out_dir))
        output, _ = proc.communicate()
        output += f"\n[launch] torchrun timed out after {timeout}s and was killed"
    finally:
        leftovers = [p.pid for p in processes_matching(str(out_dir))]
        kill_registered(out_dir)
        kill_matching(str(out_dir))
    results = {}
    for path in out_dir.glob("result_rank*.json"):
        results[int(path.stem.removeprefix("result_rank"))] = json.loads(path.read_text())
    return Launch(proc.returncode, output, results, time.monotonic() - start, leftovers)


# --- worker side ---------------------------------------------------------------------------

def register_worker() -> Path:
    """Call first thing in a worker: records this pid so the launcher can clean up."""
    import psutil
    out_dir = Path(os.environ["TEST_OUT_DIR"])
    (out_dir / "pids").mkdir(parents=True, exist_ok=True)
    (out_dir / "pids" / str(os.getpid())).write_text(str(psutil.Process().create_time()))
    return out_dir


def write_result(out_dir: Path, rank: int, result: dict) -> None:
    tmp = out_dir / f".result_rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.replace(out_dir / f"result_rank{rank}.json")


def launch_cases(script: str | Path, out_dir: Path, *, timeout: float = 300) -> dict[int, dict]:
    """One 2-rank launch of a case-looping worker; asserts it succeeded and returns rank -> result."""
    run = launch(script, [], out_dir, nproc=2, timeout=timeout)
    assert run.returncode == 0, run.output[-4000:]
    assert sorted(run.results) == [0, 1], run.output[-4000:]
    return run.results


def recorded(fn, *args, **kwargs) -> dict:
    """``fn``'s result, or its error and traceback: one failing case must not hide the others."""
    import traceback
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # the case's failure is the result; pytest asserts on it
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def finish_worker(out_dir: Path, rank: int, result: dict) -> None:
    """Write this rank's result, leave the process group and exit (see ``exit_worker``)."""
    import torch.distributed as dist
    write_result(out_dir, rank, result)
    dist.destroy_process_group()
    exit_worker()


def run_cases(cases: dict[str, dict], run_case) -> None:
    """A case-looping worker's whole life under torchrun: join a gloo group, run
    ``run_case(name, overrides, out_dir)`` for each case (its error recorded, the ranks meeting
    after each), write this rank's results and exit."""
    import torch.distributed as dist
    out_dir = register_worker()
    dist.init_process_group("gloo")
    results = {}
    for name, overrides in cases.items():
        results[name] = recorded(run_case, name, overrides, out_dir)
        dist.barrier()
    finish_worker(out_dir, dist.get_rank(), {"cases": results})


def exit_worker(code: int = 0) -> None:
    """End a worker without the interpreter's finalisation, after its result is written: with
    gloo, torch 2.13 occasionally aborts there ("terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass
class Nodes:
    procs: list[subprocess.Popen]
    outputs: list[Path]
    out_dir: Path
    start: float


def start_nodes(script: str | Path, args: list[str], out_dir: Path, *, nnodes: int = 2, nproc_per_node: int = 1,
                rdzv_id: str = "multi-node-test", env: dict[str, str] | None = None,
                torchrun_extra: list[str] | None = None) -> Nodes:
    """Start ``nnodes`` torchrun agents on loopback, each one node of a c10d rendezvous on one
    endpoint. Each agent writes to a file, not a pipe: a full pipe would stall its workers."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    extra = ["--rdzv-id", rdzv_id, *(torchrun_extra or [])]
    nodes = Nodes([], [], out_dir, time.monotonic())
    for node in range(nnodes):
        cmd = torchrun_cmd(script, args, nproc_per_node, port=port, extra=extra)
        cmd[cmd.index("--nnodes") + 1] = str(nnodes)
        nodes.outputs.append(out_dir / f"node_{node}.out")
        with nodes.outputs[-1].open("w") as out:
            nodes.procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                                env=worker_env({"TEST_OUT_DIR": str(out_dir), **(env or {})}),
                                                start_new_session=True))
    return nodes


def finish_nodes(nodes: Nodes, timeout: float) -> list[Launch]:
    """Wait for every agent, up to ``timeout`` s after the start, then kill what is left; one
    Launch per node (its exit code and output)."""
    timed_out = False
    try:
        for proc in nodes.procs:
            proc.wait(timeout=max(0.0, nodes.start + timeout - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for proc in nodes.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        leftovers = [p.pid for p in processes_matching(str(nodes.out_dir))]
        kill_registered(nodes.out_dir)
        kill_matching(str(nodes.out_dir))
    duration = time.monotonic() - nodes.start
    launches = []
    for proc, path in zip(nodes.procs, nodes.outputs, strict=True):
        output = path.read_text()
        if timed_out:
            output += f"\n[launch] the nodes timed out after {timeout}s and were killed"
        launches.append(Launch(proc.returncode, output, {}, duration, leftovers))
    return launches


def workers_by_rank(agent_pids: list[int]) -> dict:
    """The live workers (psutil.Process) of these torchrun agents, by global rank (RANK in their env)."""
    import psutil
    workers = {}
    for agent in agent_pids:
        for child in psutil.Process(agent).children():
            rank = child.environ().get("RANK")
            if rank is not None:
                workers[int(rank)] = child
    return workers


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for the processes ``pids`` to end; returns those still alive. A
    zombie counts as ended: an orphan's new parent may be slow to reap it, or never do so."""
    import psutil

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    remaining = [pid for pid in pids if alive(pid)]
    while remaining and time.monotonic() < deadline:
        time.sleep(0.05)
        remaining = [pid for pid in remaining if alive(pid)]
    return remaining


def wait_for(condition, timeout: float, what: str, interval: float = 0.02) -> float:
    """Poll ``condition`` until it holds, failing (AssertionError naming ``what``) after ``timeout``
    seconds; returns the seconds it took."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"waited {timeout} s for {what}"
        time.sleep(interval)
    return time.monotonic() - start
