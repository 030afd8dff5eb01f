"""The torchrun launch helpers, kept under their old name for the tests' imports; they live in
harness.launch, which bench/ uses too. Beside them, the helpers that several test files and workers
share: the fault-test run (``FAULT_RUN``, ``args_for``), its logs, a one-rank process group, polling,
and a worker's record of an error."""

import json
import time
from pathlib import Path

from harness.launch import *  # noqa: F403
from harness.launch import cli_args


def case(results: dict, rank: int, name: str, harness_error: str = "error") -> dict:
    """Rank ``rank``'s result for case ``name`` of a ``launch_cases`` run, after checking that the
    case's harness did not fail (``harness_error``: the key the worker records such a failure under)."""
    out = results[rank]["cases"][name]
    assert harness_error not in out, out.get("traceback")
    return out


# A 2-rank launch of ddp_training.py for fault tests: 32 steps per epoch (256 samples, 2 ranks x
# batch 4); its 48 steps cross an epoch boundary.
FAULT_RUN = {"vocab_size": 64, "hidden_size": 96, "num_heads": 2, "num_layers": 2, "seq_len": 48, "dataset_size": 256,
             "batch_size": 4, "dropout": 0.1, "train.max_steps": 48, "checkpoint.every_steps": 8,
             "checkpoint.keep_last": 3, "log_interval": 1, "eval.interval": 0, "eval.steps": 4, "num_workers": 0,
             "train.deterministic": True, "logging.record_samples": True, "logging.tensorboard": True,
             "target_loss": 0.0, "learning_rate": 2e-3, "optim.warmup_steps": 4, "train.seed": 5}


def args_for(run_dir: Path, overrides: dict | None = None, /, *, base: dict = FAULT_RUN, **compact) -> list[str]:
    """ddp_training.py's arguments for ``base`` (FAULT_RUN unless a test module has its own) with
    ``overrides`` (dotted keys) and ``compact`` keys, its logs and checkpoints under ``run_dir``."""
    return cli_args({**base, "logging.dir": str(run_dir / "logs"), "checkpoint.dir": str(run_dir / "ck"),
                     **(overrides or {}), **compact})


def summary(run_dir: Path) -> dict:
    """The run's logs/summary.json."""
    return json.loads((run_dir / "logs" / "summary.json").read_text())


def rank_log(run_dir: Path, rank: int = 0, *, missing_ok: bool = False) -> str:
    """Rank ``rank``'s log of the run; "" if it wrote none and ``missing_ok`` (a poll while the run
    starts), else FileNotFoundError."""
    path = run_dir / "logs" / f"rank_{rank}.log"
    if missing_ok and not path.exists():
        return ""
    return path.read_text()


def one_process_group() -> None:
    """A gloo process group of one rank in this process, on an in-memory store (destroy it after; the
    conftest's autouse teardown does so too)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())


def holds_within(condition, seconds: float, interval: float = 0.05) -> bool:
    """Poll ``condition`` every ``interval`` s until it holds or ``seconds`` pass; whether it holds
    then (unlike ``wait_for``, which fails by itself, the caller asserts with its own message)."""
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(interval)
    return condition()


def error_record(err: BaseException, iteration: int, chars: int = 2000) -> dict:
    """A worker's JSON record of the error ``err`` raised at ``iteration``: its type, its first line
    and its first ``chars`` characters."""
    text = str(err)
    return {"iteration": iteration, "type": type(err).__name__,
            "message": text.splitlines()[0] if text else type(err).__name__, "full": text[:chars]}


def final_weights(run_dir: Path) -> dict:
    """The final weights a run in ``run_dir`` wrote (``ck/final_model.pt``)."""
    import torch
    return torch.load(run_dir / "ck" / "final_model.pt", weights_only=True)


def weight_diff(reference_dir: Path, run_dir: Path) -> float:
    """The largest difference between two runs' final weights."""
    reference, weights = final_weights(reference_dir), final_weights(run_dir)
    return max((weights[k].float() - reference[k].float()).abs().max().item() for k in reference)


def samples_per_epoch(run_dir: Path):
    """How many times each (epoch, sample) was trained, from the run's samples audit trail."""
    import collections

    from framework.observability.metrics import read_samples
    seen = collections.Counter()
    for path in (run_dir / "logs").glob("samples_rank_*.jsonl"):
        for record in read_samples(path):
            seen.update((record["epoch"], i) for i in record["indices"])
    return seen


OTHER_HOST = ["unshare", "--uts", "sh", "-c", 'hostname "other-host-$$" && exec "$0" "$@"']
"""A command's prefix that runs it under a host name of its own (a UTS namespace; exec keeps its
pid): as on another host, the run's other processes can neither read its fate from its pid nor kill it."""


def other_host_allowed() -> bool:
    import subprocess
    return subprocess.run([*OTHER_HOST[:2], "true"], capture_output=True).returncode == 0


def stop_launched(launched: list, run_dir: Path) -> None:
    """Kill what a test launched (each in a session of its own) and whatever of the run is left."""
    import os
    import signal
    for proc in launched:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    kill_matching(str(run_dir))  # noqa: F405  (harness.launch's)
