"""The run's store for healing in place (``launch_training.sh --heal``): torch's own TCPStore
server, hosted by a process of its own so that it outlives every training process (each rank's
torchrun job restarts its worker alone). The training processes reach it as HEAL_STORE; on N
nodes, node 0 hosts it on the port of ``--rdzv-endpoint`` and the others reach it there.

    python -m framework.ddp.run_store PORT_FILE [PORT]   # serves until SIGTERM; writes its port there
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import torch.distributed as dist

from ..state import atomic

LINGER_S = 10.0
"""After SIGTERM, how long the store waits for its last clients to hang up: on N nodes, node 0's
launcher stops it once its own ranks ended, and another node's ranks may still be finishing."""


def clients(port: int) -> int:
    """This process's open connections accepted on ``port``."""
    process = psutil.Process()
    connections = getattr(process, "net_connections", None) or process.connections  # psutil < 6: connections
    return sum(1 for c in connections(kind="tcp")
               if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def serve(port_file: Path, port: int = 0, host: str = "127.0.0.1", *, linger_s: float = LINGER_S) -> None:
    """Host the store on ``port`` (0: a free one), write the port into ``port_file`` (atomically),
    and serve until SIGTERM or SIGINT, then until the clients hang up, for up to ``linger_s``."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # Ctrl-C reaches the whole terminal: the store outlives the members' preemption saves, and the
    # launcher stops it (SIGTERM) once every rank's job has ended.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, use_libuv=True)
    atomic.write_bytes(port_file, str(store.port).encode())
    stop.wait()
    deadline = time.monotonic() + linger_s
    while clients(store.port) and time.monotonic() < deadline:
        time.sleep(0.1)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and not sys.argv[2].isdigit()):
        raise SystemExit("usage: python -m framework.ddp.run_store PORT_FILE [PORT]")
    serve(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) == 3 else 0)
