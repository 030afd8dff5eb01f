"""The torchrun launch helpers, kept under their old name for the tests' imports; they live in
harness.launch, which bench/ uses too."""

import json
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


def args_for(run_dir: Path, overrides: dict | None = None, /, **compact) -> list[str]:
    """ddp_training.py's arguments for FAULT_RUN with ``overrides`` (dotted keys) and ``compact`` keys, its
    logs and checkpoints under ``run_dir``."""
    return cli_args({**FAULT_RUN, "logging.dir": str(run_dir / "logs"), "checkpoint.dir": str(run_dir / "ck"),
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
