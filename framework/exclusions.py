"""The samples a loss-spike rollback excluded, kept in checkpoint_dir/EXCLUDED_SAMPLES.json so
that a restart after the rollback (before any newer checkpoint holds them) still excludes them.
The same file, or a plain JSON list of sample indices, is what ``exclude_samples`` reads.
Torch-free: the config check reads it."""

from __future__ import annotations

import json
from pathlib import Path

from . import atomic

FILE = "EXCLUDED_SAMPLES.json"


def read(path: str | Path) -> list[int]:
    """The sample indices in ``path``: a JSON list, or an object with a ``samples`` list.
    Raises ValueError saying what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError("file not found") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"unreadable: {err}") from None
    return _samples(data)


def _samples(data) -> list[int]:
    samples = data.get("samples") if isinstance(data, dict) else data
    if not isinstance(samples, list) or not all(isinstance(i, int) and i >= 0 for i in samples):
        raise ValueError('allowed: a JSON list of sample indices (integers >= 0), or {"samples": [...]}')
    return samples


def read_recorded(directory: str | Path) -> dict | None:
    """``{"samples", "rollbacks"}`` recorded by a rollback in ``directory``, or None."""
    path = Path(directory) / FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return {"samples": _samples(data), "rollbacks": list(data.get("rollbacks", []))}
    except (ValueError, OSError, AttributeError) as err:
        raise ValueError(f"{path}: {err}; it holds the samples a loss-spike rollback excluded: fix it (a JSON "
                         f"list of sample indices) or delete it to train on them again") from None


def record(directory: str | Path, samples: list[int], rollbacks: list[dict]) -> None:
    atomic.write_bytes(Path(directory) / FILE, json.dumps({"samples": samples, "rollbacks": rollbacks},
                                                          indent=1).encode())
