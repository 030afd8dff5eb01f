"""The run's store for healing in place (``launch_training.sh --heal``): torch's own TCPStore
server, hosted by a process of its own so that it outlives every training process (each rank's
torchrun job restarts its worker alone). The training processes reach it as HEAL_STORE.

    python -m framework.ddp.run_store PORT_FILE     # serves until SIGTERM; writes its port there
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import torch.distributed as dist

from ..state import atomic


def serve(port_file: Path, host: str = "127.0.0.1") -> None:
    """Host the store on a free port of ``host``, write the port into ``port_file`` (atomically),
    and serve until SIGTERM or SIGINT."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # Ctrl-C reaches the whole terminal: the store outlives the members' preemption saves, and the
    # launcher stops it (SIGTERM) once every rank's job has ended.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, use_libuv=True)
    atomic.write_bytes(port_file, str(store.port).encode())
    stop.wait()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m framework.ddp.run_store PORT_FILE")
    serve(Path(sys.argv[1]))
